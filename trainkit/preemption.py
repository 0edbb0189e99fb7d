"""SIGTERM (and Ctrl-C) become a request to checkpoint and stop at the next step boundary."""

from __future__ import annotations

import signal
import types


class PreemptionGuard:
  """Context manager: while active, SIGTERM/SIGINT set `requested` instead of killing the run.

  A second Ctrl-C restores the default behaviour, so a stuck run can still be interrupted.
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self._signals = signals
    self._previous: dict[int, object] = {}
    self.requested = False
    self.signal_name: str | None = None

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def __enter__(self) -> "PreemptionGuard":
    for s in self._signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
