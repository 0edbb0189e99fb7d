r"""Results tables generated from specs: record a sweep's runs, write and check the tables, rerun one.

  python -m experiments.sweep  --sweep=results/NAME.py --workdir=DIR   # train the runs
  python -m experiments.tables --record=NAME --workdir=DIR             # results/records/NAME.json
  python -m experiments.tables --write=docs/results.md                 # every marked table
  python -m experiments.tables --check=docs/results.md                 # exit 1 if one differs
  python -m experiments.tables --reproduce=NAME [--workdir=DIR] [--tolerance=X]
  python -m experiments.tables --rerun=NAME --workdir=DIR              # add a rerun to the record
  python -m experiments.tables --references=NAME                       # score the reference rows
  python -m experiments.tables --list

A table spec is a sweep file under `results/` (`results/NAME.py`: its `get_config()` is the
sweep, see experiments/sweep.py) with a module-level `TABLE` saying how to tabulate its runs:

  TABLE = dict(
      title="...",
      rows="method",                  # The grid key whose values are the rows ("seed" pools).
      row_names={"a@k=v": "a'"},      # Optional display names of row values.
      split="test",                   # The split the table reports (named in its caption).
      examples="num_examples",        # Path to that split's number of examples in report.json.
      groups="attributes",            # Optional: path to {attribute: {"groups": {g: {"n"}}}}.
      columns=(("accuracy", "Acc. (%)", 100.0, 1), ...),   # (path, label, scale, decimals)
      claims=(dict(row="a", baseline="b", metric="accuracy", better="higher"), ...),
      tolerance=0.02,                 # Optional: |difference| --reproduce accepts on another
                                      # machine (on the recording machine: exactly 0).
      select="accuracy",              # Optional (tuning tables): the path whose highest mean
                                      # chooses a row; the table names that row.
      pair_by=("data.fold", "seed"),  # Optional: the grid keys a run is paired by across rows
                                      # (default ("seed",); cross-validation pairs (fold, seed)).
      pool=("pkg.module:function", "data.fold"),  # Optional: `function(run_dirs)` -> one
                                      # report of the runs that differ only in that key (the
                                      # folds of a seed), tabulated after the per-run rows.
      select_within=("validation.accuracy", 0.01),  # Optional: only rows whose mean of this
                                      # path is within this of the best row's compete.
      references="pkg.module:function",  # Optional: readers without a model (majority class,
  )                                   # a shortcut's reader, chance), `function(config, base_dir)`
                                      # -> {name: report-shaped dict} from a run's config.json.

A path is dotted into report.json; a path that ends at numbers nested in mappings or lists (per
layer, per block, per batch) is the mean of them all. The record (`results/records/NAME.json`, under version
control) holds every run's values of every column and claim, its sample sizes and command, and
the provenance (commit, date, machine, JAX version, seeds, commands), so a table is rendered
from the record alone: `--write` replaces what lies between `<!-- table:NAME -->` and
`<!-- /table:NAME -->` in a markdown file, and `--check` renders again and compares. Each
table has, per row, the mean and 95% Student-t interval of every column over the seeds, then per
claim the mean paired difference (same seed) with its interval and the verdict
(experiments/stats.py), then the flags (too few seeds, a split or group too small), then the
provenance. The spec's reference readers are scored when the record is made, from the data the
runs read, and printed as rows in italics below the models' (one value each: no seeds).

A verdict is only worth printing if another machine reaches it too. `--rerun=NAME --workdir=DIR`
adds the finished runs of a second sweep of the spec (on another machine, or here with
`XLA_FLAGS=--xla_cpu_max_isa=AVX2`, which makes XLA compile for another instruction set; all
runs, or the rows its claims compare with `experiments.sweep --only`) to the record's `reruns`,
with that sweep's own provenance; the table then says under its claims, per rerun, which
verdicts (and which tuning choice) the rerun keeps and the largest change of a mean paired
difference. `<!-- table:reruns -->` in a document marks the summary of every table's reruns
(`rerun_summary`), rendered and checked with the tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Mapping, Sequence

from absl import app, flags

from experiments import stats
from experiments.collect import collect, is_number, lookup
from experiments.markers import marked_tables, replace_tables
from experiments.provenance import data_hash, data_hashes, differences, machine, source_state
from experiments.spec import (
    REPO_ROOT,
    REPORT,
    RUN_PROVENANCE,
    format_value,
    grid_points,
    load_sweep_file,
    resolved_config,
    run_command,
    run_record,
)
from trainkit.errors import UserError, exit_on_user_error
from trainkit.metric_writers import write_atomically

RESULTS_DIR = os.path.join(REPO_ROOT, "results")
RECORDS_DIR = os.path.join(RESULTS_DIR, "records")
SEED_KEY = "seed"
DEFAULT_TOLERANCE = 0.02

@dataclasses.dataclass(frozen=True)
class Column:
  path: str
  label: str
  scale: float
  decimals: int


@dataclasses.dataclass(frozen=True)
class Claim:
  row: str
  baseline: str
  metric: str
  better: str


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """A results table: the sweep that makes its runs and how they are tabulated."""

  name: str
  path: str
  sweep: Any  # The validated sweep ConfigDict.
  title: str
  rows: str
  row_values: list[Any]
  row_names: dict[str, str]
  split: str
  examples: str
  groups: str | None
  columns: list[Column]
  claims: list[Claim]
  tolerance: float
  select: str | None = None
  select_within: tuple[str, float] | None = None
  references: str | None = None
  pair_by: tuple[str, ...] = (SEED_KEY,)
  pool: tuple[str, str] | None = None

  def pair(self, point: Mapping[str, Any]) -> Any:
    """The unit a run is paired by across rows: its seed, or "key=value,..." of `pair_by`
    (cross-validation pairs runs by fold and seed)."""
    if self.pair_by == (SEED_KEY,):
      return point[SEED_KEY]
    return ",".join(f"{k}={format_value(point[k])}" for k in self.pair_by)

  def label(self, row: Any) -> str:
    text = format_value(row)
    return self.row_names.get(text, text)

  def metrics(self) -> list[str]:
    """Every path the record keeps: the columns', then the claims' not among them."""
    paths = [c.path for c in self.columns]
    return paths + [m for m in dict.fromkeys(c.metric for c in self.claims) if m not in paths]


def _spec_error(name: str, key: str, message: str) -> UserError:
  return UserError(f"results/{name}.py: TABLE['{key}']: {message}")


def spec_path(name: str) -> str:
  return os.path.join(RESULTS_DIR, f"{name}.py")


def record_path(name: str) -> str:
  return os.path.join(RECORDS_DIR, f"{name}.json")


def table_names() -> list[str]:
  """Every table spec under results/."""
  return sorted(f[:-3] for f in os.listdir(RESULTS_DIR) if f.endswith(".py") and f[0] != "_")


def load_table(name: str) -> TableSpec:
  """`results/NAME.py` as a TableSpec; a UserError names the file and key that is wrong."""
  path = spec_path(name)
  if name == RERUN_SUMMARY:
    raise UserError(
        f"results/{name}.py: '{name}' is the name of the generated summary of every table's "
        "reruns (<!-- table:reruns -->); give the table another name"
    )
  if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not os.path.isfile(path):
    raise UserError(f"no table spec results/{name}.py; known: {', '.join(table_names())}")
  sweep, module = load_sweep_file(path)
  table = getattr(module, "TABLE", None)
  if not isinstance(table, Mapping):
    raise UserError(f"results/{name}.py has no TABLE dict (experiments/tables.py says what)")
  known = {
      "title",
      "rows",
      "row_names",
      "split",
      "examples",
      "groups",
      "columns",
      "claims",
      "tolerance",
      "select",
      "select_within",
      "references",
      "pair_by",
      "pool",
  }
  unknown = sorted(set(table) - known)
  if unknown:
    raise _spec_error(name, unknown[0], f"unknown key; known: {', '.join(sorted(known))}")
  rows = table.get("rows")
  pair_by = tuple(table.get("pair_by") or (SEED_KEY,))
  if rows not in sweep.grid or rows in pair_by:
    raise _spec_error(name, "rows", f"{rows!r} is not a grid key other than {pair_by}")
  if SEED_KEY not in pair_by:
    raise _spec_error(name, "pair_by", f"{pair_by} must include {SEED_KEY!r}")
  for key in pair_by:
    if key not in sweep.grid:
      raise _spec_error(name, "pair_by", f"the grid has no {key!r} key to pair runs by")
  others = [k for k, v in sweep.grid.items() if k not in (rows, *pair_by) and len(v) > 1]
  if others:
    raise _spec_error(name, "rows", f"grid key {others[0]!r} also varies; a table has one")
  row_values = list(sweep.grid[rows])
  texts = [format_value(v) for v in row_values]
  columns = []
  for i, column in enumerate(table.get("columns") or ()):
    if (
        not isinstance(column, (tuple, list))
        or len(column) != 4
        or not all(isinstance(c, str) for c in column[:2])
        or not isinstance(column[2], (int, float))
        or not isinstance(column[3], int)
    ):
      raise _spec_error(name, f"columns[{i}]", f"{column!r} is not (path, label, scale, decimals)")
    columns.append(Column(column[0], column[1], float(column[2]), column[3]))
  if not columns:
    raise _spec_error(name, "columns", "at least one column is needed")
  claims = []
  for i, claim in enumerate(table.get("claims") or ()):
    if not isinstance(claim, Mapping) or set(claim) != {"row", "baseline", "metric", "better"}:
      raise _spec_error(name, f"claims[{i}]", "must be dict(row=, baseline=, metric=, better=)")
    for key in ("row", "baseline"):
      if claim[key] not in texts:
        raise _spec_error(name, f"claims[{i}]", f"{key} {claim[key]!r} is not a row: {texts}")
    if claim["better"] not in stats.DIRECTIONS:
      raise _spec_error(name, f"claims[{i}]", f"better must be one of {stats.DIRECTIONS}")
    claims.append(Claim(claim["row"], claim["baseline"], claim["metric"], claim["better"]))
  return TableSpec(
      name=name,
      path=os.path.relpath(path, REPO_ROOT),
      sweep=sweep,
      title=str(table.get("title") or name),
      rows=rows,
      row_values=row_values,
      row_names=dict(table.get("row_names") or {}),
      split=str(table.get("split") or "test"),
      examples=str(table.get("examples") or "num_examples"),
      groups=table.get("groups"),
      columns=columns,
      claims=claims,
      tolerance=float(table.get("tolerance", DEFAULT_TOLERANCE)),
      select=_check_select(name, table.get("select"), columns),
      select_within=_check_select_within(name, table, columns),
      references=_check_references(name, table.get("references")),
      pair_by=pair_by,
      pool=_check_pool(name, table.get("pool"), pair_by),
  )


def _check_pool(name: str, pool: Any, pair_by: tuple[str, ...]) -> tuple[str, str] | None:
  if pool is None:
    return None
  if (
      not isinstance(pool, (tuple, list))
      or len(pool) != 2
      or not re.fullmatch(r"[\w.]+:\w+", str(pool[0]))
      or pool[1] not in pair_by
      or pool[1] == SEED_KEY
  ):
    raise _spec_error(
        name, "pool", f"{pool!r} is not ('package.module:function', a pair_by key other than seed)"
    )
  return str(pool[0]), str(pool[1])


def _import(spec: TableSpec, key: str, target: str) -> Any:
  module_name, function = target.split(":")
  try:
    return getattr(importlib.import_module(module_name), function)
  except (ImportError, AttributeError) as e:
    raise _spec_error(spec.name, key, f"cannot import {target}: {e}") from None


def pooled_rows(spec: TableSpec, results: Sequence[Any]) -> list[dict[str, Any]]:
  """Per row and per value of the pair keys but the pooled one (the seed), the spec's pool
  function's report of the finished runs that differ only in the pooled key (the folds):
  [{"row", "seed", "runs", "metrics", "groups"}]; a unit with an unfinished run is left out."""
  target, over = spec.pool
  pool = _import(spec, "pool", target)
  units: dict[tuple[str, Any], list[Any]] = {}
  rest = [k for k in spec.pair_by if k != over]
  for result in results:
    p = result.point
    if rest == [SEED_KEY]:
      unit = p[SEED_KEY]
    else:
      unit = ",".join(f"{k}={format_value(p[k])}" for k in rest)
    units.setdefault((format_value(p[spec.rows]), unit), []).append(result)
  pooled = []
  for (row, unit), members in units.items():
    if any(m.status != "ok" for m in members):
      continue
    report = pool([m.run_dir for m in members])
    pooled.append(
        {
            "row": row,
            "seed": unit,
            "runs": len(members),
            "metrics": {p: metric_value(report, p) for p in spec.metrics()},
            **sample_sizes(report, spec),
        }
    )
  return pooled


def _check_references(name: str, references: Any) -> str | None:
  if references is None:
    return None
  if not isinstance(references, str) or not re.fullmatch(r"[\w.]+:\w+", references):
    raise _spec_error(name, "references", f"{references!r} is not 'package.module:function'")
  return references


def reference_rows(spec: TableSpec) -> list[dict[str, Any]]:
  """The spec's reference readers scored on the data its runs read (the config the sweep gives
  each row's first run, as `experiments.spec.resolved_config` builds it): [{"name", "metrics":
  {path: value}}] for the paths the record keeps. A pooled table's readers are scored on each
  value of the pooled key (each fold's data) and their values averaged, as its runs' rows are."""
  read = _import(spec, "references", spec.references)
  over = spec.pool[1] if spec.pool else None
  firsts = {}
  for point in grid_points(spec.sweep):
    firsts.setdefault((format_value(point[spec.rows]), point.get(over)), point)
  data: dict[Any, dict[str, str]] = {}
  for (_, part), point in firsts.items():
    config = resolved_config(spec.sweep, point).to_dict()
    data.setdefault(part, {}).setdefault(json.dumps(config["data"], sort_keys=True), config)
  if any(len(configs) > 1 for configs in data.values()):
    raise _spec_error(spec.name, "references", "its rows read different data; one is needed")
  scored: dict[str, list[dict[str, Any]]] = {}
  for configs in data.values():
    (config,) = configs.values()
    for name, report in read(config, REPO_ROOT).items():
      scored.setdefault(name, []).append({p: metric_value(report, p) for p in spec.metrics()})
  rows = []
  for name, parts in scored.items():
    metrics = {}
    for path in spec.metrics():
      values = [m[path] for m in parts if m[path] is not None]
      metrics[path] = math.fsum(values) / len(values) if len(values) == len(parts) else None
    suffix = f", mean over {len(parts)} {over.split('.')[-1]}s" if len(parts) > 1 else ""
    rows.append({"name": name + suffix, "metrics": metrics})
  return rows


def add_references(spec: TableSpec) -> str:
  """Scores the spec's reference readers into its existing record (whose runs need not exist
  any more: the readers read only the data)."""
  record = read_record(spec.name)
  record["references"] = reference_rows(spec)
  path = record_path(spec.name)
  write_atomically(path, json.dumps(record, indent=1) + "\n")
  return path


def _check_select(name: str, select: Any, columns: list[Column]) -> str | None:
  if select is not None and select not in [c.path for c in columns]:
    raise _spec_error(name, "select", f"{select!r} is not the path of a column")
  return select


def _check_select_within(
    name: str, table: Mapping[str, Any], columns: list[Column]
) -> tuple[str, float] | None:
  within = table.get("select_within")
  if within is None:
    return None
  if not table.get("select"):
    raise _spec_error(name, "select_within", "needs a select path")
  if (
      not isinstance(within, (tuple, list))
      or len(within) != 2
      or within[0] not in [c.path for c in columns]
      or not isinstance(within[1], (int, float))
      or within[1] < 0
  ):
    raise _spec_error(
        name, "select_within", f"{within!r} is not (path of a column, non-negative margin)"
    )
  return str(within[0]), float(within[1])


def chosen_row(spec: TableSpec, summary: dict[str, Any]) -> str | None:
  """The row a tuning table chooses: the highest mean of `select` among the rows whose mean of
  the `select_within` path is within its margin of the best row's (all rows without a guard)."""

  def means(path):
    return {
        row: entry["cells"][path].mean
        for row, entry in summary["rows"].items()
        if entry["cells"].get(path)
    }

  scores = means(spec.select)
  if spec.select_within:
    path, margin = spec.select_within
    guard = means(path)
    if guard:
      best = max(guard.values())
      scores = {row: v for row, v in scores.items() if guard.get(row, -math.inf) >= best - margin}
  return max(scores, key=scores.get) if scores else None


