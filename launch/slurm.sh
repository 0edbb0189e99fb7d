#!/usr/bin/env bash
# Submits launch/slurm_gpu.sbatch: NODES nodes, one task per GPU (GPUS_PER_NODE tasks per node).
#
# Usage: launch/slurm.sh [--dry-run] --nodes N --gpus-per-node G [--partition P]
#            [--time HH:MM:SS] [--module MODULE] -- [main args...]
# Example: launch/slurm.sh --nodes 2 --gpus-per-node 8 --time 04:00:00 -- \
#            --config=configs/quickstart.py --workdir=/shared/run
# Prints the sbatch command ("+ sbatch ...") and runs it unless --dry-run.
set -euo pipefail

# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] --nodes N --gpus-per-node G [--partition P] [--time HH:MM:SS]"
usage_args+=" [--module MODULE] -- [main args...]"

dry_run=0 nodes="" gpus="" partition="" time_limit="" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run) dry_run=1 ;;
    --nodes) option_value nodes "$@"; shift ;;
    --gpus-per-node) option_value gpus "$@"; shift ;;
    --partition) option_value partition "$@"; shift ;;
    --time) option_value time_limit "$@"; shift ;;
    --module) option_value module "$@"; shift ;;
    --) shift; break ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
require_positive_int --nodes "$nodes"
require_positive_int --gpus-per-node "$gpus"
[[ -z "$time_limit" || "$time_limit" =~ ^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$ ]] ||
  usage_error "bad --time: $time_limit"
require_module "$module"

script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/slurm_gpu.sbatch"
cmd=(sbatch "--nodes=$nodes" "--ntasks-per-node=$gpus" --gpus-per-task=1
  "--export=ALL,MODULE=$module")
if [[ -n "$partition" ]]; then cmd+=("--partition=$partition"); fi
if [[ -n "$time_limit" ]]; then cmd+=("--time=$time_limit"); fi
cmd+=("$script" "$@")

print_cmd "${cmd[@]}"
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
