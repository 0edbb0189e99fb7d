#!/usr/bin/env bash
# Runs N JAX processes on this machine, as a multi-host run would: process i gets
# JAX_COORDINATOR_ADDRESS=localhost:PORT JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i (read by
# trainkit.distributed) and JAX_PLATFORMS=cpu unless JAX_PLATFORMS is already set. Each output
# line is prefixed with "[i] ". Waits for all; if one fails, the others are killed and the
# script exits with the failed process's status.
#
# Usage: launch/local_multiprocess.sh [--dry-run] --processes N [--port PORT] [--module MODULE]
#            -- [main args...]
# Example: launch/local_multiprocess.sh --processes 2 -- --config=configs/quickstart.py \
#            --workdir=/tmp/run2
# N is at most the number of CPUs. The python interpreter is $PYTHON (default: python).
# --dry-run only prints the commands.
set -euo pipefail

# common.sh sits beside this file (a symlink to this file is followed).
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")")/common.sh"
usage_args="[--dry-run] --processes N [--port PORT] [--module MODULE] -- [main args...]"

dry_run=0 processes="" port=12345 module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run | --dry_run) dry_run=1 ;;
    --processes) option_value processes "$@"; shift ;;
    --port) option_value port "$@"; shift ;;
    --module) option_value module "$@"; shift ;;
    --) shift; break ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
require_positive_int --processes "$processes"
# At most one per CPU: each is a whole JAX runtime, and a typo (100000) would swamp the host.
cpus=$(getconf _NPROCESSORS_ONLN)
[[ "$processes" -le "$cpus" ]] ||
  usage_error "--processes $processes: at most this machine's $cpus CPUs"
is_positive_int "$port" && [[ "$port" -le 65535 ]] || usage_error "bad --port: $port"
require_module "$module"

pids=()
kill_all() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'kill_all; exit 130' INT TERM

for ((i = 0; i < processes; i++)); do
  cmd=(env "JAX_COORDINATOR_ADDRESS=localhost:$port" "JAX_NUM_PROCESSES=$processes"
    "JAX_PROCESS_ID=$i" "JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}" "${PYTHON:-python}" -m "$module" "$@")
  print_cmd "${cmd[@]}"
  if [[ $dry_run == 0 ]]; then
    "${cmd[@]}" > >(sed "s/^/[$i] /") 2>&1 &
    pids+=("$!")
  fi
done
if [[ $dry_run == 1 ]]; then exit 0; fi

# Polls rather than `wait -n`, so that bash 3.2 (macOS) works too.
status=0
remaining=${#pids[@]}
done_flags=()
while [[ $remaining -gt 0 ]]; do
  for i in "${!pids[@]}"; do
    [[ -z "${done_flags[$i]:-}" ]] || continue
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      done_flags[i]=1
      remaining=$((remaining - 1))
      rc=0
      wait "${pids[$i]}" || rc=$?
      if [[ $rc != 0 && $status == 0 ]]; then
        status=$rc
        echo "process $i exited with status $rc; stopping the others" >&2
        kill_all
      fi
    fi
  done
  sleep 0.2
done
wait  # Lets the output prefixers flush.
exit "$status"