def metric_value(report: Any, path: str) -> float | None:
  """The number at a dotted path; numbers nested in mappings or lists there (per layer, per
  block, per batch) give their mean; a bool counts as 0 or 1 (a column of "met" flags is the
  fraction of runs that met it); None where the path or a number is missing."""
  value = lookup(report, path)
  if isinstance(value, bool):
    return float(value)
  if isinstance(value, (Mapping, list, tuple)):
    numbers = _leaves(value)
    if not numbers or not all(is_number(v) for v in numbers):
      return None
    return math.fsum(numbers) / len(numbers)
  return float(value) if is_number(value) else None


def _leaves(value: Any) -> list[Any]:
  if isinstance(value, Mapping):
    value = list(value.values())
  if isinstance(value, (list, tuple)):
    return [leaf for v in value for leaf in _leaves(v)]
  return [value]


def sample_sizes(report: Mapping[str, Any], spec: TableSpec) -> dict[str, Any]:
  """The reported split's example count and, with `groups`, each group's ("attribute=group")."""
  examples = metric_value(report, spec.examples)
  groups = {}
  if spec.groups:
    attributes = lookup(report, spec.groups)
    for attribute, entry in (attributes if isinstance(attributes, Mapping) else {}).items():
      for group, values in (entry.get("groups") or {}).items():
        groups[f"{attribute}={group}"] = int(values["n"])
  return {"examples": None if examples is None else int(examples), "groups": groups}


