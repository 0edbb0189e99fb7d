"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def memory_analysis(compiled: Any) -> dict[str, int | None]:
  fields = (
      "temp_size_in_bytes",
      "argument_size_in_bytes",
      "output_size_in_bytes",
      "alias_size_in_bytes",
      "generated_code_size_in_bytes",
  )
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    analysis = None
  return {f: (int(getattr(analysis, f)) if analysis is not None else None) for f in fields}


def cost(compiled: Any, key: str) -> float | None:
  """A figure of XLA's cost analysis of a compiled executable ("flops", "bytes accessed")."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  return float(analysis[key]) if analysis and key in analysis else None


def flops(compiled: Any) -> float | None:
  return cost(compiled, "flops")


def write_results(path: str, args: Any, rows: list[dict], targets: list[dict]) -> None:
  """Writes the rows, the evaluated targets and where they were measured as JSON."""
  device = jax.devices()[0]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(
        {
            "device": str(device.device_kind),
            "platform": device.platform,
            "num_devices": jax.device_count(),
            "jax": jax.__version__,
            "host": platform.node(),
            "date": datetime.date.today().isoformat(),
            "args": vars(args),
            "rows": rows,
            "targets": targets,
        },
        f,
        indent=2,
    )
  print(f"wrote {path}")


def time_interleaved(
    calls: Sequence[Callable[[], Any]], repeats: int
) -> tuple[list[Any], list[list[float]]]:
  """Seconds of each call (to `block_until_ready` on its output), the calls alternated.

  Each call runs once first, as a warm-up whose time is left out (its output is returned); then
  `repeats` rounds run every call once, each round starting one call later, so that a slow phase
  of a shared machine does not fall on one case only and no case always follows the same one
  (e.g. the largest).

  Returns:
    The warm-up outputs, and each call's `repeats` times in seconds.
  """
  warm_up = [jax.block_until_ready(call()) for call in calls]
  times: list[list[float]] = [[] for _ in calls]
  for r in range(repeats):
    for i in [(r + j) % len(calls) for j in range(len(calls))]:
      t0 = time.perf_counter()
      jax.block_until_ready(calls[i]())
      times[i].append(time.perf_counter() - t0)
  return warm_up, times
