#!/usr/bin/env bash
# Submits launch/slurm_gpu.sbatch: NODES nodes, one task per GPU (GPUS_PER_NODE tasks per node).
# `--gpus-per-node 0 --tasks-per-node T` submits a CPU job instead: T tasks per node, no GPUs,
# JAX_PLATFORMS=cpu (tests/e2e/test_slurm.py runs it on a one-node test cluster).
#
# Each GPU task gets --cpus-per-task host cores for its input pipeline: by default 11, the cores
# that feed one H200's measured CelebA DeiT-S step (4,756 images/s at 440 per core); the
# preflight (--mode=compile) prints the figure for a run and its target.
#
# Usage: launch/slurm.sh [--dry-run] --nodes N --gpus-per-node G [--tasks-per-node T]
#            [--cpus-per-task C] [--partition P] [--time HH:MM:SS] [--module MODULE]
#            -- [main args...]
# Example: launch/slurm.sh --nodes 2 --gpus-per-node 8 --time 04:00:00 -- \
#            --config=configs/quickstart.py --workdir=/shared/run
# Prints the sbatch command ("+ sbatch ...") and runs it unless --dry-run.
set -euo pipefail

# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] --nodes N --gpus-per-node G [--tasks-per-node T] [--cpus-per-task C]"
usage_args+=" [--partition P] [--time HH:MM:SS] [--module MODULE] -- [main args...]"

DEFAULT_CPUS_PER_GPU_TASK=11
dry_run=0 nodes="" gpus="" tasks="" cpus="" partition="" time_limit="" module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run | --dry_run) dry_run=1 ;;
    --nodes) option_value nodes "$@"; shift ;;
    --gpus-per-node) option_value gpus "$@"; shift ;;
    --tasks-per-node) option_value tasks "$@"; shift ;;
    --cpus-per-task) option_value cpus "$@"; shift ;;
    --partition) option_value partition "$@"; shift ;;
    --time) option_value time_limit "$@"; shift ;;
    --module) option_value module "$@"; shift ;;
    --) shift; break ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
require_positive_int --nodes "$nodes"
[[ "$gpus" == 0 ]] || require_positive_int --gpus-per-node "$gpus"
if [[ "$gpus" == 0 ]]; then
  [[ -n "$tasks" ]] || usage_error "--gpus-per-node 0 (a CPU job) needs --tasks-per-node"
  require_positive_int --tasks-per-node "$tasks"
elif [[ -n "$tasks" ]]; then
  usage_error "--tasks-per-node is for CPU jobs (--gpus-per-node 0): a GPU job runs one task per GPU"
fi
[[ -z "$cpus" ]] || require_positive_int --cpus-per-task "$cpus"
[[ "$gpus" == 0 || -n "$cpus" ]] || cpus=$DEFAULT_CPUS_PER_GPU_TASK
[[ -z "$time_limit" || "$time_limit" =~ ^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$ ]] ||
  usage_error "bad --time: $time_limit"
require_module "$module"

# Every main needs --workdir: without it the job would wait in the queue for its nodes, then fail.
[[ -n "$(main_workdir "$@")" ]] || usage_error "no --workdir=DIR among the main args after --"

script="$launch_dir/slurm_gpu.sbatch"
if [[ "$gpus" == 0 ]]; then
  # --gpus-per-task=0 overrides the batch script's `#SBATCH --gpus-per-task=1`; JAX_PLATFORMS
  # keeps an installed CUDA plugin from looking for GPUs.
  cmd=(sbatch "--nodes=$nodes" "--ntasks-per-node=$tasks" --gpus-per-task=0
    "--export=ALL,MODULE=$module,JAX_PLATFORMS=cpu")
else
  cmd=(sbatch "--nodes=$nodes" "--ntasks-per-node=$gpus" --gpus-per-task=1
    "--export=ALL,MODULE=$module")
fi
if [[ -n "$cpus" ]]; then cmd+=("--cpus-per-task=$cpus"); fi
if [[ -n "$partition" ]]; then cmd+=("--partition=$partition"); fi
if [[ -n "$time_limit" ]]; then cmd+=("--time=$time_limit"); fi
cmd+=("$script" "$@")

print_cmd "${cmd[@]}"
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
