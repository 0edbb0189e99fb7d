# Helpers shared by the launch scripts (local.sh, local_multiprocess.sh, slurm.sh, tpu_pod.sh).
# Sourced, not run. Before calling them a script sets `usage_args` (its usage line after
# "usage: SCRIPT") and, for `run`, `dry_run` (0 or 1).
# slurm_gpu.sbatch does not source this file: SLURM runs a spooled copy of it, away from here.

# The script that sourced this file: show_help prints its header comment.
launch_script=${BASH_SOURCE[1]}
# This folder, where the scripts found this file (through any symlink to them): the batch
# scripts and the repository are found from it, not from the path the script was called by.
launch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Prints the comment at the top of the calling script (what it does, its usage and an example).
show_help() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$launch_script"
  exit 0
}

# Prints the usage line to stderr and exits 2.
usage() {
  echo "usage: $0 $usage_args" >&2
  exit 2
}

# Prints a message to stderr, then the usage, and exits 2.
usage_error() {
  echo "$1" >&2
  usage
}

# In an option loop, `option_value VAR "$@"` sets VAR to the option's value (the loop's $2),
# which must be there and not be empty (otherwise: the usage, exit 2); the loop shifts it.
option_value() {
  [[ $# -ge 3 && -n "$3" ]] || usage
  printf -v "$1" '%s' "$3"
}

# Succeeds when a word is a positive integer (digits only, no leading zero).
is_positive_int() {
  [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

# `require_positive_int OPTION VALUE`: the usage, exit 2, unless VALUE is a positive integer.
require_positive_int() {
  is_positive_int "$2" || usage_error "$1 must be a positive integer"
}

# `require_module MODULE` (the --module option): the usage, exit 2, unless it is a module name.
require_module() {
  [[ "$1" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || usage_error "bad --module: $1"
}

# `main_workdir ARG...` (a main's args): prints the value of its --workdir (either spelling).
main_workdir() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --workdir=*) printf '%s' "${1#--workdir=}"; return ;;
      --workdir) printf '%s' "${2:-}"; return ;;
    esac
    shift
  done
}

# Quotes one word for a shell, only when needed.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints the words, each quoted when needed and preceded by a space.
quote_words() {
  local word line=""
  for word in "$@"; do line+=" $(quote "$word")"; done
  printf '%s' "$line"
}

# Prints a command as "+ cmd args".
print_cmd() {
  echo "+$(quote_words "$@")"
}

# Prints a command ("+ cmd args"), then runs it unless --dry-run.
run() {
  print_cmd "$@"
  if [[ $dry_run == 0 ]]; then "$@"; fi
}
