"""Metrics to `metrics.jsonl` and TensorBoard event files (tensorboardX: no TensorFlow needed)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


def _to_python(value: Any) -> Any:
  value = np.asarray(value)
  if value.ndim == 0:
    item = value.item()
    return None if isinstance(item, float) and not math.isfinite(item) else item
  return value.tolist()


class MetricWriter:
  """Writes one JSON object per step to `<workdir>/metrics.jsonl` and scalars to TensorBoard.

  Scalars written for the same step (training, then evaluation) are merged into one
  line, flushed when a later step arrives or on `flush()`. Only process 0 writes.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._pending_step: int | None = None
    self._pending: dict[str, Any] = {}
    self._last_flushed: dict[str, Any] | None = None
    self._tb = None
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter  # Imported lazily: only process 0 needs it.

      self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Drops lines logged after `step`: a resumed run rewrites them, so none are duplicated."""
    if not self.enabled or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(self.path, "w") as f:
      f.writelines(lines)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    if self._pending_step is not None and step != self._pending_step:
      self.flush()
    self._pending_step = step
    for name, value in scalars.items():
      value = _to_python(value)
      self._pending[name] = value
      if self._tb is not None and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, step)

  def flush(self) -> None:
    if not self.enabled or self._pending_step is None:
      return
    record = {"step": self._pending_step, **self._pending}
    if self._last_flushed is not None and self._last_flushed["step"] == record["step"]:
      # More scalars for a step already on disk (e.g. the final test evaluation after
      # the final checkpoint): rewrite its line, so each step keeps exactly one line.
      record = {**self._last_flushed, **self._pending}
      with open(self.path) as f:
        lines = f.readlines()[:-1]
      with open(self.path, "w") as f:
        f.writelines(lines)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    self._last_flushed = record
    self._pending_step, self._pending = None, {}
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """Reads `metrics.jsonl` back (for tests and notebooks)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