def make_record(spec: TableSpec, workdir: str) -> dict[str, Any]:
  """The record of a finished (or partly finished) sweep of `spec` in `workdir`."""
  runs = []
  dates = []
  configs = []
  results = collect(spec.sweep, workdir)  # Read once: the rows, the pooling and the provenance.
  for result in results:
    point = result.point
    entry: dict[str, Any] = {
        "row": format_value(point[spec.rows]),
        "seed": spec.pair(point),
        "status": result.status,
        "settings": run_record(spec.sweep, point)["settings"],
    }
    config_path = os.path.join(result.run_dir, "config.json")
    if os.path.isfile(config_path):
      with open(config_path) as f:
        configs.append(json.load(f))
    if result.status == "ok":
      entry["metrics"] = {p: metric_value(result.report, p) for p in spec.metrics()}
      entry.update(sample_sizes(result.report, spec))
      dates.append(os.path.getmtime(os.path.join(result.run_dir, REPORT)))
    else:
      entry["error"] = result.error
    runs.append(entry)
  record: dict[str, Any] = {"table": spec.name, "spec": spec.path}
  if spec.references:
    record["references"] = reference_rows(spec)
  if spec.pool:
    record["pooled"] = pooled_rows(spec, results)
  provenance = {
      **_runs_source_and_host(results),
      "date": (
          datetime.datetime.fromtimestamp(max(dates), datetime.timezone.utc).strftime("%Y-%m-%d")
          if dates
          else None
      ),
      # Every input file or directory the runs read (their config.json's data keys).
      "data": data_hashes(configs),
      "seeds": list(spec.sweep.grid[SEED_KEY]),
      "commands": [
          f"python -m experiments.sweep --sweep={spec.path} --workdir=WORKDIR",
          f"python -m experiments.tables --record={spec.name} --workdir=WORKDIR",
      ],
  }
  return {**record, "provenance": provenance, "runs": runs}


def _runs_source_and_host(results: Sequence[Any]) -> dict[str, Any]:
  """The commit and machine of the finished runs, from the `provenance.json` the sweep wrote
  beside each when it started it (`experiments.supervise`); the device kind and count, which
  the supervisor does not query, are this process's. Runs older than that file are described
  by this checkout and this process's machine."""
  here = machine()
  device = {"device": here["device"], "devices": here["devices"]}
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
      "machine": {**device, **first["host"]},
  }
  others = sorted(
      {w["commit"] for w in written} - {first["commit"]}
  ) + sorted({why for w in written for why in differences(first["host"], w["host"], "host.")})
  if others:  # A sweep resumed on another checkout or machine: say so in the record.
    found["mixed_runs"] = others
  return found


