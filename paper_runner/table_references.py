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


def _mean(values: Sequence[float | None]) -> float | None:
  return None if None in values else math.fsum(values) / len(values)


def reference_rows(spec: TableSpec) -> list[dict[str, Any]]:
  """The spec's reference readers scored on its runs' data: [{"name", "metrics", ...}], each value
  the mean over the folds; a reader with seeded `draws` gets the mean and 95% range over its
  draws of each draw's mean over the folds."""
  read = import_spec_object(spec, "references", spec.references)
  over = spec.cross_validation[0] if spec.cross_validation else None
  scored: dict[str, list[dict[str, Any]]] = {}
  for config in _data_by_part(spec, over).values():
    for name, report in read(config, REPO_ROOT).items():
      scored.setdefault(name, []).append(report)
  rows = []
  for name, reports in scored.items():
    suffix = f", mean over {len(reports)} {over.split('.')[-1]}s" if len(reports) > 1 else ""
    row: dict[str, Any] = {"name": name + suffix, "metrics": {}}
    if reports[0].get("role"):
      row["role"] = reports[0]["role"]
    drawn = all(r.get("draws") for r in reports)  # Else each reader's report is its one draw.
    draws = [r["draws"] if drawn else [r] for r in reports]
    count, ranges = min(len(d) for d in draws), {}
    for path in spec.metrics():
      values = [_mean([metric_value(d[i], path) for d in draws]) for i in range(count)]
      row["metrics"][path] = _mean(values)
      if drawn and None not in values:
        quantiles = [(1 - stats.CONFIDENCE) / 2, (1 + stats.CONFIDENCE) / 2]
        ranges[path] = [float(q) for q in np.quantile(values, quantiles)]
    if drawn:
      row.update(ranges=ranges, draws=count)
    rows.append(row)
  return rows


def split_sizes(spec: TableSpec) -> dict[str, dict[str, int]]:
  """{fold value: {"train", "validation", "test": examples}}, from the data alone."""
  fold, target = spec.cross_validation
  sizes = import_spec_object(spec, "cross_validation", target)
  return {
      format_value(part): dict(sizes(config, REPO_ROOT))
      for part, config in _data_by_part(spec, fold).items()
  }
