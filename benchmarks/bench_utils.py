"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

from typing import Any


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


def flops(compiled: Any) -> float | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None
