#!/usr/bin/env bash
# Runs a training on a Cloud TPU pod slice from a workstation: creates the slice, copies this
# repository to every worker, installs it (with gcsfs, for a gs:// workdir), runs the main on
# all workers (their output streams here through ssh) and, with --delete-after, deletes the
# slice.
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

# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] --name NAME --zone ZONE --accelerator TYPE [--version VERSION]"
usage_args+=" [--project PROJECT] [--module MODULE] [--delete-after] [--no-create]"
usage_args+=" -- [main args...]"

dry_run=0 delete_after=0 create=1
name="" zone="" accelerator="" project=""
version="tpu-ubuntu2204-base" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run) dry_run=1 ;;
    --delete-after) delete_after=1 ;;
    --no-create) create=0 ;;
    --name) option_value name "$@"; shift ;;
    --zone) option_value zone "$@"; shift ;;
    --accelerator) option_value accelerator "$@"; shift ;;
    --version) option_value version "$@"; shift ;;
    --project) option_value project "$@"; shift ;;
    --module) option_value module "$@"; shift ;;
    --) shift; break ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
[[ -n "$name" && -n "$zone" && -n "$accelerator" ]] || usage
require_module "$module"

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
remote_dir="fairmoe"
archive="/tmp/${name}-repo.tar.gz"
common=(--zone="$zone")
if [[ -n "$project" ]]; then common+=(--project="$project"); fi

main_args=$(quote_words "$@")

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
  --command="rm -rf ${remote_dir} && mkdir -p ${remote_dir} && tar -xzf ${remote_dir}.tar.gz -C ${remote_dir} && cd ${remote_dir} && pip install -q -e . 'jax[tpu]' gcsfs"
# Runs on every worker at once; their output streams here.
run gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all \
  --command="cd ${remote_dir} && TRAINKIT_DISTRIBUTED=auto python3 -m ${module}${main_args}"
