"""A table's record (`results/records/NAME.json`): made from a sweep's runs, with its reference
rows (readers without a model scored on its runs' data) and its folds' split sizes; added to, read
back checked."""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from paper_runner import stats
from paper_runner.collect import RunResult, collect, is_number
from paper_runner.provenance import data_hashes, differences, machine, source_state
from paper_runner.spec import (
    REPO_ROOT,
    REPORT,
    RUN,
    RUN_PROVENANCE,
    format_value,
    grid_points,
    resolved_config,
    run_record,
)
from paper_runner.supervise import record_differences
from paper_runner.table_spec import (
    METRIC_RANGES,
    SEED_KEY,
    TableSpec,
    import_spec_object,
    metric_value,
    record_path,
    sample_sizes,
    scaled_name,
    spec_error,
    unit_text,
)
from trainkit.errors import UserError
from trainkit.storage import write_atomically
from trainkit.workdir import CONFIG_FILE, trained_config_differences


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


def _check_started_by_spec(spec: TableSpec, workdir: str, result: RunResult) -> None:
  directory = result.run_dir
  if os.path.isfile(os.path.join(directory, RUN)):
    changed = record_differences(spec.sweep, result.point, directory)
  elif os.path.isfile(os.path.join(directory, CONFIG_FILE)):
    changed = trained_config_differences(directory, resolved_config(spec.sweep, result.point))
  else:
    raise UserError(
        f"{workdir}: run {result.name} has neither {RUN} nor {CONFIG_FILE}, so nothing shows it "
        f"was started by the sweep of {spec.path}; record only a workdir that sweep ran in"
    )
  if changed:
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    raise UserError(
        f"{workdir}: run {result.name} is not the run of table {spec.name}'s sweep "
        f"({spec.path}) of that name: {changed[0]}{more} (what the run was started or trained "
        "with -> what the spec gives it). Is this the workdir of another sweep? Its numbers "
        "would become this table's"
    )


def run_entry(spec: TableSpec, result: RunResult) -> dict[str, Any]:
  """A run as a record holds it: row, pairing unit, status, settings, then metrics or error."""
  entry: dict[str, Any] = {
      "row": format_value(result.point[spec.rows]),
      "seed": spec.pair(result.point),
      "status": result.status,
      "settings": run_record(spec.sweep, result.point)["settings"],
  }
  if result.status != "ok":
    return {**entry, "error": result.error}
  metrics = {p: metric_value(result.report, p) for p in spec.metrics()}
  return {**entry, "metrics": metrics, **sample_sizes(result.report, spec)}


def make_record(spec: TableSpec, workdir: str) -> dict[str, Any]:
  """The record of `spec`'s sweep in `workdir` (finished or not)."""
  dates, configs = [], []
  results = collect(spec.sweep, workdir)  # Read once: the rows and the provenance.
  for result in results:
    if result.status == "ok":
      _check_started_by_spec(spec, workdir, result)
      dates.append(os.path.getmtime(os.path.join(result.run_dir, REPORT)))
    config_path = os.path.join(result.run_dir, CONFIG_FILE)
    if os.path.isfile(config_path):
      with open(config_path) as f:
        configs.append(json.load(f))
  last = max(dates, default=None)
  provenance = {
      **_runs_source_and_host(results),
      "date": last and datetime.datetime.fromtimestamp(last, datetime.UTC).strftime("%Y-%m-%d"),
      # Every input file or directory the runs read (their config.json's data keys).
      "data": data_hashes(configs),
      "seeds": list(spec.sweep.grid[SEED_KEY]),
      "commands": [
          f"python -m paper_runner.sweep --sweep={spec.path} --workdir=WORKDIR",
          f"python -m paper_runner.tables --record={scaled_name(spec.path) or spec.name} "
          "--workdir=WORKDIR",
      ],
  }
  record = {"table": spec.name, "spec": spec.path, **_scored(spec), "provenance": provenance}
  return {**record, "runs": [run_entry(spec, result) for result in results]}


