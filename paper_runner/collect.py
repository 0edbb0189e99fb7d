"""A sweep's runs read back once (RunResult), then the generic tables and the spec's collectors."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from typing import Any, Mapping, Sequence

import ml_collections
import numpy as np

from paper_runner.spec import (
    ERROR,
    REPORT,
    SweepError,
    format_value,
    grid_points,
    import_collector,
    run_dir,
    run_name,
)
from trainkit import storage
from trainkit.metric_writers import read_metrics
from trainkit.storage import write_atomically
from trainkit.workdir import live_lock_owner


@dataclasses.dataclass(frozen=True)
class RunResult:
  """One run as its directory shows it: status "ok" (a readable report.json), "failed" (error.txt,
  an unreadable or empty report, or a metric that is not a number; `error` says why), "running"
  (a live process holds its workdir lock) or "missing"."""

  point: dict[str, Any]
  run_dir: str
  status: str
  report: dict[str, Any] | None = None
  error: str | None = None

  @property
  def name(self) -> str:
    return run_name(self.point)


def read_run(point: Mapping[str, Any], directory: str, metrics: Sequence[str] = ()) -> RunResult:
  """The run in `directory`; a value of `metrics` present in its report but not a number fails it."""
  point = dict(point)
  owner = live_lock_owner(directory)  # A run training now may have an earlier attempt's files.
  if owner:
    where = f"pid {owner.get('pid')} on {owner.get('host')}"
    return RunResult(point, directory, "running", error=f"training now ({where})")
  report_path = storage.join(directory, REPORT)  # The run's directory may be on gs://.
  try:
    report = json.loads(storage.read_text(report_path))
    if not isinstance(report, dict) or not report:
      raise ValueError(f"{report!r}, not an object with the run's results")
    for metric in metrics:
      value = lookup(report, metric)
      if isinstance(value, (bool, str, list, dict)):  # A diverged run's NaN is still a number.
        raise ValueError(f"metric {metric} is {value!r}, not a number")
    return RunResult(point, directory, "ok", report=report)
  except FileNotFoundError:
    pass
  except (OSError, ValueError) as e:  # An unreadable report: the run must be redone.
    return RunResult(point, directory, "failed", error=f"unreadable {report_path}: {e}")
  try:
    text = storage.path(storage.join(directory, ERROR)).read_bytes().decode(errors="replace")
    message = text.split("\n\n", 1)[0].strip()
    return RunResult(point, directory, "failed", error=message or "failed")
  except OSError:
    return RunResult(point, directory, "missing", error="no report.json (not run, or interrupted)")


def collect(sweep: ml_collections.ConfigDict, workdir: str) -> list[RunResult]:
  """Every run of the sweep, in grid order."""
  return [read_run(p, run_dir(workdir, p), sweep.metrics) for p in grid_points(sweep)]


def lookup(report: Any, path: str) -> Any:
  """The value at a dotted path into a report, or None where any part is absent."""
  for part in path.split("."):
    if not isinstance(report, Mapping) or part not in report:
      return None
    report = report[part]
  return report


def is_number(value: Any) -> bool:
  """A finite int or float (bools, NaN and infinities are not numbers to tabulate or plot)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def throughput(directory: str, keys: Sequence[str]) -> dict[str, float]:
  """Per key in metrics.jsonl: the median over the logged steps after half the run's steps."""
  try:
    records = read_metrics(directory)
  except (OSError, ValueError):
    return {}
  result = {}
  for key in keys:
    logged = [(r.get("step", 0), r[key]) for r in records if is_number(r.get(key))]
    if not logged:
      continue
    last = max(step for step, _ in logged)
    later = [v for step, v in logged if step > last / 2] or [v for _, v in logged]
    result[key] = float(np.median(later))
  return result


def table_rows(
    sweep: ml_collections.ConfigDict, results: Sequence[RunResult]
) -> list[dict[str, Any]]:
  """One row per run: grid values, status, metrics from report.json, then throughput medians."""
  rows = []
  for result in results:
    row: dict[str, Any] = dict(result.point)
    row["status"] = result.status
    for metric in sweep.metrics:
      row[metric] = lookup(result.report, metric)
    row.update(throughput(result.run_dir, sweep.throughput_keys))
    row["run_dir"] = result.run_dir
    if result.error is not None and result.status == "failed":
      row["error"] = result.error
    rows.append(row)
  return rows


def table_columns(sweep: ml_collections.ConfigDict, rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """Grid keys, status, metrics, then the throughput keys some run logged."""
  present = [k for k in sweep.throughput_keys if any(k in r for r in rows)]
  return [*sweep.grid.keys(), "status", *sweep.metrics, *present]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  """The lines of a markdown table: its header, the rule under it and a line per row."""
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _cell(value: Any) -> str:
  if value is None:
    return ""
  return f"{value:.4g}" if isinstance(value, float) else format_value(value)


def write_tables(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    rows: Sequence[Mapping[str, Any]],
    sweep_path: str = "",
) -> str:
  """Writes sweep.csv, sweep.md and sweep.json into `workdir`; returns the markdown."""
  columns = table_columns(sweep, rows)
  # write_atomically: a rename replaces a symlink planted in the workdir.
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=columns, extrasaction="ignore")
  writer.writeheader()
  writer.writerows({k: "" if r.get(k) is None else r[k] for k in columns} for r in rows)
  write_atomically(storage.join(workdir, "sweep.csv"), table.getvalue())
  ok = sum(r["status"] == "ok" for r in rows)
  lines = [
      f"# Sweep `{sweep_path or '?'}`",
      "",
      f"{ok} of {len(rows)} runs finished. Throughput columns: median over the second half of"
      " the logged steps.",
      "",
      *markdown_table(columns, [[_cell(r.get(k)) for k in columns] for r in rows]),
  ]
  markdown = "\n".join(lines) + "\n"
  write_atomically(storage.join(workdir, "sweep.md"), markdown)
  definition = {**sweep.to_dict(), "grid": dict(sweep.grid), "overrides": dict(sweep.overrides)}
  write_atomically(
      storage.join(workdir, "sweep.json"),
      json.dumps({"sweep": sweep_path, "definition": definition, "rows": list(rows)}, indent=2),
  )
  return markdown


def write_spec_tables(
    sweep: ml_collections.ConfigDict, workdir: str, results: Sequence[RunResult]
) -> list[str]:
  """Calls each of the spec's `tables` collectors, in order; returns the paths they wrote."""
  paths: list[str] = []
  for name in sweep.tables:
    try:
      written = import_collector(name)(workdir, list(results))
    except SweepError:
      raise
    except Exception as e:  # A collector's bug must not look like the runs failed.
      raise SweepError(
          "tables",
          f"{name} failed: {type(e).__name__}: {e}. The runs are kept in {workdir}/runs; fix "
          "the collector and rerun the same sweep command to tabulate them (finished runs are "
          "not retrained)",
      ) from None
    if not isinstance(written, (list, tuple)) or not all(isinstance(p, str) for p in written):
      raise SweepError("tables", f"{name} returned {written!r}, not a list of the paths it wrote")
    paths += written
  return paths
