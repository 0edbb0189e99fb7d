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

import signal
import types


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
