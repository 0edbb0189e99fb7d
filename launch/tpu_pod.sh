#!/usr/bin/env bash
# Runs a training on a Cloud TPU pod slice from a workstation: creates the slice, copies this
# repository to every worker, installs it, runs the main on all workers (their output streams
# here through ssh) and, with --delete-after, deletes the slice.
#
# Usage: launch/tpu_pod.sh [--dry-run] --name NAME --zone ZONE --accelerator TYPE
#            [--version VERSION] [--project PROJECT] [--module MODULE] [--delete-after]
#            [--no-create] -- [main args...]
# Example: launch/tpu_pod.sh --name moe-16 --zone us-west4-a --accelerator v5litepod-16 \
#            --delete-after -- --config=configs/quickstart.py --workdir=gs://bucket/run
# Every command is printed (prefixed with "+ ") before it runs; --dry-run only prints them.
# The workdir should be a gs:// path (or another directory shared by all workers).
# trainkit.distributed reads TRAINKIT_DISTRIBUTED=auto and lets JAX detect the pod.
set -euo pipefail

# Prints the comment at the top of this file (what it does, its usage and an example).
show_help() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' \
    "${BASH_SOURCE[0]}"
  exit 0
}

usage() {
  echo "usage: $0 [--dry-run] --name NAME --zone ZONE --accelerator TYPE [--version VERSION]" \
    "[--project PROJECT] [--module MODULE] [--delete-after] [--no-create] -- [main args...]" >&2
  exit 2
}

dry_run=0 delete_after=0 create=1
name="" zone="" accelerator="" project=""
version="tpu-ubuntu2204-base" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run) dry_run=1 ;;
    --delete-after) delete_after=1 ;;
    --no-create) create=0 ;;
    --name | --zone | --accelerator | --version | --project | --module)
      [[ $# -ge 2 && -n "$2" ]] || usage
      case "$1" in
        --name) name=$2 ;;
        --zone) zone=$2 ;;
        --accelerator) accelerator=$2 ;;
        --version) version=$2 ;;
        --project) project=$2 ;;
        --module) module=$2 ;;
      esac
      shift
      ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
  shift
done
[[ -n "$name" && -n "$zone" && -n "$accelerator" ]] || usage
[[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || { echo "bad --module: $module" >&2; usage; }

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
remote_dir="fairmoe"
archive="/tmp/${name}-repo.tar.gz"
common=(--zone="$zone")
if [[ -n "$project" ]]; then common+=(--project="$project"); fi

# Quotes one word for a shell, only when needed.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints a command ("+ cmd args"), then runs it unless --dry-run.
run() {
  local line="+" word
  for word in "$@"; do line+=" $(quote "$word")"; done
  echo "$line"
  if [[ $dry_run == 0 ]]; then "$@"; fi
}

main_args=""
for word in "$@"; do main_args+=" $(quote "$word")"; done

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
run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all \
  --command="rm -rf ${remote_dir} && mkdir -p ${remote_dir} && tar -xzf ${remote_dir}.tar.gz -C ${remote_dir} && cd ${remote_dir} && pip install -q -e . 'jax[tpu]'"
# Runs on every worker at once; their output streams here.
run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all \
  --command="cd ${remote_dir} && TRAINKIT_DISTRIBUTED=auto python3 -m ${module}${main_args}"
