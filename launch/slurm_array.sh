#!/usr/bin/env bash
# Submits a sweep's runs to SLURM as one job array: one array task per run of COMMANDS_FILE
# (written by `python -m paper_runner.sweep --mode=commands`, without --launcher), each running
# launch/slurm_array.sbatch. Runs that have a report.json are done and are not submitted, so
# the same command resubmits what a cancellation, a failure or a time limit left unfinished;
# those runs resume from their checkpoints. Tasks write SWEEP/slurm/<job>_<task>.out, the runs
# their own log.txt. Afterwards `python -m paper_runner.sweep --mode=collect` tabulates.
#
# Usage: launch/slurm_array.sh [--dry-run] [--parallel N] [--gpus-per-run G] [--cpus-per-run C]
#            [--partition P] [--time HH:MM:SS] COMMANDS_FILE
#   --parallel N      at most N runs at a time (sbatch --array=...%N); default: no limit
#   --gpus-per-run G  G GPUs per run, one SLURM task (process) per GPU on one node; default 0:
#                     a CPU run, one task, JAX_PLATFORMS=cpu
#   --cpus-per-run C  CPUs per task (default 1)
# Example: python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py \
#            --workdir=/shared/sweep --mode=commands
#          launch/slurm_array.sh --gpus-per-run 1 --time 02:00:00 /shared/sweep/commands.sh
# Prints the sbatch command ("+ sbatch ...") and runs it unless --dry-run.
set -euo pipefail

# common.sh sits beside this file (a symlink to this file is followed).
here="$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")"
# shellcheck source=common.sh
source "$here/common.sh"
usage_args="[--dry-run] [--parallel N] [--gpus-per-run G] [--cpus-per-run C] [--partition P]"
usage_args+=" [--time HH:MM:SS] COMMANDS_FILE"

dry_run=0 parallel="" gpus=0 cpus=1 partition="" time_limit="" commands=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run | --dry_run) dry_run=1 ;;
    --parallel) option_value parallel "$@"; shift ;;
    --gpus-per-run) option_value gpus "$@"; shift ;;
    --cpus-per-run) option_value cpus "$@"; shift ;;
    --partition) option_value partition "$@"; shift ;;
    --time) option_value time_limit "$@"; shift ;;
    -*) usage_error "unknown argument: $1" ;;
    *)
      [[ -z "$commands" ]] || usage_error "unexpected argument: $1 (one COMMANDS_FILE)"
      commands=$1
      ;;
  esac
  shift
done
[[ -n "$commands" ]] || usage_error "COMMANDS_FILE is required"
[[ -f "$commands" ]] || usage_error "no such file: $commands"
[[ -z "$parallel" ]] || require_positive_int --parallel "$parallel"
[[ "$gpus" == 0 ]] || require_positive_int --gpus-per-run "$gpus"
require_positive_int --cpus-per-run "$cpus"
[[ -z "$time_limit" || "$time_limit" =~ ^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$ ]] ||
  usage_error "bad --time: $time_limit"

# Absolute, because the task runs a spooled copy of the batch script from wherever.
commands="$(cd "$(dirname "$commands")" && pwd)/$(basename "$commands")"
script="$here/slurm_array.sbatch"
# The batch script itself says which runs have no report.json (one reading of commands.sh).
pending=$(bash "$script" --pending "$commands")
if [[ -z "$pending" ]]; then
  echo "Every run of $commands has its report.json: nothing to submit."
  exit 0
fi

out_dir="$(dirname "$commands")/slurm"
array="--array=$pending"
if [[ -n "$parallel" ]]; then array+="%$parallel"; fi
cmd=(sbatch "$array" "--output=$out_dir/%A_%a.out")
if [[ "$gpus" == 0 ]]; then
  cmd+=(--ntasks=1 "--cpus-per-task=$cpus" "--export=ALL,JAX_PLATFORMS=cpu")
else
  cmd+=(--nodes=1 "--ntasks=$gpus" --gpus-per-task=1 "--cpus-per-task=$cpus" --export=ALL)
fi
if [[ -n "$partition" ]]; then cmd+=("--partition=$partition"); fi
if [[ -n "$time_limit" ]]; then cmd+=("--time=$time_limit"); fi
cmd+=("$script" "$commands")

print_cmd "${cmd[@]}"
if [[ $dry_run == 1 ]]; then exit 0; fi
mkdir -p "$out_dir"
exec "${cmd[@]}"
