"""A dependency-free terminal progress bar with throughput and ETA."""

from __future__ import annotations

import sys
import time
from typing import Mapping, TextIO


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class ProgressBar:
  """Redraws one line on a terminal; prints a line per update elsewhere (logs, CI)."""

  def __init__(
      self,
      total: int,
      *,
      initial: int = 0,
      examples_per_step: int = 1,
      stream: TextIO | None = None,
      width: int = 24,
      enabled: bool = True,
  ):
    self.total, self.examples_per_step, self.width = total, examples_per_step, width
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self._interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
    self._last_step, self._last_time = initial, time.perf_counter()
    self._eta_origin: tuple[int, float] | None = None

  def rate(self, step: int) -> float:
    """Steps per second since the previous call."""
    now = time.perf_counter()
    steps, elapsed = step - self._last_step, now - self._last_time
    self._last_step, self._last_time = step, now
    return steps / elapsed if elapsed > 0 and steps > 0 else 0.0

  def update(self, step: int, steps_per_second: float, scalars: Mapping[str, float] = ()) -> None:
    if not self.enabled:
      return
    # The ETA is timed from the first update on: the steps before it include the compile.
    now = time.perf_counter()
    if self._eta_origin is None:
      self._eta_origin = (step, now)
    done, elapsed = step - self._eta_origin[0], now - self._eta_origin[1]
    eta = (self.total - step) * elapsed / done if done > 0 else float("nan")
    filled = int(self.width * step / max(self.total, 1))
    bar = "#" * filled + "." * (self.width - filled)
    parts = [
        f"[{bar}] {step}/{self.total}",
        f"{steps_per_second * self.examples_per_step:.1f} ex/s",
        f"ETA {_duration(eta) if eta == eta else '?'}",
    ]
    parts += [f"{k} {v:.4g}" for k, v in dict(scalars).items()]
    line = " | ".join(parts)
    if self._interactive:
      self.stream.write("\r\033[K" + line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def note(self, line: str) -> None:
    """A line of its own (an evaluation summary, say) that the progress line does not erase."""
    if not self.enabled:
      return
    self.stream.write(("\r\033[K" if self._interactive else "") + line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled and self._interactive:
      self.stream.write("\n")
      self.stream.flush()
