#!/usr/bin/env bash
# Runs a training on a Cloud TPU pod slice from a workstation: creates the slice, copies this
# repository to every worker, installs it (with gcsfs, for a gs:// workdir), runs the main on
# all workers (their output streams here through ssh) and, with --delete-after, deletes the
# slice.
#
# Usage: launch/tpu_pod.sh [--dry-run] --name NAME --zone ZONE --accelerator TYPE
#            [--version VERSION] [--project PROJECT] [--module MODULE] [--delete-after]
#            [--no-create] (-- [main args...] | --commands FILE)
# Example: launch/tpu_pod.sh --name moe-16 --zone us-west4-a --accelerator v5litepod-16 \
#            --delete-after -- --config=configs/quickstart.py --workdir=gs://bucket/run
# A sweep's whole grid on one slice: --commands FILE ("-": standard input) takes the commands
# that `python -m paper_runner.sweep --mode=commands` wrote without --launcher (one
# `python -m MODULE ARGS` line per run). The slice is created and set up once, runs them one
# after the other on all workers, and with --delete-after is deleted after the last. A run
# whose gs:// workdir holds its report.json is skipped; a failed run does not stop the others
# (the script then exits 1 naming it, and the same command resumes it). Example:
#   python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py \
#       --workdir=gs://bucket/sweep --mode=commands
#   gcloud storage cat gs://bucket/sweep/commands.sh | launch/tpu_pod.sh --name moe-16 \
#       --zone us-west4-a --accelerator v5litepod-16 --delete-after --commands -
#   python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py \
#       --workdir=gs://bucket/sweep --mode=collect
# Every command is printed (prefixed with "+ ") before it runs; --dry-run only prints them.
# The workdir should be a gs:// path (or another directory shared by all workers); with
# --delete-after it must be gs://, as the slice's disks go with it. The workers keep their copy
# in ~/fairmoe, updated in place (a relative workdir, under it, is never deleted), and run it in
# ~/fairmoe/.venv with Python 3.11 or newer (launch/tpu_worker_venv.sh).
# trainkit.distributed reads TRAINKIT_DISTRIBUTED=auto and lets JAX detect the pod.
set -euo pipefail

# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] --name NAME --zone ZONE --accelerator TYPE [--version VERSION]"
usage_args+=" [--project PROJECT] [--module MODULE] [--delete-after] [--no-create]"
usage_args+=" (-- [main args...] | --commands FILE)"

dry_run=0 delete_after=0 create=1
name="" zone="" accelerator="" project="" commands=""
version="tpu-ubuntu2204-base" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run | --dry_run) dry_run=1 ;;
    --delete-after) delete_after=1 ;;
    --no-create) create=0 ;;
    --name) option_value name "$@"; shift ;;
    --zone) option_value zone "$@"; shift ;;
    --accelerator) option_value accelerator "$@"; shift ;;
    --version) option_value version "$@"; shift ;;
    --project) option_value project "$@"; shift ;;
    --module) option_value module "$@"; shift ;;
    --commands) option_value commands "$@"; shift ;;
    --) shift; break ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
[[ -n "$name" && -n "$zone" && -n "$accelerator" ]] || usage
require_module "$module"

# The runs, as (module, quoted main args) pairs: the one of the command line, or one per line of
# --commands, all read before the slice is created (a bad line costs nothing).
run_modules=() run_args=()
if [[ -z "$commands" ]]; then
  run_modules+=("$module") run_args+=("$(quote_words "$@")")
