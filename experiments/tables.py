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
                                      # a shortcut's reader, chance), `function(config, base_dir)`
                                      # -> {name: report-shaped dict} from a run's config.json.
      cross_validation=("data.fold", "pkg.module:function"),  # Optional: a pair_by key whose
                                      # values are folds sharing training data, and
                                      # `function(config, base_dir)` -> {"train", "validation",
                                      # "test": examples} of a fold: the corrected interval's
                                      # test-to-train ratio (stats.corrected_interval).
      tuning=(("a", 4, "what was searched, where"), ("*", 3, "...")),  # Optional: per row (or
                                      # "*", every row) the settings tried on validation before
                                      # these runs; printed under the table.
      selection_leaks=(dict(rows=("a",), why="..."),),  # Optional: a choice behind the runs
                                      # of these rows (rows=None: every row) that read data the
                                      # table reports on; every verdict on them is marked.
  )

A path is dotted into report.json; a path that ends at numbers nested in mappings or lists (per
layer, per block, per batch) is the mean of them all. The record (`results/records/NAME.json`, under version
control) holds every run's values of every column and claim, its sample sizes and command, and
the provenance (commit, date, machine, JAX version, seeds, commands), so a table is rendered
from the record alone (a record value that is not a finite number or null, a run without its
row or metrics, a row and seed twice: one error naming the run). Specs share run names, so
`--record`, `--rerun` and `--preview` take a finished run only where its own `sweep_run.json`
(else `config.json`) holds what the spec gives it. `--write` replaces what lies between
`<!-- table:NAME -->` and `<!-- /table:NAME -->` in a markdown file (the document a symbolic
link points to, keeping the link), and `--check` renders again and compares. Each
table has, per row, the mean and 95% Student-t interval of every column over the seeds, then per
claim the mean paired difference (same seed) with its interval and the verdict
(experiments/stats.py), then the flags (too few seeds, a split or group too small), then the
provenance. The spec's reference readers are scored when the record is made, from the data the
runs read, and printed as rows in italics below the models' (one value each: no seeds).

