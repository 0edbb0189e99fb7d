"""Starts a `python -m MODULE` command as N JAX processes on this machine (CPU, gloo)."""

import os
import pathlib
import socket
import subprocess
import sys

from conftest import ONE_DEVICE_XLA_FLAGS

HEARTBEAT_TIMEOUT_S = 60


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def cpu_env(devices: int = 1, **extra: str) -> dict[str, str]:
  env = dict(os.environ)
  for variable in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(variable, None)
  env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
  env["XLA_FLAGS"] = f"{ONE_DEVICE_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"
  return env


def start(
    module: str, args: list[str], *, processes: int, cwd: pathlib.Path, logs: pathlib.Path, **extra
) -> list[subprocess.Popen]:
  """Process i logs to `logs`.i.log; a heartbeat timeout bounds any hang: a minute, not less,
  so that a process starved of CPU on a loaded machine (two cores shared by a test run) is not
  taken for a dead one."""
  port = free_port()
  started = []
  for i in range(processes):
    env = cpu_env(
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
        JAX_NUM_PROCESSES=str(processes),
        JAX_PROCESS_ID=str(i),
        TRAINKIT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT_S),
        **extra,
    )
    with open(f"{logs}.{i}.log", "w") as log:
      started.append(
          subprocess.Popen(
              [sys.executable, "-m", module, *args],
              cwd=cwd,
              env=env,
              stdout=log,
              stderr=subprocess.STDOUT,
          )
      )
  return started


def log_text(logs: pathlib.Path, i: int) -> str:
  return pathlib.Path(f"{logs}.{i}.log").read_text()
