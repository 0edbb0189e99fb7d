"""A table's reference rows (readers without a model scored on its runs' data) and its folds'
split sizes."""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np

from paper_runner import stats
from paper_runner.spec import REPO_ROOT, format_value, grid_points, resolved_config
from paper_runner.table_spec import TableSpec, import_spec_object, metric_value, spec_error


def _data_by_part(spec: TableSpec, over: str | None) -> dict[Any, dict[str, Any]]:
  """{value of `over` (a fold key; None: the one data): the config of its runs' data}."""
  firsts = {}
  for point in grid_points(spec.sweep):
    firsts.setdefault((format_value(point[spec.rows]), point.get(over)), point)
  data: dict[Any, dict[str, Any]] = {}
  for (_, part), point in firsts.items():
    config = resolved_config(spec.sweep, point).to_dict()
    data.setdefault(part, {}).setdefault(json.dumps(config["data"], sort_keys=True), config)
  if any(len(configs) > 1 for configs in data.values()):
    raise spec_error(spec.name, "references", "its rows read different data; one is needed")
  return {part: next(iter(configs.values())) for part, configs in data.items()}


def reference_rows(spec: TableSpec) -> list[dict[str, Any]]:
  """The spec's reference readers scored on its runs' data: [{"name", "metrics", ...}]."""
  read = import_spec_object(spec, "references", spec.references)
  over = spec.cross_validation[0] if spec.cross_validation else None
  paths = spec.metrics()
  scored: dict[str, list[dict[str, Any]]] = {}
  for config in _data_by_part(spec, over).values():
    for name, report in read(config, REPO_ROOT).items():
      entry: dict[str, Any] = {
          "metrics": {p: metric_value(report, p) for p in paths},
          "role": report.get("role"),
      }
      if report.get("draws"):
        entry["draws"] = [[metric_value(d, p) for p in paths] for d in report["draws"]]
      scored.setdefault(name, []).append(entry)
  rows = []
  for name, parts in scored.items():
    metrics = {}
    for path in paths:
      values = [m["metrics"][path] for m in parts if m["metrics"][path] is not None]
      metrics[path] = math.fsum(values) / len(values) if len(values) == len(parts) else None
    suffix = f", mean over {len(parts)} {over.split('.')[-1]}s" if len(parts) > 1 else ""
    row: dict[str, Any] = {"name": name + suffix, "metrics": metrics}
    if parts[0]["role"]:
      row["role"] = parts[0]["role"]
    if all("draws" in m for m in parts):
      row.update(_simulated(paths, [m["draws"] for m in parts]))
    rows.append(row)
  return rows


def _simulated(paths: Sequence[str], parts: Sequence[Sequence[Sequence[Any]]]) -> dict[str, Any]:
  """Per path, the mean and 95% range over draws of each draw's mean over the folds."""
  draws = min(len(p) for p in parts)
  metrics: dict[str, float | None] = {}
  ranges: dict[str, list[float]] = {}
  for j, path in enumerate(paths):
    values = []
    for i in range(draws):
      per_part = [p[i][j] for p in parts]
      if any(v is None for v in per_part):
        break
      values.append(math.fsum(per_part) / len(per_part))
    if len(values) < draws:
      metrics[path] = None
      continue
    low, high = np.quantile(values, [(1 - stats.CONFIDENCE) / 2, (1 + stats.CONFIDENCE) / 2])
    metrics[path] = math.fsum(values) / draws
    ranges[path] = [float(low), float(high)]
  return {"metrics": metrics, "ranges": ranges, "draws": draws}


def split_sizes(spec: TableSpec) -> dict[str, dict[str, int]]:
  """{fold value: {"train", "validation", "test": examples}}, from the data alone."""
  fold, target = spec.cross_validation
  sizes = import_spec_object(spec, "cross_validation", target)
  return {
      format_value(part): dict(sizes(config, REPO_ROOT))
      for part, config in _data_by_part(spec, fold).items()
  }
