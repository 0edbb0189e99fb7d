#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests (tests/e2e/test_slurm.py) and CI (.ci/run).
#
# Usage: launch/testing/local_slurm.sh start|stop|status
#   start   installs munge, slurmctld, slurmd and the SLURM clients with apt-get where they are
#           missing (needs root), writes a slurm.conf with one node (this host, 2 CPUs, no
#           GPUs), starts munged, slurmctld and slurmd, and waits until sinfo shows the node
#           idle. Starting a running cluster restarts it with a clean state.
#   stop    stops the three daemons.
#   status  exit 0 when the node answers and is idle (or allocated/mixed), 1 otherwise.
# Everything lives under LOCAL_SLURM_DIR (default /tmp/local_slurm): slurm.conf, the munge
# key and socket, the daemons' state, logs and pid files. Clients find the cluster through
# SLURM_CONF=$LOCAL_SLURM_DIR/slurm.conf; when /etc/slurm/slurm.conf does not exist it is made
# a link to it, so plain `sinfo`, `srun` and `sbatch` work too (stop removes the link).
# Exit status 0 on success, 1 when the cluster cannot start (no root, no apt-get, a daemon that
# does not come up: the message says which, with the end of its log), 2 for a bad argument.
set -euo pipefail

dir=${LOCAL_SLURM_DIR:-/tmp/local_slurm}
conf="$dir/slurm.conf"
munge_socket="$dir/munge/munge.socket.2"
# The path that SLURM's clients read when SLURM_CONF is unset (Debian's build).
default_conf=/etc/slurm/slurm.conf
# Seconds to wait for the node to turn idle after the daemons started.
wait_s=${LOCAL_SLURM_WAIT_S:-60}

# Why the last start failed, for the tests' skip message (tests/e2e/test_slurm.py).
failure_file="$dir/not_started.txt"

say() { echo "local_slurm: $*" >&2; }
die() {
  say "cannot start the cluster: $*"
  { mkdir -p "$dir" && echo "$*" >"$failure_file"; } 2>/dev/null || true
  exit 1
}

usage() {
  echo "usage: $0 start|stop|status" >&2
  exit 2
}

# The packages that hold each needed command (slurm-client: sinfo, srun, sbatch, scontrol).
missing_packages() {
  local missing=()
  command -v munged >/dev/null || missing+=(munge)
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null && command -v sinfo >/dev/null || missing+=(slurm-client)
  echo "${missing[@]}"
}

install_packages() {
  local missing
  missing=$(missing_packages)
  [[ -z "$missing" ]] && return 0
  [[ $(id -u) == 0 ]] || die "munge and SLURM are not installed ($missing) and installing them needs root"
  command -v apt-get >/dev/null || die "munge and SLURM are not installed ($missing) and there is no apt-get"
  say "installing $missing (apt-get)"
  # policy-rc.d keeps the packages from starting their own daemons with the system's config.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  local status=0
  {
    apt-get update -qq &&
      # shellcheck disable=SC2086  # One word per package.
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
  } >"${dir}/apt.log" 2>&1 || status=$?
  if [[ $made_policy == 1 ]]; then rm -f "$policy"; fi
  if [[ $status != 0 ]]; then
    tail -n 20 "$dir/apt.log" >&2
    die "apt-get install $missing failed (exit $status; log: $dir/apt.log)"
  fi
}

# Kills the daemon whose pid file is $1 (TERM, then KILL after 10 s); quiet when none runs.
stop_daemon() {
  local pid_file=$1 name=$2 pid
  [[ -f $pid_file ]] || return 0
  pid=$(cat "$pid_file" 2>/dev/null || true)
  # A pid file left by daemons that died with their machine's session may name another
  # process by now: only a process of that name is stopped.
  if [[ -n "$pid" ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      say "$name (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
    say "stopped $name (pid $pid)"
  fi
  rm -f "$pid_file"
}

stop() {
  stop_daemon "$dir/run/slurmd.pid" slurmd
  stop_daemon "$dir/run/slurmctld.pid" slurmctld
  stop_daemon "$dir/run/munged.pid" munged
  if [[ -L $default_conf && $(readlink "$default_conf") == "$conf" ]]; then rm -f "$default_conf"; fi
}

# The node's state as sinfo prints it (idle, mix, alloc, down*, ...), or "" when unreachable.
node_state() {
  SLURM_CONF=$conf timeout 10 sinfo --noheader --Node --format=%t 2>/dev/null | head -n 1 || true
}

status() {
  [[ -f $conf ]] || { say "not started (no $conf)"; return 1; }
  local state
  state=$(node_state)
  case "$state" in
    idle | mix | alloc | comp)
      say "up: node $(hostname -s) is $state (SLURM_CONF=$conf)"
      return 0
      ;;
    "") say "down: slurmctld does not answer (SLURM_CONF=$conf)" ;;
    *) say "node $(hostname -s) is $state (SLURM_CONF=$conf)" ;;
  esac
  return 1
}

