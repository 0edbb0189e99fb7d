r"""Runs a command that gets SIGTERM when the process that started it dies, even by SIGKILL.

  python -m paper_runner.die_with_parent PARENT_PID -- COMMAND [ARG ...]

A process that has initialised JAX cannot safely use `preexec_fn` (fork in a multithreaded
process), so this fresh interpreter sets PR_SET_PDEATHSIG (kept across `exec`) and becomes
COMMAND; if the parent is already gone, COMMAND never starts. Elsewhere than Linux it only runs
COMMAND.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def wrapped(command: list[str], parent_pid: int | None = None) -> list[str]:
  """`command`, started so that it gets SIGTERM when `parent_pid` (this process) dies."""
  parent = os.getpid() if parent_pid is None else parent_pid
  return [sys.executable, "-m", "paper_runner.die_with_parent", str(parent), "--", *command]


def main(argv: list[str]) -> int:
  if len(argv) < 3 or argv[1] != "--":
    print(
        "usage: python -m paper_runner.die_with_parent PARENT_PID -- COMMAND [ARG ...]",
        file=sys.stderr,
    )
    return 2
  parent, command = int(argv[0]), argv[2:]
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # The parent died before prctl took effect.
      return 143
  os.execvp(command[0], command)
  return 127  # Not reached: execvp returns only by raising.


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