def _runs_source_and_host(results: Sequence[Any]) -> dict[str, Any]:
  """The commit and machine of the runs, from the `provenance.json` the sweep wrote beside each."""
  here = machine()
  written = []
  for result in results:
    try:
      with open(os.path.join(result.run_dir, RUN_PROVENANCE)) as f:
        written.append(json.load(f))
    except (OSError, ValueError):
      if result.status == "ok":
        return {**source_state(REPO_ROOT), "machine": here}
  if not written:
    return {**source_state(REPO_ROOT), "machine": here}
  first = written[0]
  found = {
      "commit": first["commit"],
      "uncommitted_changes": first["uncommitted_changes"],
      "machine": {"device": here["device"], "devices": here["devices"], **first["host"]},
  }
  others = sorted({w["commit"] for w in written} - {first["commit"]}) + sorted(
      {why for w in written for why in differences(first["host"], w["host"], "host.")}
  )
  if others:  # A sweep resumed on another checkout or machine: say so in the record.
    found["mixed_runs"] = others
  return found


def save_record(name: str, record: Mapping[str, Any]) -> str:
  path = record_path(name)
  os.makedirs(os.path.dirname(path), exist_ok=True)  # The records folder (`table_spec`).
  write_atomically(path, json.dumps(record, indent=1) + "\n")
  return path


def write_record(spec: TableSpec, workdir: str) -> str:
  return save_record(spec.name, make_record(spec, workdir))


def add_rerun(spec: TableSpec, workdir: str) -> str:
  """Adds the finished runs in `workdir` to the record's `reruns` (one per machine)."""
  record = read_record(spec.name)
  rerun = make_record(spec, workdir)
  finished = [r for r in rerun["runs"] if r["status"] == "ok"]
  if not finished:
    raise UserError(f"--rerun={spec.name}: no finished run of its sweep in {workdir}")
  entry = {"provenance": rerun["provenance"], "runs": finished}
  machine_of = lambda r: r["provenance"]["machine"]  # noqa: E731
  record["reruns"] = [r for r in record.get("reruns", []) if machine_of(r) != machine_of(entry)]
  record["reruns"].append(entry)
  return save_record(spec.name, record)


def add_references(spec: TableSpec) -> str:
  """Scores the spec's reference readers (and folds' split sizes) into its existing record."""
  return save_record(spec.name, {**read_record(spec.name), **_scored(spec)})


def _scored(spec: TableSpec) -> dict[str, Any]:
  """The reference rows and the folds' split sizes the spec asks for, from its data alone."""
  return {
      **({"references": reference_rows(spec)} if spec.references else {}),
      **({"split_sizes": split_sizes(spec)} if spec.cross_validation else {}),
  }


# What `render` and `stale_runs` read of a record.
_RECORD_KEYS = ("provenance", "runs")
_PROVENANCE_KEYS = ("commit", "date", "machine", "seeds", "commands")


def read_record(name: str) -> dict[str, Any]:
  path = record_path(name)
  where = os.path.relpath(path, REPO_ROOT)
  try:
    with open(path) as f:
      record = json.load(f)
  except FileNotFoundError:
    raise UserError(
        f"table {name!r} has no record {where}; make it with "
        f"`python -m paper_runner.tables --record={name} --workdir=DIR` after its sweep"
    ) from None
  except ValueError as e:
    raise UserError(f"{where}: not JSON ({e})") from None
  if not isinstance(record, dict):
    raise UserError(f"{where}: not a table record (a JSON object with {', '.join(_RECORD_KEYS)})")
  for key in _RECORD_KEYS:
    if key not in record:
      raise UserError(f"{where}: the record has no {key!r} (remake it with --record={name})")
  for key in _PROVENANCE_KEYS:
    if not isinstance(record["provenance"], dict) or key not in record["provenance"]:
      raise UserError(
          f"{where}: the record's provenance has no {key!r} (remake it with --record={name})"
      )
  _check_runs(f"{where}: table {name}", record["runs"], "runs", name)
  for i, rerun in enumerate(record.get("reruns") or ()):
    runs = rerun.get("runs") if isinstance(rerun, dict) else None
    _check_runs(f"{where}: table {name}", runs, f"reruns[{i}].runs", name)
  for reference in record.get("references") or ():
    what, remake = f"reference {reference.get('name')!r}", f"(remake it with --references={name})"
    _check_finite(f"{where}: table {name}", what, reference.get("metrics"), remake)
  return record


