"""SIGTERM (and Ctrl-C) become a request to checkpoint and stop at the next step boundary.

One process: `PreemptionGuard` catches SIGTERM and SIGINT itself.

Several processes (a TPU pod, a SLURM job): the processes must stop at the same step, since
the checkpoint is written collectively and a process that stops early leaves the others
blocked in the next step's collectives. JAX's preemption service does exactly this: its own
SIGTERM handler (installed by `jax.distributed.initialize`) tells the coordination service,
which chooses a step every process reaches, and `reached_preemption_sync_point(step)` is true
there on all of them. So the guard leaves SIGTERM to JAX and `stop_requested` asks the service.
Ctrl-C in a multi-process run is not synchronised: it aborts, and `distributed.exit_together`
makes the other processes stop at once (nothing since the last checkpoint is kept).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator


def _multi_process() -> bool:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.process_count() > 1


class PreemptionGuard:
  """Context manager: while active, SIGTERM/SIGINT set `requested` instead of killing the run.

  A second Ctrl-C restores the default behaviour, so a stuck run can still be interrupted.
  In a multi-process run no handler is installed (see the module docstring).
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self._multi_process = _multi_process()
    self._signals = () if self._multi_process else signals
    self._previous: dict[int, object] = {}
    self.requested = False
    self.signal_name: str | None = None

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def stop_requested(self, step: int) -> bool:
    """Whether to checkpoint and stop after `step`; call it once after every step.

    Multi-process: true at the same step on every process once any of them got SIGTERM.
    """
    if self._multi_process and not self.requested:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      if multihost_utils.reached_preemption_sync_point(step):
        self.requested, self.signal_name = True, "SIGTERM (on some process)"
    return self.requested

  def __enter__(self) -> "PreemptionGuard":
    for s in self._signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)


# The exit status of a process ended by SIGTERM (128 + 15), as the shell reports one.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_ends_cleanly(cleanup: Callable[[], None], what: str) -> Iterator[None]:
  """While active, SIGTERM runs `cleanup()`, says so in one line and ends the process at once
  (exit status 143), even while the main thread is inside a long native call (an XLA compile).

  For work that has nothing to checkpoint (`--mode=compile`): the default action killed the
  process without running a `finally`, so its `.run.lock` was left behind, and a workdir the run
  had just created held nothing but that lock. A Python signal handler runs only when the main
  thread is back in Python, possibly minutes later; the signal's wake-up byte
  (`signal.set_wakeup_fd`) reaches a watcher thread at once. A handler that something else
  installed meanwhile (the training loop's `PreemptionGuard`) takes precedence: the watcher acts
  only while this one's is current. Install it after anything that sets its own SIGTERM handler
  (libtpu's crash reporter dumps a native stack trace, then dies of the signal). Main thread only.
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # Signal handlers belong to the main thread: elsewhere, SIGTERM keeps its default.
    return

  def handler(signum: int, frame: types.FrameType | None) -> None:
    del signum, frame  # The watcher thread acts; the main thread may not run this for minutes.

  read_end, write_end = os.pipe()
  os.set_blocking(write_end, False)

  def watch() -> None:
    while True:
      try:
        received = os.read(read_end, 64)
      except OSError:
        return
      if not received:
        return  # The block ended: the write end is closed.
      if signal.SIGTERM in received and signal.getsignal(signal.SIGTERM) is handler:
        try:
          cleanup()
        finally:
          print(f"stopped by SIGTERM {what}", file=sys.stderr, flush=True)
          os._exit(SIGTERM_EXIT_CODE)  # pylint: disable=protected-access

  previous_handler = signal.signal(signal.SIGTERM, handler)
  previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
  watcher = threading.Thread(target=watch, name="sigterm-watcher", daemon=True)
  watcher.start()
  try:
    yield
  finally:
    signal.set_wakeup_fd(previous_fd)
    signal.signal(signal.SIGTERM, previous_handler)
    os.close(write_end)
    watcher.join(timeout=5)
    os.close(read_end)