else
  [[ $# -eq 0 ]] || usage_error "--commands takes the runs from FILE: no main args after --"
  [[ "$commands" == "-" || -r "$commands" ]] || usage_error "--commands: cannot read $commands"
  number=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    number=$((number + 1))
    line="${line#"${line%%[![:space:]]*}"}"  # Leading blanks off.
    # The script's own lines (#!, comments, set -euo pipefail, cd REPO) are not runs.
    [[ -z "$line" || "$line" == "#"* || "$line" == "set "* || "$line" == "cd "* ]] && continue
    # The sweep quoted each word for a shell: the arguments go to the workers' shell as written.
    pattern='^python3?[[:space:]]+-m[[:space:]]+([A-Za-z_][A-Za-z0-9_.]*)(([[:space:]].*)?)$'
    [[ "$line" =~ $pattern ]] || usage_error "--commands: line $number is not 'python -m MODULE \
ARGS' (write the sweep's commands without --launcher): $line"
    args="${BASH_REMATCH[2]}"
    run_modules+=("${BASH_REMATCH[1]}") run_args+=("${args%"${args##*[![:space:]]}"}")
  done < <(if [[ "$commands" == "-" ]]; then cat; else cat -- "$commands"; fi)
  [[ ${#run_modules[@]} -gt 0 ]] || usage_error "--commands: no 'python -m MODULE ARGS' line"
fi
if [[ $delete_after == 1 ]]; then
  for args in "${run_args[@]}"; do
    eval "words=($args)"  # As the workers' shell will split it.
    workdir=$(main_workdir ${words[@]+"${words[@]}"})
    [[ "$workdir" == gs://?* ]] || usage_error "--delete-after deletes the slice with its disks, \
so the workdir must be gs://BUCKET/...: --workdir=$workdir"
  done
fi

repo_root=$(dirname "$launch_dir")
remote_dir="fairmoe"
archive="/tmp/${name}-repo.tar.gz"
common=(--zone="$zone")
if [[ -n "$project" ]]; then common+=(--project="$project"); fi

cleanup() {
  local status=$?
  if [[ $delete_after == 1 ]]; then
    run gcloud compute tpus tpu-vm delete "$name" "${common[@]}" --quiet || true
  fi
  exit "$status"
}

if [[ $create == 1 ]]; then
  run gcloud compute tpus tpu-vm create "$name" "${common[@]}" \
    --accelerator-type="$accelerator" --version="$version"
fi
trap cleanup EXIT
# Copy the working tree (tracked and untracked files, not ignored ones) to every worker.
run bash -c "cd $(quote "$repo_root") && git ls-files -z --cached --others --exclude-standard \
| tar --null -czf $(quote "$archive") -T -"
run gcloud compute tpus tpu-vm scp "$archive" "${name}:${remote_dir}.tar.gz" "${common[@]}" \
  --worker=all
# Unpacked over the copy of an earlier launch, never deleting it: a relative workdir is in it.
run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all \
  --command="mkdir -p ${remote_dir} && tar -xzf ${remote_dir}.tar.gz -C ${remote_dir} && \
cd ${remote_dir} && bash launch/tpu_worker_venv.sh && . .venv/bin/activate && \
pip install -q -e . 'jax[tpu]' gcsfs"
# `run_on_workers MODULE ARGS`: the main on every worker at once; their output streams here.
run_on_workers() {
  run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all \
    --command="cd ${remote_dir} && . .venv/bin/activate && \
TRAINKIT_DISTRIBUTED=auto python3 -m $1$2"
}
if [[ -z "$commands" ]]; then
  run_on_workers "${run_modules[0]}" "${run_args[0]}"  # Its failure is the script's.
  exit 0
fi
# `finished ARGS`: whether the run's gs:// workdir holds its report.json (not asked in a dry run).
finished() {
  [[ $dry_run == 0 && "$1" =~ --workdir=(gs://[^[:space:]\']+) ]] || return 1
  gcloud storage ls "${BASH_REMATCH[1]}/report.json" >/dev/null 2>&1
}
# The grid: one run after the other; a failed run does not stop the rest.
failed=()
for i in "${!run_modules[@]}"; do
  if finished "${run_args[$i]}"; then
    echo "== run $((i + 1)) of ${#run_modules[@]}: finished already (report.json), skipped" >&2
    continue
  fi
  echo "== run $((i + 1)) of ${#run_modules[@]}:${run_args[$i]}" >&2
  run_on_workers "${run_modules[$i]}" "${run_args[$i]}" || failed+=("$((i + 1))")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "${#failed[@]} of ${#run_modules[@]} runs failed (run ${failed[*]}); the same command" \
    "reruns them, each from its checkpoint, and skips the finished ones" >&2
  exit 1
fi