def _check_finite(where: str, what: str, metrics: Any, remake: str) -> None:
  """A UserError naming the first value of `metrics` that is neither a finite number in its
  range (`METRIC_RANGES`) nor null."""
  for path, value in (metrics or {}).items():
    if value is not None and not is_number(value):
      raise UserError(
          f"{where}: {what}: {path} is {value!r}, not a finite number or null, so no cell or "
          f"claim on it can be computed {remake}"
      )
    low, high = METRIC_RANGES.get(path.rpartition(".")[2], (-math.inf, math.inf))
    if value is not None and not low <= value <= high:
      raise UserError(f"{where}: {what}: {path} is {value!r}, outside [{low}, {high}] {remake}")


def _check_runs(where: str, runs: Any, what: str, name: str) -> None:
  """A UserError naming the first run without row, pair, status, finite metrics, or twice."""
  remake = f"(remake the record with --record={name})"
  if not isinstance(runs, list):
    raise UserError(f"{where}: {what} is not a list of runs {remake}")
  seen: dict[str, str] = {}
  for i, run in enumerate(runs):
    index_name = f"{what}[{i}]"
    if not isinstance(run, dict):
      raise UserError(f"{where}: {index_name} is not a run (a JSON object) {remake}")
    known = [f"row {run['row']}"] if "row" in run else []
    known += [f"seed {unit_text(run['seed'])}"] if "seed" in run else []
    text = index_name + (f" ({', '.join(known)})" if known else "")
    for key in ("row", "seed", "status"):
      if key not in run:
        raise UserError(f"{where}: {text} has no {key!r} {remake}")
    seed = run["seed"]
    if not (type(seed) is int or isinstance(seed, str) and "=" in seed):
      raise UserError(
          f"{where}: {index_name} (row {run['row']}): its 'seed' is {seed!r}, not a whole number (nor a pairing unit "
          f"such as fold=0,seed=0) {remake}"
      )
    if run["status"] == "ok":
      metrics = run.get("metrics")
      if not isinstance(metrics, dict):
        raise UserError(f"{where}: {text} has a result but no 'metrics' {remake}")
      _check_finite(where, text, metrics, remake)
    key = json.dumps([run["row"], run["seed"]])
    if key in seen:
      raise UserError(
          f"{where}: {seen[key]} and {text} are the same run (the same row and seed): one "
          f"value would silently replace the other {remake}"
      )
    seen[key] = text


def stale_runs(spec: TableSpec, record: Mapping[str, Any]) -> list[str]:
  """Why the record no longer describes the spec's runs (another grid or other settings)."""
  settings = [run_record(spec.sweep, p)["settings"] for p in grid_points(spec.sweep)]
  expected = dict(zip(spec.units(), settings))
  recorded = {(r["row"], r["seed"]): r.get("settings") for r in record["runs"]}
  problems = [f"run {k[0]} seed {k[1]} is not in the record" for k in expected if k not in recorded]
  problems += [
      f"run {k[0]} seed {k[1]} is no longer in the spec" for k in recorded if k not in expected
  ]
  problems += [
      f"run {k[0]} seed {k[1]} was recorded with settings {recorded[k]}, the spec now gives "
      f"{expected[k]}"
      for k in expected
      if k in recorded and recorded[k] != expected[k]
  ]
  return problems