def write_record(spec: TableSpec, workdir: str) -> str:
  record = make_record(spec, workdir)
  os.makedirs(RECORDS_DIR, exist_ok=True)
  path = record_path(spec.name)
  write_atomically(path, json.dumps(record, indent=1) + "\n")
  return path


def add_rerun(spec: TableSpec, workdir: str) -> str:
  """Adds the finished runs of a rerun of `spec`'s sweep in `workdir`, with their provenance, to
  the record's `reruns` (replacing an earlier rerun made with the same machine description)."""
  record = read_record(spec.name)
  rerun = make_record(spec, workdir)
  finished = [r for r in rerun["runs"] if r["status"] == "ok"]
  if not finished:
    raise UserError(f"--rerun={spec.name}: no finished run of its sweep in {workdir}")
  entry = {"provenance": rerun["provenance"], "runs": finished}
  machine_of = lambda r: r["provenance"]["machine"]  # noqa: E731
  record["reruns"] = [r for r in record.get("reruns", []) if machine_of(r) != machine_of(entry)]
  record["reruns"].append(entry)
  path = record_path(spec.name)
  write_atomically(path, json.dumps(record, indent=1) + "\n")
  return path


@dataclasses.dataclass(frozen=True)
class RerunComparison:
  """What a rerun of a table's runs changes: per claim both rows have in the rerun, the two
  verdicts and the change of the mean paired difference (in the claim's column's scale)."""

  runs: int
  rows: list[str]
  seeds: list[int]
  claims: list[tuple[Claim, str, str, float]]  # (claim, recorded, rerun verdict, |change|)
  chosen: tuple[str, str] | None  # A tuning table's (recorded, rerun) choice.
  # Changes are compared across claims in units of the recorded interval's half-width (a
  # change of 0.01 means little on accuracy in percent and much on a fairness gap), and printed
  # in the claim's column's scale: (|change|, |change| / half-width or None, claim[, seed]).
  largest_change: tuple[float, float | None, Claim] | None = None
  largest_seed_change: tuple[float, float | None, Claim, Any] | None = None


def _relative_change(change: float, interval: stats.Interval, scale: float) -> float | None:
  """`change` (in the column's scale) in half-widths of the recorded interval, or None."""
  if interval.low is None:
    return None
  half_width = (interval.high - interval.low) / 2 * scale
  if half_width <= 0:  # Every seed the same difference: any change is beyond the interval.
    return math.inf if change > 0 else 0.0
  return change / half_width


def _by_relative_change(entry: tuple) -> tuple[float, float]:
  """Sort key: the change in half-widths (where known), then the change itself."""
  return (entry[1] if entry[1] is not None else -1.0, entry[0])


def compare_rerun(
    spec: TableSpec, record: Mapping[str, Any], rerun: Mapping[str, Any]
) -> RerunComparison:
  recorded = summarise(spec, record)
  again = summarise(spec, {"runs": rerun["runs"]})
  scales = {c.path: c.scale for c in spec.columns}
  claims = []
  changes: list[tuple[float, float | None, Claim]] = []
  seed_changes: list[tuple[float, float | None, Claim, Any]] = []
  for (claim, before), (_, after) in zip(recorded["claims"], again["claims"]):
    if before.difference is None or after.difference is None:
      continue  # A row of the claim was not rerun.
    scale = scales.get(claim.metric, 1.0)
    change = abs(after.difference.mean - before.difference.mean) * scale
    claims.append((claim, before.verdict, after.verdict, change))
    changes.append((change, _relative_change(change, before.difference, scale), claim))
    old, new = (
        stats.paired(_values(r, claim.row, claim.metric), _values(r, claim.baseline, claim.metric))
        for r in (record, rerun)
    )
    new_by_seed = dict(zip(*new))
    for seed, difference in zip(*old):
      if seed in new_by_seed:
        seed_change = abs(new_by_seed[seed] - difference) * scale
        seed_changes.append(
            (seed_change, _relative_change(seed_change, before.difference, scale), claim, seed)
        )
  rows = [r for r in (format_value(v) for v in spec.row_values) if again["rows"][r]["seeds"]]
  chosen = None
  if spec.select and len(rows) == len(spec.row_values):
    chosen = (chosen_row(spec, recorded), chosen_row(spec, again))
  return RerunComparison(
      runs=len(rerun["runs"]),
      rows=rows,
      seeds=sorted({r["seed"] for r in rerun["runs"]}),
      claims=claims,
      chosen=chosen,
      largest_change=max(changes, key=_by_relative_change) if changes else None,
      largest_seed_change=max(seed_changes, key=_by_relative_change) if seed_changes else None,
  )


def _xla_flags(m: Mapping[str, Any]) -> str | None:
  """The XLA_FLAGS a record's machine ran under (what an instruction-set rerun changes)."""
  return (m.get("environment") or {}).get("XLA_FLAGS")


def _machine_text(m: Mapping[str, Any]) -> str:
  processor = f", {m['processor']['model']}" if "processor" in m else ""
  flags = _xla_flags(m)
  return (
      f"{m['device']}, {m['cpu_cores']} CPU cores ({m['arch']}{processor}), JAX {m['jax']}"
      + (f", `XLA_FLAGS={flags}`" if flags else "")
  )


def _change_text(change: float, relative: float | None, decimals: int, label: str = "") -> str:
  """A change as `0.4 (0.0061)`, or `0.4 (0.0061, MF-PQD)` with a label: half-widths of the
  recorded interval, then the change in the column's scale, one decimal finer than the column
  (a change is smaller than the values)."""
  absolute = f"{change:.{decimals + 1}f}"
  if relative is None:
    return f"{absolute} ({label})" if label else absolute
  detail = f"{absolute}, {label}" if label else absolute
  if math.isinf(relative):
    return f"beyond a zero-width interval ({detail})"
  return f"{relative:.1f} ({detail})"


