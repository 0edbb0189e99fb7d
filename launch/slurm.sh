#!/usr/bin/env bash
# Submits launch/slurm_gpu.sbatch: NODES nodes, one task per GPU (GPUS_PER_NODE tasks per node).
#
# Usage: launch/slurm.sh [--dry-run] --nodes N --gpus-per-node G [--partition P]
#            [--time HH:MM:SS] [--module MODULE] -- [main args...]
# Example: launch/slurm.sh --nodes 2 --gpus-per-node 8 --time 04:00:00 -- \
#            --config=configs/quickstart.py --workdir=/shared/run
# Prints the sbatch command ("+ sbatch ...") and runs it unless --dry-run.
set -euo pipefail

# Prints the comment at the top of this file (what it does, its usage and an example).
show_help() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' \
    "${BASH_SOURCE[0]}"
  exit 0
}

usage() {
  echo "usage: $0 [--dry-run] --nodes N --gpus-per-node G [--partition P] [--time HH:MM:SS]" \
    "[--module MODULE] -- [main args...]" >&2
  exit 2
}

dry_run=0 nodes="" gpus="" partition="" time_limit="" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run) dry_run=1 ;;
    --nodes | --gpus-per-node | --partition | --time | --module)
      [[ $# -ge 2 && -n "$2" ]] || usage
      case "$1" in
        --nodes) nodes=$2 ;;
        --gpus-per-node) gpus=$2 ;;
        --partition) partition=$2 ;;
        --time) time_limit=$2 ;;
        --module) module=$2 ;;
      esac
      shift
      ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
  shift
done
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || { echo "--nodes must be a positive integer" >&2; usage; }
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || { echo "--gpus-per-node must be a positive integer" >&2; usage; }
[[ -z "$time_limit" || "$time_limit" =~ ^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$ ]] ||
  { echo "bad --time: $time_limit" >&2; usage; }
[[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || { echo "bad --module: $module" >&2; usage; }

script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/slurm_gpu.sbatch"
cmd=(sbatch "--nodes=$nodes" "--ntasks-per-node=$gpus" --gpus-per-task=1
  "--export=ALL,MODULE=$module")
if [[ -n "$partition" ]]; then cmd+=("--partition=$partition"); fi
if [[ -n "$time_limit" ]]; then cmd+=("--time=$time_limit"); fi
cmd+=("$script" "$@")

# Quotes one word for a shell, only when needed.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}
line="+"
for word in "${cmd[@]}"; do line+=" $(quote "$word")"; done
echo "$line"
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
