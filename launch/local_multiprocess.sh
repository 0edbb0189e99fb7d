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
# The python interpreter is $PYTHON (default: python). --dry-run only prints the commands.
set -euo pipefail

# Prints the comment at the top of this file (what it does, its usage and an example).
show_help() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' \
    "${BASH_SOURCE[0]}"
  exit 0
}

usage() {
  echo "usage: $0 [--dry-run] --processes N [--port PORT] [--module MODULE] -- [main args...]" >&2
  exit 2
}

dry_run=0 processes="" port=12345 module="fairmoe_jax.main"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) show_help ;;
    --dry-run) dry_run=1 ;;
    --processes | --port | --module)
      [[ $# -ge 2 && -n "$2" ]] || usage
      case "$1" in
        --processes) processes=$2 ;;
        --port) port=$2 ;;
        --module) module=$2 ;;
      esac
      shift
      ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
  shift
done
[[ "$processes" =~ ^[1-9][0-9]*$ ]] || { echo "--processes must be a positive integer" >&2; usage; }
[[ "$port" =~ ^[1-9][0-9]*$ && "$port" -le 65535 ]] || { echo "bad --port: $port" >&2; usage; }
[[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || { echo "bad --module: $module" >&2; usage; }

# Quotes one word for a shell, only when needed.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

pids=()
kill_all() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'kill_all; exit 130' INT TERM

for ((i = 0; i < processes; i++)); do
  cmd=(env "JAX_COORDINATOR_ADDRESS=localhost:$port" "JAX_NUM_PROCESSES=$processes"
    "JAX_PROCESS_ID=$i" "JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}" "${PYTHON:-python}" -m "$module" "$@")
  line="+"
  for word in "${cmd[@]}"; do line+=" $(quote "$word")"; done
  echo "$line"
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