def _rerun_lines(spec: TableSpec, record: Mapping[str, Any]) -> list[str]:
  """One paragraph per rerun in the record: what it ran and which verdicts it keeps."""
  lines = []
  labels = {c.path: (c.label, c.decimals) for c in spec.columns}
  total = len(record["runs"])
  for rerun in record.get("reruns", ()):
    result = compare_rerun(spec, record, rerun)
    p = rerun["provenance"]
    which = (
        "every run"
        if result.runs == total
        else f"{result.runs} of {total} runs: the rows "
        + ", ".join(spec.label(r) for r in result.rows)
        + f"; {_units(spec)} {', '.join(_unit_text(u) for u in result.seeds)}"
    )
    text = (
        f"**Rerun** ({which}; runs of {p['date']}, commit {p['commit']}; "
        f"{_machine_text(p['machine'])}): "
    )
    changed = [(c, a, b) for c, a, b, _ in result.claims if a != b]
    if not result.claims:
      text += "no claim has both its rows in the rerun"
    elif not changed:
      text += f"every verdict the same ({len(result.claims)} of {len(spec.claims)} claims rerun)"
    else:
      text += f"{len(changed)} of {len(result.claims)} verdicts rerun change: " + "; ".join(
          f"{spec.label(c.row)} {c.better} than {spec.label(c.baseline)} on "
          f"{labels.get(c.metric, (c.metric, 3))[0]}: {a} -> {b}"
          for c, a, b in changed
      )
    if result.largest_change:
      change, relative, claim = result.largest_change
      label, decimals = labels.get(claim.metric, (claim.metric, 3))
      text += (
          "; the largest change of a mean paired difference, in half-widths of its recorded "
          f"interval, is {_change_text(change, relative, decimals)} "
          f"({spec.label(claim.row)} against {spec.label(claim.baseline)}, {label})"
      )
    if result.largest_seed_change:
      change, relative, claim, seed = result.largest_seed_change
      label, decimals = labels.get(claim.metric, (claim.metric, 3))
      text += (
          f", of one pair's {_change_text(change, relative, decimals)} "
          f"({spec.label(claim.row)} against {spec.label(claim.baseline)}, {label}, "
          f"{' × '.join(k.split('.')[-1] for k in spec.pair_by)} {_unit_text(seed)})"
      )
    if result.chosen:
      before, after = result.chosen
      text += (
          f"; it chooses the same setting, {spec.label(after)}"
          if before == after
          else f"; it chooses {spec.label(after)} instead of {spec.label(before)}"
      )
    lines.append(text + ".")
  return lines


# The reserved name of the generated summary of every table's reruns
# (`<!-- table:reruns -->` in a document); no spec may take it.
RERUN_SUMMARY = "reruns"


def _rerun_machine(provenance: Mapping[str, Any]) -> str:
  """What tells a rerun's machine apart, briefly: its XLA_FLAGS, else its processor."""
  m = provenance["machine"]
  flags = _xla_flags(m)
  if flags:
    return f"`XLA_FLAGS={flags}`"
  return m.get("processor", {}).get("model") or m["device"]


def rerun_summary() -> str:
  """One row per rerun of every table that decides claims (or "not rerun"): how much of the
  table it reran, on what, which verdicts and tuning choice it keeps and which it changes, and
  the largest change of a mean paired difference. Rendered from the records alone."""
  header = (
      "table",
      "rerun",
      "verdicts kept",
      "verdicts that change (recorded -> rerun)",
      "largest change of a mean paired difference, in half-widths of its interval (change)",
  )
  rows = []
  for name in table_names():
    if name == RERUN_SUMMARY or not os.path.exists(record_path(name)):
      continue
    spec = load_table(name)
    if not spec.claims:
      continue
    record = read_record(name)
    if not record.get("reruns"):
      rows.append((f"`{name}`", "not rerun", "—", "—", "—"))
      continue
    labels = {c.path: (c.label, c.decimals) for c in spec.columns}
    total = len(record["runs"])
    for rerun in record["reruns"]:
      result = compare_rerun(spec, record, rerun)
      how_much = "every run" if result.runs == total else f"{result.runs} of {total} runs"
      kept = sum(before == after for _, before, after, _ in result.claims)
      if not result.claims:
        kept_text = "— (no claim has both its rows rerun)"
      else:
        kept_text = f"{kept} of {len(result.claims)}" + (
            f" ({len(result.claims)} of {len(spec.claims)} claims rerun)"
            if len(result.claims) < len(spec.claims)
            else ""
        )
      if result.chosen:
        kept_text += "; same choice" if result.chosen[0] == result.chosen[1] else "; another choice"
      changed = "; ".join(
          f"{spec.label(c.row)} against {spec.label(c.baseline)}, "
          f"{labels.get(c.metric, (c.metric, 3))[0]}: {before} -> {after}"
          for c, before, after, _ in result.claims
          if before != after
      )
      largest = "—"
      if result.largest_change:
        change, relative, claim = result.largest_change
        label, decimals = labels.get(claim.metric, (claim.metric, 3))
        largest = _change_text(change, relative, decimals, label)
      rows.append(
          (
              f"`{name}`",
              f"{how_much}, {_rerun_machine(rerun['provenance'])}",
              kept_text,
              changed or "none",
              largest,
          )
      )
  return "\n".join(_markdown_table(header, rows)) + "\n"


def _render_marked(name: str) -> str:
  """A marked table of a document: the rerun summary, or the table `name` from its record."""
  if name == RERUN_SUMMARY:
    return rerun_summary()
  return render(load_table(name), read_record(name))


# What `render` and `stale_runs` read of a record.
_RECORD_KEYS = ("provenance", "runs")
_PROVENANCE_KEYS = ("commit", "date", "machine", "seeds", "commands")


def read_record(name: str) -> dict[str, Any]:
  path = record_path(name)
  try:
    with open(path) as f:
      record = json.load(f)
  except FileNotFoundError:
    raise UserError(
        f"table {name!r} has no record {os.path.relpath(path, REPO_ROOT)}; make it with "
        f"`python -m experiments.tables --record={name} --workdir=DIR` after its sweep"
    ) from None
  except ValueError as e:
    raise UserError(f"{os.path.relpath(path, REPO_ROOT)}: not JSON ({e})") from None
  where = os.path.relpath(path, REPO_ROOT)
  if not isinstance(record, dict):
    raise UserError(f"{where}: not a table record (a JSON object with {', '.join(_RECORD_KEYS)})")
  for key in _RECORD_KEYS:
    if key not in record:
      raise UserError(f"{where}: the record has no {key!r} (remake it with --record={name})")
  for key in _PROVENANCE_KEYS:
    if not isinstance(record["provenance"], dict) or key not in record["provenance"]:
      raise UserError(f"{where}: the record's provenance has no {key!r} (remake it with --record={name})")
  return record


def stale_runs(spec: TableSpec, record: Mapping[str, Any]) -> list[str]:
  """Why the record no longer describes the spec's runs (another grid or other settings)."""
  expected = {
      (format_value(p[spec.rows]), spec.pair(p)): run_record(spec.sweep, p)["settings"]
      for p in grid_points(spec.sweep)
  }
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


def _values(record: Mapping[str, Any], row: str, path: str) -> dict[int, float]:
  return {
      r["seed"]: r["metrics"][path]
      for r in record["runs"]
      if r["row"] == row and r["status"] == "ok" and r["metrics"].get(path) is not None
  }


def _interval_text(interval: stats.Interval, scale: float, decimals: int, sign=False) -> str:
  text = stats.format_interval(
      interval.mean, interval.low, interval.high, scale=scale, decimals=decimals, sign=sign
  )
  return text.replace("-", "−")  # Typographic minus in the markdown tables.