# Prints the end of a daemon's log and fails.
daemon_failed() {
  local name=$1 log=$2
  [[ -f $log ]] && tail -n 15 "$log" >&2
  die "$name did not start (log: $log)"
}

write_config() {
  local host memory
  host=$(hostname -s)
  # What slurmd measures here; the node is declared with no more, or slurmd would drain it.
  memory=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  memory=${memory:-1024}
  cat >"$conf" <<EOF
# Written by launch/testing/local_slurm.sh: a one-node test cluster, state under $dir.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# The munge daemon of this cluster, not the system's.
AuthInfo=socket=$munge_socket
StateSaveLocation=$dir/slurmctld
SlurmdSpoolDir=$dir/slurmd
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
# CPUs are the consumable resource (memory is not), so array tasks of 1 CPU share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# \`sbatch --wait\` polls the job after 2 s, then 8 s and 32 s later, unless finished jobs are
# purged sooner (it keeps its sleep under half of MinJobAge): a job of 20 s was seen done 22 s
# late. Kept 4 s, it is polled every 2 s.
MinJobAge=4
ReturnToService=2
# The node is what this file says, even on a machine with fewer CPUs (it is not drained).
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  mkdir -p "$dir" || die "cannot create $dir (set LOCAL_SLURM_DIR)"
  rm -f "$failure_file"
  install_packages
  [[ $(id -u) == 0 ]] || die "the daemons run as root here (SlurmUser=root, munged's key) and this is uid $(id -u)"
  stop  # A clean start, also after a crash: no daemon of an earlier start is left.
  rm -rf "$dir/slurmctld" "$dir/slurmd" "$dir/log" "$dir/run"
  mkdir -p "$dir/munge" "$dir/slurmctld" "$dir/slurmd" "$dir/log" "$dir/run"
  # munged refuses a socket or key directory that others may write to; others may read it, so
  # that users other than root can reach the socket and submit jobs. The key itself is 0400.
  chmod 755 "$dir" "$dir/munge"
  write_config

  # munge: a key of this cluster's own, and a daemon on a socket under $dir.
  if [[ ! -s $dir/munge/munge.key ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  fi
  chmod 400 "$dir/munge/munge.key"
  munged --force --socket="$munge_socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed" || daemon_failed munged "$dir/log/munged.log"
  munge --socket="$munge_socket" --no-input | unmunge --socket="$munge_socket" >/dev/null ||
    daemon_failed "munged (a credential does not round-trip)" "$dir/log/munged.log"

  if [[ ! -e $default_conf ]] || [[ -L $default_conf && $(readlink "$default_conf") == "$conf" ]]; then
    mkdir -p "$(dirname "$default_conf")" && ln -sfn "$conf" "$default_conf"
  else
    say "$default_conf exists and is not this cluster's: clients need SLURM_CONF=$conf"
  fi
  export SLURM_CONF=$conf
  # -c: no jobs or node states from an earlier start.
  slurmctld -c -f "$conf" || daemon_failed slurmctld "$dir/log/slurmctld.log"
  slurmd -f "$conf" || daemon_failed slurmd "$dir/log/slurmd.log"

  local state=""
  for _ in $(seq $((wait_s * 2))); do
    state=$(node_state)
    [[ $state == idle ]] && break
    sleep 0.5
  done
  if [[ $state != idle ]]; then
    tail -n 15 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    die "the node is '${state:-unreachable}' after ${wait_s} s, not idle (logs: $dir/log)"
  fi
  rm -f "$failure_file"
  if ! getent hosts "$(hostname -s)" >/dev/null; then
    say "warning: $(hostname -s) does not resolve: multi-task jobs, whose JAX coordinator is the" \
      "first node by name, will fail (add '127.0.0.1 $(hostname -s)' to /etc/hosts)"
  fi
  say "up: node $(hostname -s) idle, 2 CPUs; SLURM_CONF=$conf; stop: $0 stop"
}

[[ $# == 1 ]] || usage
case "$1" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) usage ;;
esac