A claim on a fairness metric (PQD, DP, EOpp, EOdds of an attribute, their MF means, an
intersection's) is decided only where both rows' accuracy interval on the same split lies above
the best accuracy of the reference rows that read no signal (the upper end of chance's 95%
range, the majority class, a shortcut's reader): otherwise it is `stats.UNTESTABLE`, since a
model that has learnt nothing is fair by PQD. A table's claims are one family: each verdict is
printed beside its Holm-adjusted one (`stats.holm`). A fairness claim's difference is also
given at matched accuracy (`matched_accuracy`). Runs paired by cross-validation folds
(`cross_validation`) get the corrected resampled t-interval, in cells and claims alike; the
caption names the interval used.

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

import numpy as np
from absl import app, flags

from experiments import stats
from experiments.collect import RunResult, collect, is_number, lookup
from experiments.markers import marked_tables, replace_tables
from experiments.provenance import data_hash, data_hashes, differences, machine, source_state
from experiments.spec import (
    LOG,
    REPO_ROOT,
    REPORT,
    RUN,
    RUN_PROVENANCE,
    format_value,
    grid_points,
    load_sweep_file,
    resolved_config,
    run_command,
    run_record,
)
from experiments.supervise import _sigterm_as_interrupt, _terminate, failure_line
from trainkit.distributed import child_environment
from trainkit.errors import UserError, exit_on_user_error
from trainkit.metric_writers import write_atomically
from trainkit.workdir import CONFIG_FILE, config_differences, move_aside, trained_config_differences

RESULTS_DIR = os.path.join(REPO_ROOT, "results")
RECORDS_DIR = os.path.join(RESULTS_DIR, "records")
SEED_KEY = "seed"
DEFAULT_TOLERANCE = 0.02
# The last part of a fairness metric's path (fairmoe_jax.metrics.METRIC_NAMES), and of a path
# whose value the predictions alone decide (with a split's counts): what a rerun must change
# to be evidence of anything (`compare_rerun`).
FAIRNESS_KEYS = ("pqd", "dp", "eopp", "eodds")
PREDICTION_KEYS = ("accuracy", *FAIRNESS_KEYS, "bleu")
# A reference row whose reader reads the task's signal (the testbed's tint reader): what
# learning reaches, not what a model that learnt nothing scores, so it sets no accuracy bar.
SIGNAL_ROLE = "signal"
EVERY_ROW = "*"

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
class Tuning:
  """What was searched on validation before a table's runs: `settings` tried for `row` (a row
  value, or EVERY_ROW for a setting all rows share), and what and where."""

  row: str
  settings: int
  what: str


@dataclasses.dataclass(frozen=True)
class SelectionLeak:
  """A choice behind a table's runs that read data the table reports on: every verdict on a
  claim that compares one of `rows` (None: every row) is marked."""

  rows: tuple[str, ...] | None
  why: str

  def affects(self, claim: Claim) -> bool:
    return self.rows is None or claim.row in self.rows or claim.baseline in self.rows


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
  cross_validation: tuple[str, str] | None = None
  tuning: tuple[Tuning, ...] = ()
  selection_leaks: tuple[SelectionLeak, ...] = ()

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
  if name in SUMMARIES:
    raise UserError(
        f"results/{name}.py: '{name}' is reserved, the name of a generated summary "
        f"(<!-- table:{name} -->); give the table another name"
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
      "cross_validation",
      "tuning",
      "selection_leaks",
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
  paths = [c.path for c in columns] + [c.metric for c in claims]
  for i, claim in enumerate(claims):
    accuracy = accuracy_path(claim.metric)
    if accuracy is not None and accuracy not in paths:
      raise _spec_error(
          name,
          f"claims[{i}]",
          f"{claim.metric!r} is a fairness metric; deciding it needs the accuracy on its split, "
          f"{accuracy!r}, as a column or a claim",
      )
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
      tolerance=_check_tolerance(name, table.get("tolerance", DEFAULT_TOLERANCE)),
      select=_check_select(name, table.get("select"), columns),
      select_within=_check_select_within(name, table, columns),
      references=_check_references(name, table.get("references")),
      pair_by=pair_by,
      pool=_check_pool(name, table.get("pool"), pair_by),
      cross_validation=_check_cross_validation(name, table.get("cross_validation"), pair_by),
      tuning=_check_tuning(name, table.get("tuning"), texts),
      selection_leaks=_check_leaks(name, table.get("selection_leaks"), texts),
  )


def _check_tolerance(name: str, value: Any) -> float:
  # NaN would fail every comparison (identical values "do not reproduce") and inf would pass
  # every one: neither is a tolerance.
  if isinstance(value, bool) or not is_number(value) or value < 0:
    raise _spec_error(name, "tolerance", f"{value!r} is not a finite number >= 0")
  return float(value)


def accuracy_path(metric: str) -> str | None:
  """The accuracy a claim on `metric` must be read against when `metric` is a fairness metric
  (its last part one of FAIRNESS_KEYS): the same split's, `validation.accuracy` for a
  validation metric, else `accuracy`; None for any other metric."""
  parts = metric.split(".")
  if parts[-1] not in FAIRNESS_KEYS:
    return None
  return "validation.accuracy" if parts[0] == "validation" else "accuracy"


def _check_cross_validation(
    name: str, value: Any, pair_by: tuple[str, ...]
) -> tuple[str, str] | None:
  if value is None:
    return None
  if (
      not isinstance(value, (tuple, list))
      or len(value) != 2
      or value[0] not in pair_by
      or value[0] == SEED_KEY
      or not re.fullmatch(r"[\w.]+:\w+", str(value[1]))
  ):
    raise _spec_error(
        name,
        "cross_validation",
        f"{value!r} is not (a pair_by key other than seed, 'package.module:function')",
    )
  return str(value[0]), str(value[1])


def _check_tuning(name: str, value: Any, rows: list[str]) -> tuple[Tuning, ...]:
  tuning = []
  for i, entry in enumerate(value or ()):
    if (
        not isinstance(entry, (tuple, list))
        or len(entry) != 3
        or entry[0] not in (*rows, EVERY_ROW)
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
        or entry[1] < 0
        or not isinstance(entry[2], str)
    ):
      raise _spec_error(
          name,
          f"tuning[{i}]",
          f"{entry!r} is not (a row or {EVERY_ROW!r}, settings tried (an int >= 0), what)",
      )
    tuning.append(Tuning(entry[0], entry[1], entry[2]))
  return tuple(tuning)


def _check_leaks(name: str, value: Any, rows: list[str]) -> tuple[SelectionLeak, ...]:
  leaks = []
  for i, entry in enumerate(value or ()):
    if not isinstance(entry, Mapping) or set(entry) != {"rows", "why"}:
      raise _spec_error(name, f"selection_leaks[{i}]", "must be dict(rows=, why=)")
    affected = entry["rows"]
    if affected is not None and (
        isinstance(affected, str) or not all(r in rows for r in affected)
    ):
      raise _spec_error(
          name, f"selection_leaks[{i}]", f"rows {affected!r} must be None or rows of {rows}"
      )
    leaks.append(SelectionLeak(None if affected is None else tuple(affected), str(entry["why"])))
  return tuple(leaks)


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


def _data_by_part(spec: TableSpec, over: str | None) -> dict[Any, dict[str, Any]]:
  """The config of the data each value of `over` (a fold key; None: the one data) gives the
  runs, from the first run of each row (`experiments.spec.resolved_config`): {value: config}."""
  firsts = {}
  for point in grid_points(spec.sweep):
    firsts.setdefault((format_value(point[spec.rows]), point.get(over)), point)
  data: dict[Any, dict[str, Any]] = {}
  for (_, part), point in firsts.items():
    config = resolved_config(spec.sweep, point).to_dict()
    data.setdefault(part, {}).setdefault(json.dumps(config["data"], sort_keys=True), config)
  if any(len(configs) > 1 for configs in data.values()):
    raise _spec_error(spec.name, "references", "its rows read different data; one is needed")
  return {part: next(iter(configs.values())) for part, configs in data.items()}


def reference_rows(spec: TableSpec) -> list[dict[str, Any]]:
  """The spec's reference readers scored on the data its runs read (the config the sweep gives
  each row's first run, as `experiments.spec.resolved_config` builds it): [{"name", "metrics":
  {path: value}}] for the paths the record keeps. A pooled table's readers are scored on each
  value of the pooled key (each fold's data) and their values averaged, as its runs' rows are.

  A reader whose report has `"draws"` (chance: one report per seeded draw) also gets "ranges":
  {path: [2.5%, 97.5%] quantiles} of its draws, each draw first averaged over the folds as the
  rows' cells are, and "draws", their number; a reader that reads the task's signal keeps its
  `"role"` (it sets no accuracy bar, `accuracy_bar`)."""
  read = _import(spec, "references", spec.references)
  over = spec.pool[1] if spec.pool else None
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
  """The mean and 95% range over draws of each path, each draw's value the mean over the parts
  (folds) of that draw, as a row's cell is the mean over its folds: {"metrics", "ranges",
  "draws"}. A path some draw lacks has neither."""
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
  """{fold value: {"train", "validation", "test": examples}} of a cross-validated spec's folds,
  from the data alone (the spec's `cross_validation` function on each fold's config)."""
  fold, target = spec.cross_validation
  sizes = _import(spec, "cross_validation", target)
  return {
      format_value(part): dict(sizes(config, REPO_ROOT))
      for part, config in _data_by_part(spec, fold).items()
  }


def fold_ratio(spec: TableSpec, record: Mapping[str, Any]) -> float | None:
  """The folds' mean test-to-train size ratio of a cross-validated table (None for a table of
  independent seeds): the corrected interval's n_test / n_train."""
  if not spec.cross_validation:
    return None
  sizes = record.get("split_sizes")
  if not sizes:
    raise UserError(
        f"table {spec.name}: its record has no split_sizes, which the corrected interval of its "
        f"folds needs; add them with `python -m experiments.tables --references={spec.name}`"
    )
  ratios = [s["test"] / s["train"] for s in sizes.values()]
  return math.fsum(ratios) / len(ratios)


def add_references(spec: TableSpec) -> str:
  """Scores the spec's reference readers into its existing record (whose runs need not exist
  any more: the readers read only the data), with a cross-validated table's split sizes."""
  record = read_record(spec.name)
  record["references"] = reference_rows(spec)
  if spec.cross_validation:
    record["split_sizes"] = split_sizes(spec)
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


def _check_started_by_spec(spec: TableSpec, workdir: str, result: RunResult) -> None:
  """A UserError unless the finished run `result` is the run of `spec`'s sweep of that name.

  Specs share run names (the GCN and vanilla-attention tuning tables; `fair_cv_celeba` and
  `_smiling`), so a directory's name says nothing about which sweep trained it: what the run
  was started with (`sweep_run.json`) and the config it trained with (`config.json`) are
  compared with what the spec gives that run, as a sweep compares a finished run before
  reusing it (`experiments.supervise.record_differences`)."""
  directory = result.run_dir
  started, trained = os.path.join(directory, RUN), os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(started) and not os.path.isfile(trained):
    raise UserError(
        f"{workdir}: run {result.name} has neither {RUN} nor {CONFIG_FILE}, so nothing shows it "
        f"was started by the sweep of {spec.path}; record only a workdir that sweep ran in"
    )
  changed: list[str] = []
  if os.path.isfile(started):
    try:
      with open(started) as f:
        changed = config_differences(json.load(f), run_record(spec.sweep, result.point))
    except (OSError, ValueError) as e:
      changed = [f"{RUN} unreadable ({type(e).__name__})"]
  if not changed and os.path.isfile(trained):
    changed = trained_config_differences(directory, resolved_config(spec.sweep, result.point))
  if changed:
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    raise UserError(
        f"{workdir}: run {result.name} is not the run of table {spec.name}'s sweep "
        f"({spec.path}) of that name: {changed[0]}{more} (what the run was started or trained "
        "with -> what the spec gives it). Is this the workdir of another sweep? Its numbers "
        "would become this table's"
    )


def make_record(spec: TableSpec, workdir: str) -> dict[str, Any]:
  """The record of a finished (or partly finished) sweep of `spec` in `workdir`; a UserError
  when a finished run there was started or trained with other settings than the spec gives it
  (`_check_started_by_spec`)."""
  runs = []
  dates = []
  configs = []
  results = collect(spec.sweep, workdir)  # Read once: the rows, the pooling and the provenance.
  for result in results:
    if result.status == "ok":
      _check_started_by_spec(spec, workdir, result)
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
  if spec.cross_validation:
    record["split_sizes"] = split_sizes(spec)
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
  # Every value the predictions alone decide is the record's to the last bit, in every rerun
  # run: the rerun cannot disagree with the record, so it is no evidence for its verdicts.
  identical: bool = False


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
  # The rerun is read as the record is: against its references and with its folds' sizes.
  again = summarise(spec, {**record, "runs": rerun["runs"], "reruns": []})
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
      identical=identical_predictions(spec, record, rerun),
      runs=len(rerun["runs"]),
      rows=rows,
      seeds=sorted({r["seed"] for r in rerun["runs"]}),
      claims=claims,
      chosen=chosen,
      largest_change=max(changes, key=_by_relative_change) if changes else None,
      largest_seed_change=max(seed_changes, key=_by_relative_change) if seed_changes else None,
  )


def prediction_paths(spec: TableSpec) -> list[str]:
  """The record's paths whose values the predictions alone decide (accuracy, a fairness metric,
  BLEU, a HANS heuristic's accuracy: counts of the predictions), not a loss or a routing or
  attention statistic that moves with any change of the weights."""
  return [
      p
      for p in spec.metrics()
      if p.split(".")[-1] in PREDICTION_KEYS or ".by_heuristic." in f".{p}"
  ]


def identical_predictions(
    spec: TableSpec, record: Mapping[str, Any], rerun: Mapping[str, Any]
) -> bool:
  """Whether every rerun run reproduces, to the last bit, every value its predictions decide
  (`prediction_paths`) and the split and group sizes, of the recorded run of the same row and
  pair. The record keeps no predictions, so this is the check a record allows; it holds when the
  predictions are identical (docs/results.md gives the command that compares them)."""
  paths = prediction_paths(spec)
  if not paths or not rerun["runs"]:
    return False
  recorded = {(r["row"], r["seed"]): r for r in record["runs"] if r["status"] == "ok"}
  for run in rerun["runs"]:
    before = recorded.get((run["row"], run["seed"]))
    if before is None:
      return False
    if any(before["metrics"].get(p) != run["metrics"].get(p) for p in paths):
      return False
    if before.get("examples") != run.get("examples") or before.get("groups") != run.get("groups"):
      return False
  return True


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
  # The spec's runs, not the record's: a record that lost a run would read "12 of 11 runs".
  total = len(grid_points(spec.sweep))
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
    if result.identical:
      text += (
          f"**{IDENTICAL}**: every value its predictions decide "
          f"({', '.join(labels.get(p, (p, 3))[0] for p in prediction_paths(spec))}, and every "
          f"split and group size) is the record's to the last bit in each of its {result.runs} "
          "runs, so it cannot disagree with the record and is no evidence for its verdicts: "
          "none is counted as kept"
      )
    elif not result.claims:
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


# The reserved names of the generated summaries (`<!-- table:NAME -->` in a document): every
# table's reruns, every table's verdict counts, and every claim's verdicts across tables. No
# spec may take them.
RERUN_SUMMARY = "reruns"
VERDICT_SUMMARY = "verdicts"
CLAIM_SUMMARY = "claims"
SUMMARIES = (RERUN_SUMMARY, VERDICT_SUMMARY, CLAIM_SUMMARY)
IDENTICAL = "identical (not independent)"


def _rerun_machine(provenance: Mapping[str, Any]) -> str:
  """What tells a rerun's machine apart, briefly: its XLA_FLAGS, else its processor."""
  m = provenance["machine"]
  flags = _xla_flags(m)
  if flags:
    return f"`XLA_FLAGS={flags}`"
  return m.get("processor", {}).get("model") or m["device"]


def _claims_tables() -> list[tuple[str, TableSpec, dict[str, Any]]]:
  """(name, spec, record) of every recorded table that decides claims, in name order."""
  found = []
  for name in table_names():
    if name in SUMMARIES or not os.path.exists(record_path(name)):
      continue
    spec = load_table(name)
    if spec.claims:
      found.append((name, spec, read_record(name)))
  return found


def rerun_summary() -> str:
  """One row per rerun of every table that decides claims (or "not rerun"): how much of the
  table it reran, on what, which verdicts and tuning choice it keeps and which it changes, and
  the largest change of a mean paired difference; a rerun whose predictions are the record's is
  "identical (not independent)" and counts no verdict. The last row adds up the reruns that
  could differ. Rendered from the records alone."""
  header = (
      "table",
      "rerun",
      "verdicts kept",
      "verdicts that change (recorded -> rerun)",
      "largest change of a mean paired difference, in half-widths of its interval (change)",
  )
  rows = []
  counted = identical = claims_rerun = claims_kept = 0
  for name, spec, record in _claims_tables():
    if not record.get("reruns"):
      rows.append((f"`{name}`", "not rerun", "—", "—", "—"))
      continue
    labels = {c.path: (c.label, c.decimals) for c in spec.columns}
    total = len(grid_points(spec.sweep))  # The spec's runs (as in `_rerun_lines`).
    for rerun in record["reruns"]:
      result = compare_rerun(spec, record, rerun)
      how_much = "every run" if result.runs == total else f"{result.runs} of {total} runs"
      kept = sum(before == after for _, before, after, _ in result.claims)
      if result.identical:
        identical += 1
        kept_text = f"{IDENTICAL}: not counted"
      elif not result.claims:
        kept_text = "— (no claim has both its rows rerun)"
      else:
        counted += 1
        claims_rerun += len(result.claims)
        claims_kept += kept
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
  rows.append(
      (
          "**every table**",
          f"{counted + identical} reruns; {identical} {IDENTICAL}",
          f"**{claims_kept} of {claims_rerun}** (the {counted} reruns that could differ)",
          "—",
          "—",
      )
  )
  return "\n".join(_markdown_table(header, rows)) + "\n"


_VERDICTS = (stats.HOLDS, stats.DOES_NOT_HOLD, stats.UNDECIDED, stats.UNTESTABLE)


def _counts_text(verdicts: Sequence[str]) -> list[str]:
  return [str(sum(v == word for v in verdicts)) for word in _VERDICTS]


def verdict_summary() -> str:
  """Per table that decides claims: the interval it uses, its family of claims, how many
  verdicts are each word before and after Holm's adjustment, how many carry a selection leak;
  then the totals. Rendered from the records alone."""
  header = [
      "table",
      "interval",
      "claims (one family)",
      *(f"raw: {word}" for word in _VERDICTS),
      *(f"Holm: {word}" for word in _VERDICTS),
      "marked selection leak",
  ]
  rows = []
  raw_all: list[str] = []
  holm_all: list[str] = []
  leaked_all = 0
  for name, spec, record in _claims_tables():
    summary = summarise(spec, record)
    raw = [result.verdict for _, result in summary["claims"]]
    holm = [verdict for _, verdict in summary["holm"]]
    leaked = sum(1 for claim, _ in summary["claims"] if leaks_of(spec, claim))
    raw_all += raw
    holm_all += holm
    leaked_all += leaked
    kind = "Student-t" if summary["ratio"] is None else "corrected resampled t"
    rows.append(
        [f"`{name}`", kind, str(len(raw)), *_counts_text(raw), *_counts_text(holm), str(leaked)]
    )
  rows.append(
      [
          "**every table**",
          "—",
          f"**{len(raw_all)}**",
          *(f"**{c}**" for c in _counts_text(raw_all)),
          *(f"**{c}**" for c in _counts_text(holm_all)),
          f"**{leaked_all}**",
      ]
  )
  return "\n".join(_markdown_table(header, rows)) + "\n"


def claim_summary() -> str:
  """Claim by claim: each claim (the same rows, direction and metric) and, per Holm-adjusted
  verdict, the tables that reach it; a raw verdict that differs, a rerun that moved it and a
  selection leak are noted beside the table. Rendered from the records alone."""
  found: dict[tuple[str, str], dict[str, list[str]]] = {}
  for name, spec, record in _claims_tables():
    summary = summarise(spec, record)
    labels = {c.path: c.label for c in spec.columns}
    moved = {}
    for rerun in record.get("reruns", ()):
      result = compare_rerun(spec, record, rerun)
      for claim, before, after, _ in result.claims:
        if before != after:
          moved[claim] = after
    for (claim, result), (_, holm) in zip(summary["claims"], summary["holm"]):
      key = (
          f"{spec.label(claim.row)} {claim.better} than {spec.label(claim.baseline)}",
          labels.get(claim.metric, claim.metric),
      )
      notes = []
      if result.verdict != holm:
        notes.append(f"raw: {result.verdict}")
      if claim in moved:
        notes.append(f"a rerun: {moved[claim]}")
      if leaks_of(spec, claim):
        notes.append("selection leak")
      if not result.enough_seeds:
        notes.append("too few seeds")
      entry = f"`{name}`" + (f" ({'; '.join(notes)})" if notes else "")
      found.setdefault(key, {}).setdefault(holm, []).append(entry)
  header = ["claim", "on", *(f"Holm: {word}" for word in _VERDICTS)]
  rows = [
      [claim, metric, *(", ".join(by_verdict.get(word, [])) or "—" for word in _VERDICTS)]
      for (claim, metric), by_verdict in found.items()
  ]
  return "\n".join(_markdown_table(header, rows)) + "\n"


def _render_marked(name: str) -> str:
  """A marked table of a document: a generated summary, or the table `name` from its record."""
  if name == RERUN_SUMMARY:
    return rerun_summary()
  if name == VERDICT_SUMMARY:
    return verdict_summary()
  if name == CLAIM_SUMMARY:
    return claim_summary()
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
  _check_runs(f"{where}: table {name}", record["runs"], "runs", name)
  for i, rerun in enumerate(record.get("reruns") or ()):
    runs = rerun.get("runs") if isinstance(rerun, dict) else None
    _check_runs(f"{where}: table {name}", runs, f"reruns[{i}].runs", name)
  if record.get("pooled") is not None:
    _check_runs(f"{where}: table {name}", record["pooled"], "pooled", name, status=False)
  for reference in record.get("references") or ():
    for path, value in ((reference or {}).get("metrics") or {}).items():
      if value is not None and not is_number(value):
        raise UserError(
            f"{where}: table {name}: reference {reference.get('name')!r}: {path} is {value!r}, "
            "not a finite number or null (remake it with --references=" + name + ")"
        )
  return record


def _run_text(index_name: str, run: Mapping[str, Any]) -> str:
  """A record's run as an error names it: `runs[3] (row a, seed 0)`, with what it has."""
  known = [f"row {run['row']}"] if "row" in run else []
  known += [f"seed {_unit_text(run['seed'])}"] if "seed" in run else []
  return index_name + (f" ({', '.join(known)})" if known else "")


def _check_runs(where: str, runs: Any, what: str, name: str, status: bool = True) -> None:
  """A UserError naming the run, unless every run of a record's list `what` names its row and
  pair (and status), a finished one has `metrics` of finite numbers or null, and no (row, pair)
  comes twice. Rendering reads each of these without looking: a missing key was a KeyError
  traceback, a duplicate silently replaced the other's value (and could flip a tuning choice),
  and a NaN turned every claim on it into "does not hold"."""
  remake = f"(remake the record with --record={name})"
  if not isinstance(runs, list):
    raise UserError(f"{where}: {what} is not a list of runs {remake}")
  seen: dict[str, str] = {}
  for i, run in enumerate(runs):
    index_name = f"{what}[{i}]"
    if not isinstance(run, dict):
      raise UserError(f"{where}: {index_name} is not a run (a JSON object) {remake}")
    text = _run_text(index_name, run)
    for key in ("row", "seed", "status") if status else ("row", "seed"):
      if key not in run:
        raise UserError(f"{where}: {text} has no {key!r} {remake}")
    if not status or run["status"] == "ok":
      metrics = run.get("metrics")
      if not isinstance(metrics, dict):
        raise UserError(f"{where}: {text} has a result but no 'metrics' {remake}")
      for path, value in metrics.items():
        if value is not None and not is_number(value):
          # Not rendered as "nan": a claim on it cannot be decided, and the record holds
          # only what a report gave as a finite number (`metric_value`), so it was edited.
          raise UserError(
              f"{where}: {text}: {path} is {value!r}, not a finite number or null, so no cell "
              f"or claim on it can be computed {remake}"
          )
    key = json.dumps([run["row"], run["seed"]])
    if key in seen:
      raise UserError(
          f"{where}: {seen[key]} and {text} are the same run (the same row and seed): one "
          f"value would silently replace the other {remake}"
      )
    seen[key] = text


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


def accuracy_bar(record: Mapping[str, Any], path: str) -> tuple[float, str] | None:
  """The accuracy (at `path`) a fairness claim's rows must lie above, and the reference that
  sets it: the highest over the record's reference rows that read no signal, each at the upper
  end of its 95% range where it has one (chance) and at its value otherwise. None without one."""
  bars = []
  for reference in record.get("references", ()):
    if reference.get("role") == SIGNAL_ROLE:
      continue
    value = (reference.get("ranges") or {}).get(path, [None, None])[1]
    if value is None:
      value = reference["metrics"].get(path)
    if value is not None:
      bars.append((value, reference["name"]))
  return max(bars) if bars else None


@dataclasses.dataclass(frozen=True)
class Gate:
  """Why a fairness claim was or was not decided: the accuracy path, the bar and its reference
  (None: no reference has that accuracy), and whether both rows' intervals lie above it."""

  accuracy: str
  bar: tuple[float, str] | None
  above: bool


def _within(values: list[tuple[Any, Any, float]], sweeps: int = 50) -> list[float]:
  """`values` [(row, unit, x)] with each row's and each pairing unit's mean removed (two-way
  demeaning by alternating projections: exact after one sweep when every row has every unit,
  converging otherwise)."""
  x = [v for _, _, v in values]
  for _ in range(sweeps):
    for key in (0, 1):
      groups: dict[Any, list[int]] = {}
      for i, entry in enumerate(values):
        groups.setdefault(entry[key], []).append(i)
      for members in groups.values():
        mean = math.fsum(x[i] for i in members) / len(members)
        for i in members:
          x[i] -= mean
  return x


def matched_accuracy(
    spec: TableSpec, record: Mapping[str, Any], claim: Claim, ratio: float | None
) -> tuple[stats.Interval, float] | None:
  """A fairness claim's paired difference at matched accuracy, and the slope it uses: each
  pair's difference minus beta times the pair's accuracy difference, beta the least-squares
  slope of the metric on the accuracy (same split) over every run of the table with each row's
  and each pairing unit's means removed. So beta is how the metric moves with the accuracy
  when the same method lands higher or lower on the same seed's or fold's luck, not a
  difference between methods, nor what a seed or fold does to every method. Under that linear
  trade-off, it is the difference the two rows would show at the same accuracy. None where the
  data do not allow it: fewer than two pairs, or no such spread of accuracy."""
  accuracy = accuracy_path(claim.metric)
  runs = [
      (r["row"], r["seed"], r["metrics"].get(claim.metric), r["metrics"].get(accuracy))
      for r in record["runs"]
      if r["status"] == "ok"
  ]
  runs = [(row, unit, f, a) for row, unit, f, a in runs if f is not None and a is not None]
  fairness = _within([(row, unit, f) for row, unit, f, _ in runs])
  accuracies = _within([(row, unit, a) for row, unit, _, a in runs])
  den = math.fsum(a * a for a in accuracies)
  if den <= 1e-24:
    return None
  slope = math.fsum(f * a for f, a in zip(fairness, accuracies)) / den
  units, differences = stats.paired(
      _values(record, claim.row, claim.metric), _values(record, claim.baseline, claim.metric)
  )
  accuracy_units, accuracy_gaps = stats.paired(
      _values(record, claim.row, accuracy), _values(record, claim.baseline, accuracy)
  )
  if units != accuracy_units or len(units) < 2:
    return None
  adjusted = [f - slope * a for f, a in zip(differences, accuracy_gaps)]
  return stats.interval(adjusted, ratio), slope


def summarise(spec: TableSpec, record: Mapping[str, Any]) -> dict[str, Any]:
  """Per row and column the interval over seeds (or folds), per claim its decision (the
  fairness claims gated by the reference accuracy), its Holm-adjusted verdict, a fairness
  claim's difference at matched accuracy, and the flags."""
  ratio = fold_ratio(spec, record)
  rows = {}
  for value in spec.row_values:
    row = format_value(value)
    rows[row] = {
        "seeds": sorted(
            {r["seed"] for r in record["runs"] if r["row"] == row and r["status"] == "ok"}
        ),
        "cells": {
            c.path: (
                stats.interval(list(v.values()), ratio)
                if (v := _values(record, row, c.path))
                else None
            )
            for c in spec.columns
        },
    }
  claims = []
  gates: list[Gate | None] = []
  matched: list[tuple[stats.Interval, float] | None] = []
  for claim in spec.claims:
    result = stats.decide(
        _values(record, claim.row, claim.metric),
        _values(record, claim.baseline, claim.metric),
        claim.better,
        test_to_train=ratio,
    )
    accuracy = accuracy_path(claim.metric)
    gate = None
    if accuracy is not None:
      bar = accuracy_bar(record, accuracy)
      intervals = [
          stats.interval(list(v.values()), ratio) if (v := _values(record, r, accuracy)) else None
          for r in (claim.row, claim.baseline)
      ]
      above = bar is not None and all(
          i is not None and i.low is not None and i.low > bar[0] for i in intervals
      )
      gate = Gate(accuracy, bar, above)
      if not above:  # Not decided, whatever its interval says: see the module docstring.
        result = dataclasses.replace(result, verdict=stats.UNTESTABLE)
    claims.append((claim, result))
    gates.append(gate)
    matched.append(matched_accuracy(spec, record, claim, ratio) if accuracy else None)
  # The family is every claim of the table, an untested one included (stats.holm).
  adjusted = stats.holm(
      [None if result.verdict == stats.UNTESTABLE else result.p for _, result in claims]
  )
  holm = [
      (
          p,
          stats.UNTESTABLE
          if p is None
          else stats.verdict_at(result.difference.mean, p, claim.better)
          if result.difference
          else stats.UNDECIDED,
      )
      for (claim, result), p in zip(claims, adjusted)
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
  recorded = {(r["row"], r["seed"]) for r in record["runs"]}
  absent: dict[str, list[str]] = {}
  for point in grid_points(spec.sweep):
    if (format_value(point[spec.rows]), spec.pair(point)) not in recorded:
      absent.setdefault(spec.label(format_value(point[spec.rows])), []).append(
          _unit_text(spec.pair(point))
      )
  if absent:  # Named, not counted away: `--check` says the record is stale too.
    listed = "; ".join(f"{row} seeds {', '.join(seeds)}" for row, seeds in absent.items())
    flags.append(f"runs of the spec not in the record: {listed}")
  if any(gate is not None and gate.bar is None for gate in gates):
    flags.append(
        "a fairness claim needs a reference accuracy to be decided against (a reference row "
        "with the accuracy of its split); this table has none, so its fairness claims are "
        "untestable"
    )
  return {
      "rows": rows,
      "claims": claims,
      "holm": holm,
      "gates": gates,
      "matched": matched,
      "ratio": ratio,
      "flags": flags,
  }


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


def interval_name(ratio: float | None) -> str:
  """The interval a table's cells and claims use, as its caption names it."""
  confidence = round(100 * stats.CONFIDENCE)
  if ratio is None:
    return f"{confidence}% Student-t interval"
  return (
      f"{confidence}% Nadeau–Bengio corrected resampled t-interval, test-to-train {ratio:.3f}"
  )


def _p_text(p: float) -> str:
  return "<0.001" if p < 0.001 else f"{p:.3f}"


def _reference_cell(reference: Mapping[str, Any], c: Column) -> str:
  """A reference's value, with its 95% range where it has one (chance, by simulation)."""
  value = reference["metrics"].get(c.path)
  if value is None:
    return "—"
  text = f"{c.scale * value:.{c.decimals}f}"
  low_high = (reference.get("ranges") or {}).get(c.path)
  if low_high:
    low, high = low_high
    text += f" [{c.scale * low:.{c.decimals}f}, {c.scale * high:.{c.decimals}f}]"
  return text.replace("-", "−")


def _reader(name: str) -> str:
  """A reference row's reader without the folds it was averaged over."""
  return re.sub(r", mean over \d+ \w+$", "", name)


def leaks_of(spec: TableSpec, claim: Claim) -> list[int]:
  """The indices of the spec's selection leaks that touch a claim's rows."""
  return [i for i, leak in enumerate(spec.selection_leaks) if leak.affects(claim)]


def _claims_notes(spec: TableSpec, summary: Mapping[str, Any]) -> list[str]:
  """The paragraphs under a claims table: how a fairness claim was gated and matched, the
  family, the intervals of folds, the tuning budgets and the selection leaks."""
  columns = {c.path: c for c in spec.columns}

  def column(path: str) -> Column:
    return columns.get(path) or Column(path, path, 1.0, 3)

  notes = []
  gates = [(claim, gate) for (claim, _), gate in zip(summary["claims"], summary["gates"]) if gate]
  if gates:
    bars = {}
    for _, gate in gates:
      if gate.bar is not None:
        bars[gate.accuracy] = gate.bar
    bar_text = "; ".join(
        f"{column(path).label} {column(path).scale * value:.{column(path).decimals}f} "
        f"({_reader(name)})"
        for path, (value, name) in bars.items()
    )
    untestable = sum(1 for _, gate in gates if not gate.above)
    notes.append(
        "**Fairness claims need a model that learnt** (docs/protocol.md, section 3): a claim "
        "on a fairness metric is decided only where both rows' accuracy interval on its split "
        "lies above the best accuracy of a reference that reads no signal (chance at the upper "
        "end of its 95% range)"
        + (f": {bar_text}" if bar_text else "")
        + f". {untestable} of the table's {len(gates)} fairness claims are "
        f"**{stats.UNTESTABLE}**."
    )
    slopes = {}
    for (claim, _), found in zip(summary["claims"], summary["matched"]):
      if found is not None:
        slopes[(claim.metric, accuracy_path(claim.metric))] = found[1]
    if slopes:
      # Per unit of the accuracy as printed (a point where it is in percent).
      slope_text = "; ".join(
          f"{column(metric).label} on {column(accuracy).label}: "
          + f"{slope / column(accuracy).scale * column(metric).scale:+.4f}".replace("-", "−")
          + f" per unit of {column(accuracy).label}"
          for (metric, accuracy), slope in slopes.items()
      )
      notes.append(
          "**At matched accuracy**: each fairness claim's paired differences minus the slope "
          "times the pair's accuracy difference on the same split, the slope that of the metric "
          "on the accuracy over every run of the table with each row's and each pair's means "
          "removed (" + slope_text + "): the difference the two rows would show at equal "
          "accuracy under that one linear trade-off. The slope's own uncertainty is not in its "
          "interval, so it is reported, not decided."
      )
  notes.append(
      f"**One family**: the table's {len(summary['claims'])} claims (an untestable one counts "
      "too); the Holm-adjusted verdict is decided where Holm's adjusted p is below "
      f"{1 - stats.CONFIDENCE:.2f} (docs/protocol.md, section 3)."
  )
  if summary["ratio"] is not None:
    notes.append(
        f"**Intervals of folds**: the {_units(spec)} share training data, so every interval "
        f"here is the {interval_name(summary['ratio'])} (the folds' mean n_test / n_train, "
        "from the record's split sizes), not the Student-t interval of independent seeds."
    )
  if spec.tuning:
    notes.append(
        f"**Tuning budget** (settings tried on validation before these runs, `{spec.path}`): "
        + "; ".join(
            f"{'every row' if t.row == EVERY_ROW else spec.label(t.row)}: {t.settings}"
            + (f" ({t.what})" if t.what else "")
            for t in spec.tuning
        )
        + "."
    )
  elif spec.select:
    notes.append(
        f"**Tuning budget**: this table is the search, {len(spec.row_values)} settings on "
        f"the {spec.split} split."
    )
  for i, leak in enumerate(spec.selection_leaks):
    marked = sum(1 for claim, _ in summary["claims"] if i in leaks_of(spec, claim))
    if leak.rows is None:
      rows = "every row"
    else:
      rows = ("the row " if len(leak.rows) == 1 else "the rows ") + ", ".join(
          spec.label(r) for r in leak.rows
      )
    notes.append(
        f"**Selection leak {i + 1}** ({rows}; {marked} of the {len(summary['claims'])} verdicts "
        f"above are marked): {leak.why}"
    )
  return notes


def render(spec: TableSpec, record: Mapping[str, Any]) -> str:
  """The table's markdown, from its record alone (deterministic: `--check` compares it)."""
  summary = summarise(spec, record)
  confidence = round(100 * stats.CONFIDENCE)
  lines = [
      f"**{spec.title}** ({spec.split} split; mean [{interval_name(summary['ratio'])}] over "
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
    cells = [_reference_cell(reference, c) for c in spec.columns]
    drawn = (
        f"; mean [95% range] of {reference['draws']} seeded draws" if reference.get("draws") else ""
    )
    body.append([f"*reference: {reference['name']}{drawn}*", *cells, "—"])
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
    matched_column = any(summary["gates"])
    body = []
    for (claim, result), (holm_p, holm_verdict), found in zip(
        summary["claims"], summary["holm"], summary["matched"]
    ):
      scale, decimals, label = scales.get(claim.metric, (1.0, 3, claim.metric))
      difference = (
          _interval_text(result.difference, scale, decimals, sign=True)
          if result.difference
          else "—"
      )
      few = "" if result.enough_seeds else " (too few seeds)"
      # A verdict a rerun does not reach is marked where it is read, not only below the table.
      moved = [after for c, before, after, _ in rerun_claims if c == claim and after != before]
      notes = [f"a rerun: {', '.join(moved)}"] if moved else []
      leak = ["selection leak"] if leaks_of(spec, claim) else []
      verdict = f"**{result.verdict}{few}**" + (
          f" ({'; '.join(notes + leak)})" if notes + leak else ""
      )
      adjusted = f"**{holm_verdict}{few}**" + (
          f" ({'; '.join(([] if holm_p is None else [_p_text(holm_p)]) + leak)})"
          if holm_p is not None or leak
          else ""
      )
      cells = [
          f"{spec.label(claim.row)} {claim.better} than {spec.label(claim.baseline)}",
          label,
          difference,
          str(len(result.seeds)),
          _p_text(result.p) if result.difference else "—",
          verdict,
          adjusted,
      ]
      if matched_column:
        cells.append(
            "—" if found is None else _interval_text(found[0], scale, decimals, sign=True)
        )
      body.append(cells)
    lines += [""]
    header = [
        "claim",
        "on",
        f"paired difference [{confidence}% interval]",
        "pairs",
        "p",
        "verdict",
        "Holm-adjusted verdict (adjusted p)",
    ]
    if matched_column:
      header.append(f"at matched accuracy [{confidence}% interval]")
    lines += _markdown_table(header, body)
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
  if summary["claims"]:
    for note in _claims_notes(spec, summary):
      lines += ["", note]
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
      f"{_stamp_machine_text(r)} on {r['date']} (commit {r['commit']}; "
      f"{_machine_text(r['machine'])}; {len(r['data'])} input file(s) or folder(s) hashed); "
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


def _stamp_machine_text(stamp: Mapping[str, Any]) -> str:
  """Whether a stamped reproduction ran on the recording machine or on another (and what
  differs): an exact rerun elsewhere is evidence of another kind. Nothing for stamps made
  before they said."""
  if "differs_from_record" not in stamp:
    return ""
  differs = stamp["differs_from_record"]
  if not differs:
    return " on the recording machine, software and data"
  keys = list(dict.fromkeys(why.split(":", 1)[0] for why in differs))
  return f" on another machine, software or data (differs in {', '.join(keys)})"


def _read_doc(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read the document ({e})") from None


def write_doc(path: str) -> list[str]:
  """Renders every marked table of the markdown file `path` in place; returns their names.

  A `path` that is a symbolic link is followed: the document it points to is rewritten and the
  link kept (the atomic write's rename would otherwise replace the link with a file and leave
  the real document as it was)."""
  text = _read_doc(path)
  names = []

  def rendered(name: str) -> str:
    names.append(name)
    return _render_marked(name)

  text = replace_tables(text, path, rendered)
  write_atomically(os.path.realpath(path), text)  # Messages above name the path as given.
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
      if name not in SUMMARIES:
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
  date, commit, machine, input-data hashes, whether every value was exact, and how its machine
  differs from the record's): for a record older than its machine's full description, the
  evidence of where its numbers come back exactly.

  The rerun trains in `workdir/run`, which must be its own: an earlier run directory there is
  moved aside first, so no report.json or config.json it left can pass for this rerun's. A
  rerun that fails (non-zero exit, no report) is a UserError and nothing is compared or
  stamped. SIGTERM (or Ctrl-C) stops the rerun's process group before this returns, with
  KeyboardInterrupt."""
  first = grid_points(spec.sweep)[0]
  row, seed = format_value(first[spec.rows]), spec.pair(first)
  recorded = [r for r in record["runs"] if r["row"] == row and r["seed"] == seed]
  if not recorded or recorded[0]["status"] != "ok":
    raise UserError(f"table {spec.name}: the record has no result for {row} seed {seed}")
  provenance = record["provenance"]
  differs_from_record, voucher = comparison_basis(provenance)
  why_not_exact = [] if voucher is not None else differs_from_record
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
  if voucher is not None:  # Not the recording machine: one an exact reproduction ran on.
    where = f"the machine, software and data of the exact reproduction of {voucher['date']}"
  elif same_machine:
    where = "the recording machine, software and data"
  else:
    where = "not the recording machine, software or data"
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
  if os.path.lexists(run_dir):
    # An earlier rerun's report.json and config.json would pass for this rerun's, and the main
    # would resume its checkpoints instead of training: kept aside, never reused.
    lines.append(f"  moved the earlier run directory {run_dir} aside to {move_aside(run_dir)}")
  os.makedirs(run_dir)
  log_path = os.path.join(run_dir, LOG)
  not_done = "nothing was compared" + (" or stamped" if stamp else "")
  status = _run_rerun(command, log_path)
  why = "" if status == 0 else f"exit code {status}"
  if not why and not os.path.isfile(os.path.join(run_dir, REPORT)):
    why = f"exit code 0 but no {REPORT}"
  if why:
    with open(log_path, errors="replace") as f:
      last = failure_line(f.read().splitlines())
    raise UserError(
        f"--reproduce={spec.name}: the rerun failed ({why}{': ' + last if last else ''}); "
        f"its log: {log_path}; {not_done}"
    )
  try:
    with open(os.path.join(run_dir, REPORT)) as f:
      report = json.load(f)
    config = None
    if stamp:  # What the rerun read, for the stamp's data hashes: this rerun's own config.
      with open(os.path.join(run_dir, CONFIG_FILE)) as f:
        config = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(
        f"--reproduce={spec.name}: the rerun exited 0 but left no readable "
        f"{os.path.basename(getattr(e, 'filename', None) or REPORT)} in {run_dir} ({e}); "
        f"its log: {log_path}; {not_done}"
    ) from None
  if not isinstance(report, dict):
    raise UserError(f"--reproduce={spec.name}: {run_dir}/{REPORT} is not a JSON object; {not_done}")
  ok, compared = compare(recorded[0]["metrics"], report, tolerance)
  exact = compare(recorded[0]["metrics"], report, 0.0)[0]
  verdict = "Reproduced" + (" (every value exact)." if exact else ".") if ok else "NOT reproduced."
  lines += compared + [f"{verdict} Run directory: {run_dir}"]
  if ok and stamp:
    entry = {
        "date": datetime.date.today().isoformat(),
        **source_state(REPO_ROOT),
        # Who vouches: the processor's model and instruction-set features among the rest. A
        # later reproduction compares exactly on the strength of this stamp only where its own
        # machine is this one (`comparison_basis`).
        "machine": machine(),
        "data": data_hashes([config]),
        "exact": exact,
        "tolerance": tolerance,
        # How this machine differs from the recording one (empty: the same): values that come
        # back exactly on another processor or instruction set are evidence for that machine,
        # not a rerun of the recording one, and the table says which.
        "differs_from_record": differs_from_record,
    }
    stamped = read_record(spec.name)
    kept = [
        r for r in stamped["provenance"].get("reproduced", ()) if r["machine"] != entry["machine"]
    ]
    stamped["provenance"]["reproduced"] = kept + [entry]
    write_atomically(record_path(spec.name), json.dumps(stamped, indent=1) + "\n")
    lines.append(f"Added the reproduction to {os.path.relpath(record_path(spec.name), REPO_ROOT)}.")
  return ok, lines


def _run_rerun(command: Sequence[str], log_path: str) -> int:
  """Runs a reproduction's training to its end; returns its exit status.

  The run gets a session of its own, so that SIGTERM or Ctrl-C to this process (turned into
  KeyboardInterrupt) terminates the run's whole process group, data workers included: SIGTERM
  (the mains checkpoint on it), SIGKILL after a grace period, and a wait, before the interrupt
  goes on (`experiments.supervise._terminate`). No preexec_fn, unlike a sweep's runs: this
  process has initialised JAX (`machine()`), and a fork that runs Python in a multithreaded
  process may deadlock (JAX warns so). The explicit environment keeps libtpu's placeholders,
  which `machine()` may have set, from the run (`child_environment`)."""
  process = None
  with open(log_path, "w") as log, _sigterm_as_interrupt():
    try:
      process = subprocess.Popen(
          list(command),
          cwd=REPO_ROOT,
          env=child_environment({"PYTHONUNBUFFERED": "1"}),
          stdout=log,
          stderr=subprocess.STDOUT,
          start_new_session=True,
      )
      return process.wait()
    except BaseException:
      if process is not None:
        _terminate(process)
      raise


def comparison_basis(
    provenance: Mapping[str, Any],
) -> tuple[list[str], Mapping[str, Any] | None]:
  """How this machine, its software and the input data differ from a record's `provenance`
  (`_why_not_exact`; empty: the recording machine), and the stamped exact reproduction that
  vouches for comparing exactly here anyway (None where there is none or none is needed).

  Only a reproduction whose every value came back exactly and whose own machine (processor
  model and instruction-set features included) and data are this one's vouches: an exact
  reproduction on another processor says nothing about the rounding of this one."""
  differs = _why_not_exact(provenance)
  if not differs:
    return [], None
  for stamp in provenance.get("reproduced", ()):
    if stamp.get("exact") and not _why_not_exact(stamp):
      return differs, stamp
  return differs, None


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
  given = next(m for m in modes if f.get(m))
  # Flags of --reproduce alone: given with another mode they would be ignored without a word
  # (`--check ... --stamp` stamps nothing).
  for name in ("stamp", "tolerance"):
    if f.get(name) not in (None, False) and given != "reproduce":
      raise UserError(f"--{name} only applies to --reproduce, not --{given}")
  tolerance = f.get("tolerance")
  if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
    # NaN fails every comparison (identical values would "not reproduce"); inf passes every one.
    raise UserError(
        f"--tolerance={tolerance}: not a finite number >= 0 (the largest |difference| "
        "--reproduce accepts)"
    )
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
  try:
    ok, lines = reproduce(
        spec, read_record(spec.name), f["workdir"], tolerance, stamp=bool(f.get("stamp"))
    )
  except KeyboardInterrupt:  # SIGTERM or Ctrl-C: `reproduce` has stopped the rerun.
    print(
        f"error: --reproduce={spec.name}: interrupted; the rerun was stopped, nothing was "
        "compared or stamped",
        file=sys.stderr,
    )
    return 130
  print("\n".join(lines))
  return 0 if ok else 1


if __name__ == "__main__":
  _FLAGS = _define_flags()
  app.run(lambda argv: sys.exit(run(argv, {k: v.value for k, v in _FLAGS.items()})))
