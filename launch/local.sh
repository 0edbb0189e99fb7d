#!/usr/bin/env bash
# Runs a config on this machine. Usage: launch/local.sh [--dry-run] CONFIG WORKDIR [extra flags...]
# Multi-host launchers (TPU pods, SLURM) come with the scale-out issue.
set -euo pipefail
# Prints the comment at the top of this file (what it does, its usage and an example).
show_help() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' \
    "${BASH_SOURCE[0]}"
  exit 0
}
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then show_help; fi
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [--dry-run] CONFIG WORKDIR [--config.key=value ...]" >&2
  exit 2
fi
config=$1 workdir=$2
shift 2
cmd=(python -m fairmoe_jax.main "--config=${config}" "--workdir=${workdir}" "$@")
echo "will run: ${cmd[*]}"
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
