"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
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
