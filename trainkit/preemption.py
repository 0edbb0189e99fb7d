"""SIGTERM (and Ctrl-C) become a request to checkpoint and stop at the next step boundary.

Several processes must stop at the same step (the checkpoint is collective), so there SIGTERM
is left to JAX's preemption service and `stop_requested` asks it
(`reached_preemption_sync_point`); Ctrl-C aborts them all (`distributed.exit_together`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator


class PreemptionGuard:
  """While active, SIGTERM/SIGINT set `requested` instead of killing the run (a second Ctrl-C
  kills it); no handler in a multi-process run (module docstring)."""

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    import jax  # pylint: disable=import-outside-toplevel

    self._multi_process = jax.process_count() > 1
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
    """Whether to checkpoint and stop after `step` (the same step on every process)."""
    if self._multi_process and not self.requested:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      if multihost_utils.reached_preemption_sync_point(step):
        self.requested, self.signal_name = True, "SIGTERM (on some process)"
    return self.requested

  @contextlib.contextmanager
  def deferred(self) -> Iterator[None]:
    """While active, SIGTERM goes to the handler the guard replaced, when that one acts at once
    (`sigterm_ends_cleanly`): for a stretch with nothing to checkpoint, such as the first compile,
    which a flag would leave a scheduler's grace period to wait out."""
    previous = self._previous.get(signal.SIGTERM)
    if not callable(previous):
      yield
      return
    signal.signal(signal.SIGTERM, previous)
    try:
      yield
    finally:
      signal.signal(signal.SIGTERM, self._handle)

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
  """While active, SIGTERM runs `cleanup()`, says so and exits 143 at once, even inside a long
  native call (an XLA compile), through a watcher thread woken by `signal.set_wakeup_fd`.
  Install it after libtpu's own handler; main thread only.
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