def summarise(spec: TableSpec, record: Mapping[str, Any]) -> dict[str, Any]:
  """Per row and column the interval over seeds, per claim its decision, and the flags."""
  rows = {}
  for value in spec.row_values:
    row = format_value(value)
    rows[row] = {
        "seeds": sorted(
            {r["seed"] for r in record["runs"] if r["row"] == row and r["status"] == "ok"}
        ),
        "cells": {
            c.path: (
                stats.t_interval(list(v.values())) if (v := _values(record, row, c.path)) else None
            )
            for c in spec.columns
        },
    }
  claims = [
      (
          claim,
          stats.decide(
              _values(record, claim.row, claim.metric),
              _values(record, claim.baseline, claim.metric),
              claim.better,
          ),
      )
      for claim in spec.claims
  ]
  flags = []
  ok = [r for r in record["runs"] if r["status"] == "ok"]
  examples = sorted({r["examples"] for r in ok if r.get("examples") is not None})
  if examples and examples[0] < stats.MIN_SPLIT_EXAMPLES:
    flags.append(
        f"small sample: the {spec.split} split has {examples[0]} examples "
        f"(< {stats.MIN_SPLIT_EXAMPLES})"
    )
  small_groups = {}
  for r in ok:
    for group, n in (r.get("groups") or {}).items():
      if n < stats.MIN_GROUP_EXAMPLES:
        small_groups[group] = min(n, small_groups.get(group, n))
  if small_groups:
    listed = ", ".join(f"{g} (n={n})" for g, n in sorted(small_groups.items()))
    flags.append(
        f"small groups in the {spec.split} split (< {stats.MIN_GROUP_EXAMPLES} examples): {listed}"
    )
  few = sorted({len(result.seeds) for _, result in claims if not result.enough_seeds})
  if few:
    flags.append(
        f"{'/'.join(map(str, few))} paired seeds where a verdict needs {stats.MIN_VERDICT_SEEDS}: "
        "those verdicts are for context only"
    )
  missing: dict[str, list[str]] = {}
  for r in record["runs"]:
    if r["status"] != "ok":
      missing.setdefault(spec.label(r["row"]), []).append(
          f"{_unit_text(r['seed'])} ({r['status']})"
      )
  if missing:
    listed = "; ".join(f"{row} seeds {', '.join(seeds)}" for row, seeds in missing.items())
    flags.append(f"runs without a result: {listed}")
  return {"rows": rows, "claims": claims, "flags": flags}


def _pooled_table(spec: TableSpec, record: Mapping[str, Any]) -> list[str]:
  """The pooled reports (e.g. the folds of each seed together): per row the mean over the
  pooled units of every column the reports hold, and the smallest group size they score."""
  over = spec.pool[1]
  columns = [
      c for c in spec.columns if any(p["metrics"].get(c.path) is not None for p in record["pooled"])
  ]
  body = []
  for value in spec.row_values:
    row = format_value(value)
    units = [p for p in record["pooled"] if p["row"] == row]
    if not units:
      continue
    cells = []
    for c in columns:
      values = [p["metrics"][c.path] for p in units if p["metrics"].get(c.path) is not None]
      cells.append(_interval_text(stats.t_interval(values), c.scale, c.decimals) if values else "—")
    body.append([spec.label(row), *cells, str(len(units))])
  sizes = {}
  for p in record["pooled"]:
    for group, n in (p.get("groups") or {}).items():
      sizes[group] = min(n, sizes.get(group, n))
  runs = sorted({p["runs"] for p in record["pooled"]})
  title = (
      f"**Pooled over {'/'.join(map(str, runs))} {over.split('.')[-1]}s**: one report of each "
      f"unit's runs together (every example scored once; `{spec.pool[0]}`)"
  )
  smallest = (
      "; smallest groups: "
      + ", ".join(f"{g} (n={n})" for g, n in sorted(sizes.items(), key=lambda x: x[1])[:3])
      if sizes
      else ""
  )
  return [title + smallest, ""] + _markdown_table(
      ["", *(c.label for c in columns), "pooled units"], body
  )


def _unit_text(unit: Any) -> str:
  """A pairing unit as a reader names it: a seed, or `fold=0,seed=0` for a pair_by unit (the
  keys shortened to their last part)."""
  if not isinstance(unit, str):
    return str(unit)
  return ",".join(
      f"{key.rpartition('.')[2]}={value}"
      for key, _, value in (part.partition("=") for part in unit.split(","))
  )


