#!/usr/bin/env bash
# Runs a config on this machine. Usage: launch/local.sh [--dry-run] CONFIG WORKDIR [extra flags...]
# Multi-host launchers (TPU pods, SLURM) come with the scale-out issue.
set -euo pipefail
# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] CONFIG WORKDIR [--config.key=value ...]"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then show_help; fi
dry_run=0
if [[ "${1:-}" == "--dry-run" || "${1:-}" == "--dry_run" ]]; then dry_run=1; shift; fi
if [[ $# -lt 2 ]]; then usage; fi
config=$1 workdir=$2
shift 2
cmd=(python -m fairmoe_jax.main "--config=${config}" "--workdir=${workdir}" "$@")
echo "will run: ${cmd[*]}"
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