def _units(spec: TableSpec) -> str:
  """What a table's runs are paired by: "seeds", or e.g. "folds × seeds"."""
  return " × ".join(k.split(".")[-1] + "s" for k in spec.pair_by)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render(spec: TableSpec, record: Mapping[str, Any]) -> str:
  """The table's markdown, from its record alone (deterministic: `--check` compares it)."""
  summary = summarise(spec, record)
  confidence = round(100 * stats.CONFIDENCE)
  lines = [
      f"**{spec.title}** ({spec.split} split; mean [{confidence}% Student-t interval] over "
      f"{_units(spec)})",
      "",
  ]
  body = []
  for row, entry in summary["rows"].items():
    cells = [
        _interval_text(entry["cells"][c.path], c.scale, c.decimals)
        if entry["cells"][c.path]
        else "—"
        for c in spec.columns
    ]
    body.append([spec.label(row), *cells, str(len(entry["seeds"]))])
  for reference in record.get("references", ()):
    cells = [
        "—"
        if (value := reference["metrics"].get(c.path)) is None
        else f"{c.scale * value:.{c.decimals}f}".replace("-", "−")
        for c in spec.columns
    ]
    body.append([f"*reference: {reference['name']}*", *cells, "—"])
  lines += _markdown_table(["", *(c.label for c in spec.columns), _units(spec)], body)
  if record.get("pooled"):
    lines += ["", *_pooled_table(spec, record)]
  if summary["claims"]:
    rerun_claims = [
        entry
        for rerun in record.get("reruns", ())
        for entry in compare_rerun(spec, record, rerun).claims
    ]
    scales = {c.path: (c.scale, c.decimals, c.label) for c in spec.columns}
    body = []
    for claim, result in summary["claims"]:
      scale, decimals, label = scales.get(claim.metric, (1.0, 3, claim.metric))
      difference = (
          _interval_text(result.difference, scale, decimals, sign=True)
          if result.difference
          else "—"
      )
      verdict = result.verdict if result.enough_seeds else f"{result.verdict} (too few seeds)"
      # A verdict a rerun does not reach is marked where it is read, not only below the table.
      moved = [after for c, before, after, _ in rerun_claims if c == claim and after != before]
      rerun_note = f" (a rerun: {', '.join(moved)})" if moved else ""
      body.append(
          [
              f"{spec.label(claim.row)} {claim.better} than {spec.label(claim.baseline)}",
              label,
              difference,
              str(len(result.seeds)),
              f"**{verdict}**{rerun_note}",
          ]
      )
    lines += [""]
    lines += _markdown_table(
        ["claim", "on", f"paired difference [{confidence}% interval]", "pairs", "verdict"], body
    )
  best = chosen_row(spec, summary) if spec.select else None
  if best is not None:
    label = next(c.label for c in spec.columns if c.path == spec.select)
    rule = f"the highest mean {label}"
    if spec.select_within:
      path, margin = spec.select_within
      guard = next(c for c in spec.columns if c.path == path)
      rule += (
          f" among the settings whose mean {guard.label} is within "
          f"{format_value(margin * guard.scale)} of the best"
      )
    lines += ["", f"Chosen by {rule}: **{spec.label(best)}**."]
  if summary["flags"]:
    lines += [""] + [f"- Flag: {flag}." for flag in summary["flags"]]
  for text in _rerun_lines(spec, record):
    lines += ["", text]
  p = record["provenance"]
  m = p["machine"]
  changes = p.get("uncommitted_changes") or []
  commit = p["commit"] + (f" with uncommitted changes to {', '.join(changes)}" if changes else "")
  seeds = ", ".join(str(s) for s in p["seeds"])
  # Older records name neither the processor nor their input data.
  processor = f", {m['processor']['model']}" if "processor" in m else ""
  data = (
      f"{len(p['data'])} input file(s) or folder(s) hashed in the record; " if p.get("data") else ""
  )
  reproduced = "".join(
      f"first run reproduced {'exactly' if r['exact'] else 'within ' + format(r['tolerance'], 'g')}"
      f" on {r['date']} (commit {r['commit']}; {_machine_text(r['machine'])}; "
      f"{len(r['data'])} input file(s) or folder(s) hashed); "
      for r in p.get("reproduced", ())
  )
  lines += [
      "",
      f"<sub>Provenance: commit {commit}; runs of {p['date']}; {m['device']}, "
      f"{m['cpu_cores']} CPU cores ({m['arch']}{processor}), {m['devices']} device(s), "
      f"JAX {m['jax']}; {data}{reproduced}"
      f"seeds {seeds}; spec `{spec.path}`, record `{os.path.relpath(record_path(spec.name), REPO_ROOT)}`; "
      + "; ".join(f"`{c}`" for c in p["commands"])
      + ".</sub>",
  ]
  return "\n".join(lines) + "\n"


def _read_doc(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read the document ({e})") from None


def write_doc(path: str) -> list[str]:
  """Renders every marked table of the markdown file `path` in place; returns their names."""
  text = _read_doc(path)
  names = []

  def rendered(name: str) -> str:
    names.append(name)
    return _render_marked(name)

  text = replace_tables(text, path, rendered)
  write_atomically(path, text)
  return names


def check_doc(path: str) -> list[str]:
  """Problems with the marked tables of `path`: a table that differs from its record's
  rendering (with the diff), a record that no longer matches its spec, an unmarked table name."""
  text = _read_doc(path)
  problems = []
  tables = marked_tables(text, path)
  if not tables:
    problems.append(f"{path}: no marked table (<!-- table:NAME --> ... <!-- /table:NAME -->)")
  for table in tables:
    name, body = table.name, text[table.body_start : table.body_end]
    try:
      if name != RERUN_SUMMARY:
        for why in stale_runs(load_table(name), read_record(name)):
          problems.append(f"{path}: table {name}: the record is stale: {why}")
      expected = _render_marked(name)
    except UserError as e:
      problems.append(f"{path}: table {name}: {e}")
      continue
    if body != expected:
      diff = "".join(
          difflib.unified_diff(
              body.splitlines(True), expected.splitlines(True), "in the file", "rendered"
          )
      )
      problems.append(f"{path}: table {name} differs from its record:\n{diff}")
  return problems


def compare(
    recorded: Mapping[str, float | None], report: Mapping[str, Any], tolerance: float
) -> tuple[bool, list[str]]:
  """Each recorded value against the same path in a new report: (all within `tolerance`,
  one line per value)."""
  ok = True
  lines = [f"  {'value':<32} {'recorded':>22} {'reproduced':>22}  equal"]
  for path, value in recorded.items():
    again = metric_value(report, path)
    if value is None or again is None:
      equal = value is None and again is None
    else:
      equal = abs(again - value) <= tolerance
    ok &= equal
    lines.append(f"  {path:<32} {value!r:>22} {again!r:>22}  {'yes' if equal else 'NO'}")
  return ok, lines


def reproduce(
    spec: TableSpec,
    record: Mapping[str, Any],
    workdir: str | None = None,
    tolerance: float | None = None,
    stamp: bool = False,
) -> tuple[bool, list[str]]:
  """Reruns the record's run of the first row and the first seed, and compares every recorded
  value (`compare`): exactly where the machine, software and data match the record
  (`experiments.provenance.differences`: processor and its instruction set, device, cores,
  package versions, XLA_FLAGS, input-data hashes) or match an exact reproduction stored in it,
  else within the spec's `tolerance` unless one is given. Returns (reproduced, the lines to
  print). With `stamp`, a reproduction is added to the record's `provenance.reproduced` (its
  date, commit, machine, input-data hashes, whether every value was exact): for a record older
  than its machine's full description, the evidence of where its numbers come back exactly."""
  first = grid_points(spec.sweep)[0]
  row, seed = format_value(first[spec.rows]), spec.pair(first)
  recorded = [r for r in record["runs"] if r["row"] == row and r["seed"] == seed]
  if not recorded or recorded[0]["status"] != "ok":
    raise UserError(f"table {spec.name}: the record has no result for {row} seed {seed}")
  provenance = record["provenance"]
  why_not_exact = _why_not_exact(provenance)
  vouched = [
      r for r in provenance.get("reproduced", ()) if r["exact"] and not _why_not_exact(r)
  ]
  if why_not_exact and vouched:  # An exact reproduction here vouches for an older record.
    why_not_exact = []
  same_machine = not why_not_exact
  if tolerance is None:
    tolerance = 0.0 if same_machine else spec.tolerance
  point = next(
      p
      for p in grid_points(spec.sweep)
      if format_value(p[spec.rows]) == row and spec.pair(p) == seed
  )
  workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix=f"reproduce_{spec.name}_"))
  run_dir = os.path.join(workdir, "run")
  command = run_command(spec.sweep, point, run_dir)
  where = (
      "the recording machine, software and data"
      if same_machine
      else "not the recording machine, software or data"
  )
  lines = [
      f"Reproducing table {spec.name}: {spec.label(row)}, seed {seed} ({where}; tolerance "
      f"{tolerance:g})",
  ]
  if not same_machine:
    lines += [f"  differs: {why}" for why in why_not_exact]
    lines.append(
        "  so the rerun is compared within "
        + (f"the spec's tolerance ({spec.tolerance:g})" if tolerance == spec.tolerance
           else f"the given tolerance ({tolerance:g})")
        + ", not exactly"
    )
  lines.append("  python " + " ".join(command[1:]))
  os.makedirs(run_dir, exist_ok=True)
  log_path = os.path.join(workdir, "log.txt")
  with open(log_path, "w") as log:
    status = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
  try:
    with open(os.path.join(run_dir, REPORT)) as f:
      report = json.load(f)
  except (OSError, ValueError):
    return False, lines + [f"  the run failed (exit {status}); its log: {log_path}"]
  ok, compared = compare(recorded[0]["metrics"], report, tolerance)
  exact = compare(recorded[0]["metrics"], report, 0.0)[0]
  verdict = "Reproduced" + (" (every value exact)." if exact else ".") if ok else "NOT reproduced."
  lines += compared + [f"{verdict} Run directory: {run_dir}"]
  if ok and stamp:
    with open(os.path.join(run_dir, "config.json")) as f:
      config = json.load(f)
    entry = {
        "date": datetime.date.today().isoformat(),
        **source_state(REPO_ROOT),
        "machine": machine(),
        "data": data_hashes([config]),
        "exact": exact,
        "tolerance": tolerance,
    }
    stamped = read_record(spec.name)
    kept = [
        r for r in stamped["provenance"].get("reproduced", ()) if r["machine"] != entry["machine"]
    ]
    stamped["provenance"]["reproduced"] = kept + [entry]
    write_atomically(record_path(spec.name), json.dumps(stamped, indent=1) + "\n")
    lines.append(f"Added the reproduction to {os.path.relpath(record_path(spec.name), REPO_ROOT)}.")
  return ok, lines


def _why_not_exact(provenance: Mapping[str, Any]) -> list[str]:
  """How this machine, its software and the input data differ from a record's (or a recorded
  reproduction's) `machine` and `data` (nothing: a rerun must give every value exactly)."""
  why = differences(provenance["machine"], machine(), "machine.")
  recorded_data = provenance.get("data")
  if recorded_data is None:
    return why + ["data: the record has no hashes of its input files"]
  return why + differences(
      recorded_data,
      {path: data_hash(path) if os.path.exists(path) else "<missing>" for path in recorded_data},
      "data ",
  )


def _define_flags() -> dict[str, flags.FlagHolder]:
  """The command line's flags, defined only when run as a script (other front ends that import
  this module define flags of the same names, e.g. --workdir)."""
  return dict(
      record=flags.DEFINE_string("record", None, "Table name: record its sweep in --workdir."),
      write=flags.DEFINE_string("write", None, "Markdown file whose marked tables to render."),
      check=flags.DEFINE_string("check", None, "Markdown file whose marked tables to check."),
      reproduce=flags.DEFINE_string(
          "reproduce", None, "Table name: rerun the first seed of its first row."
      ),
      preview=flags.DEFINE_string(
          "preview",
          None,
          "Table name: render the table of its sweep in --workdir without recording it (e.g. a "
          "rerun of the sweep on another machine, to compare with the recorded table).",
      ),
      references=flags.DEFINE_string(
          "references",
          None,
          "Table name: score its spec's reference readers into its record (from the data alone).",
      ),
      rerun=flags.DEFINE_string(
          "rerun",
          None,
          "Table name: add the finished runs of its sweep in --workdir (a rerun on another "
          "machine or instruction set) to its record's reruns.",
      ),
      workdir=flags.DEFINE_string(
          "workdir",
          None,
          "--record, --preview, --rerun: the sweep's workdir; --reproduce: where to rerun "
          "(default: a temporary directory).",
      ),
      stamp=flags.DEFINE_bool(
          "stamp",
          False,
          "--reproduce: add a passing reproduction (date, commit, machine, data hashes, exact or "
          "not) to the record's provenance.",
      ),
      tolerance=flags.DEFINE_float(
          "tolerance",
          None,
          "--reproduce: accepted |difference| (default: 0 on the recording machine, else the "
          "spec's).",
      ),
      list=flags.DEFINE_bool("list", False, "List the table specs and their records."),
  )


@exit_on_user_error
def run(argv: Sequence[str], f: Mapping[str, Any]) -> int:
  """The command line's work on the parsed flag values `f`; returns the exit status."""
  if len(argv) > 1:
    raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  modes = ("record", "preview", "rerun", "references", "write", "check", "reproduce", "list")
  if len([m for m in modes if f.get(m)]) != 1:
    raise UserError("give exactly one of " + ", ".join(f"--{m}" for m in modes))
  if f["list"]:
    for name in table_names():
      has = "recorded" if os.path.exists(record_path(name)) else "no record"
      print(f"{name:<24} results/{name}.py  ({has})")
    return 0
  if f["record"]:
    if not f["workdir"]:
      raise UserError("--record needs --workdir, the directory the sweep ran in")
    spec = load_table(f["record"])
    print(f"Wrote {os.path.relpath(write_record(spec, f['workdir']), REPO_ROOT)}")
    print(render(spec, read_record(spec.name)))
    return 0
  if f.get("preview"):
    if not f["workdir"]:
      raise UserError("--preview needs --workdir, the directory the sweep ran in")
    spec = load_table(f["preview"])
    print(render(spec, make_record(spec, f["workdir"])))
    return 0
  if f.get("references"):
    spec = load_table(f["references"])
    if not spec.references:
      raise UserError(f"results/{spec.name}.py: TABLE has no 'references' to score")
    print(f"Wrote {os.path.relpath(add_references(spec), REPO_ROOT)}")
    print(render(spec, read_record(spec.name)))
    return 0
  if f.get("rerun"):
    if not f["workdir"]:
      raise UserError("--rerun needs --workdir, the directory the rerun's sweep ran in")
    spec = load_table(f["rerun"])
    print(f"Wrote {os.path.relpath(add_rerun(spec, f['workdir']), REPO_ROOT)}")
    print(render(spec, read_record(spec.name)))
    return 0
  if f["write"]:
    names = write_doc(f["write"])
    print(f"Rendered {len(names)} table(s) in {f['write']}: {', '.join(names)}")
    return 0
  if f["check"]:
    problems = check_doc(f["check"])
    for problem in problems:
      print(problem)
    if not problems:
      print(f"Every marked table of {f['check']} matches its record.")
    return 1 if problems else 0
  spec = load_table(f["reproduce"])
  ok, lines = reproduce(
      spec, read_record(spec.name), f["workdir"], f["tolerance"], stamp=bool(f.get("stamp"))
  )
  print("\n".join(lines))
  return 0 if ok else 1


if __name__ == "__main__":
  _FLAGS = _define_flags()
  app.run(lambda argv: sys.exit(run(argv, {k: v.value for k, v in _FLAGS.items()})))
