"""A results table's spec: the `TABLE` of `results/NAME.py` checked into a `TableSpec` (its keys
are described in docs/running.md), and what a dotted path reads of a run's report.json."""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
from typing import Any, Mapping

from paper_runner import stats
from paper_runner.collect import is_number, lookup
from paper_runner.spec import REPO_ROOT, format_value, load_sweep_file
from trainkit.errors import UserError

RESULTS_DIR = os.path.join(REPO_ROOT, "results")
RECORDS_DIR = os.path.join(RESULTS_DIR, "records")
SEED_KEY = "seed"
# The last part of a fairness metric's path, and of one the predictions alone decide.
FAIRNESS_KEYS = ("pqd", "dp", "eopp", "eodds")
PREDICTION_KEYS = ("accuracy", *FAIRNESS_KEYS, "bleu")
# A reference row that reads the task's signal: it sets no accuracy bar.
SIGNAL_ROLE = "signal"
EVERY_ROW = "*"


# The generated summaries' names (`<!-- table:NAME -->`), reserved.
RERUN_SUMMARY = "reruns"
CLAIM_SUMMARY = "claims"
SUMMARIES = (RERUN_SUMMARY, CLAIM_SUMMARY)


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

  row: str
  settings: int
  what: str


@dataclasses.dataclass(frozen=True)
class SelectionLeak:
  """A choice that read the table's data: verdicts on `rows` (None: every row) are marked."""

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
  select: str | None = None
  select_within: tuple[str, float] | None = None
  references: str | None = None
  # (fold key, "module:function" of its split sizes): runs pair by fold and seed.
  cross_validation: tuple[str, str] | None = None
  tuning: tuple[Tuning, ...] = ()
  selection_leaks: tuple[SelectionLeak, ...] = ()

  @property
  def pair_by(self) -> tuple[str, ...]:
    return (self.cross_validation[0], SEED_KEY) if self.cross_validation else (SEED_KEY,)

  def pair(self, point: Mapping[str, Any]) -> Any:
    """The unit a run is paired by across rows: its seed, or "fold=...,seed=..."."""
    if self.pair_by == (SEED_KEY,):
      return point[SEED_KEY]
    return ",".join(f"{k}={format_value(point[k])}" for k in self.pair_by)

  def label(self, row: Any) -> str:
    text = format_value(row)
    return self.row_names.get(text, text)

  def metrics(self) -> list[str]:
    paths = [c.path for c in self.columns]
    return paths + [m for m in dict.fromkeys(c.metric for c in self.claims) if m not in paths]


def spec_error(name: str, key: str, message: str) -> UserError:
  return UserError(f"results/{name}.py: TABLE['{key}']: {message}")


def spec_path(name: str) -> str:
  return os.path.join(RESULTS_DIR, f"{name}.py")


def record_path(name: str) -> str:
  return os.path.join(RECORDS_DIR, f"{name}.json")


def table_names() -> list[str]:
  return sorted(f[:-3] for f in os.listdir(RESULTS_DIR) if f.endswith(".py") and f[0] != "_")


def load_table(name: str) -> TableSpec:
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
    raise UserError(f"results/{name}.py has no TABLE dict (paper_runner/tables.py says what)")
  return make_spec(name, os.path.relpath(path, REPO_ROOT), sweep, table)


def make_spec(name: str, path: str, sweep: Any, table: Mapping[str, Any]) -> TableSpec:
  """The TableSpec of a TABLE dict over a validated `sweep` (`path`: where a reader finds it)."""
  known = {f.name for f in dataclasses.fields(TableSpec)} - {"name", "path", "sweep", "row_values"}
  unknown = sorted(set(table) - known)
  if unknown:
    raise spec_error(name, unknown[0], f"unknown key; known: {', '.join(sorted(known))}")
  rows = table.get("rows")
  cross_validation = table.get("cross_validation")
  if cross_validation is not None and (
      not isinstance(cross_validation, (tuple, list))
      or len(cross_validation) != 2
      or cross_validation[0] not in sweep.grid
      or cross_validation[0] in (rows, SEED_KEY)
      or not re.fullmatch(r"[\w.]+:\w+", str(cross_validation[1]))
  ):
    what = "(a grid key other than rows and seed, 'package.module:function')"
    raise spec_error(name, "cross_validation", f"{cross_validation!r} is not {what}")
  pair_by = (cross_validation[0], SEED_KEY) if cross_validation else (SEED_KEY,)
  if rows not in sweep.grid or rows in pair_by or SEED_KEY not in sweep.grid:
    raise spec_error(name, "rows", f"{rows!r} is not a grid key other than {pair_by}")
  others = [k for k, v in sweep.grid.items() if k not in (rows, *pair_by) and len(v) > 1]
  if others:
    raise spec_error(name, "rows", f"grid key {others[0]!r} also varies; a table has one")
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
      raise spec_error(name, f"columns[{i}]", f"{column!r} is not (path, label, scale, decimals)")
    columns.append(Column(column[0], column[1], float(column[2]), column[3]))
  if not columns:
    raise spec_error(name, "columns", "at least one column is needed")
  claims = []
  for i, claim in enumerate(table.get("claims") or ()):
    if not isinstance(claim, Mapping) or set(claim) != {"row", "baseline", "metric", "better"}:
      raise spec_error(name, f"claims[{i}]", "must be dict(row=, baseline=, metric=, better=)")
    for key in ("row", "baseline"):
      if claim[key] not in texts:
        raise spec_error(name, f"claims[{i}]", f"{key} {claim[key]!r} is not a row: {texts}")
    if claim["better"] not in stats.DIRECTIONS:
      raise spec_error(name, f"claims[{i}]", f"better must be one of {stats.DIRECTIONS}")
    claims.append(Claim(**claim))
  paths = [c.path for c in columns] + [c.metric for c in claims]
  for i, claim in enumerate(claims):
    accuracy = accuracy_path(claim.metric)
    if accuracy is not None and accuracy not in paths:
      raise spec_error(
          name,
          f"claims[{i}]",
          f"{claim.metric!r} is a fairness metric; deciding it needs the accuracy on its split, "
          f"{accuracy!r}, as a column or a claim",
      )
  return TableSpec(
      name=name,
      path=path,
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
      select=_check_select(name, table.get("select"), columns),
      select_within=_check_select_within(name, table, columns),
      references=_check_references(name, table.get("references")),
      cross_validation=tuple(cross_validation) if cross_validation else None,
      tuning=_check_tuning(name, table.get("tuning"), texts),
      selection_leaks=_check_leaks(name, table.get("selection_leaks"), texts),
  )


def accuracy_path(metric: str) -> str | None:
  """The same split's accuracy path for a fairness metric, None for any other."""
  parts = metric.split(".")
  if parts[-1] not in FAIRNESS_KEYS:
    return None
  return "validation.accuracy" if parts[0] == "validation" else "accuracy"


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
      raise spec_error(
          name,
          f"tuning[{i}]",
          f"{entry!r} is not (a row or {EVERY_ROW!r}, settings tried (an int >= 0), what)",
      )
    tuning.append(Tuning(*entry))
  return tuple(tuning)


def _check_leaks(name: str, value: Any, rows: list[str]) -> tuple[SelectionLeak, ...]:
  leaks = []
  for i, entry in enumerate(value or ()):
    if not isinstance(entry, Mapping) or set(entry) != {"rows", "why"}:
      raise spec_error(name, f"selection_leaks[{i}]", "must be dict(rows=, why=)")
    affected = entry["rows"]
    if affected is not None and (isinstance(affected, str) or not all(r in rows for r in affected)):
      raise spec_error(
          name, f"selection_leaks[{i}]", f"rows {affected!r} must be None or rows of {rows}"
      )
    leaks.append(SelectionLeak(None if affected is None else tuple(affected), str(entry["why"])))
  return tuple(leaks)


def import_spec_object(spec: TableSpec, key: str, target: str) -> Any:
  module_name, function = target.split(":")
  try:
    return getattr(importlib.import_module(module_name), function)
  except (ImportError, AttributeError) as e:
    raise spec_error(spec.name, key, f"cannot import {target}: {e}") from None


def _check_references(name: str, references: Any) -> str | None:
  if references is not None and not re.fullmatch(r"[\w.]+:\w+", str(references)):
    raise spec_error(name, "references", f"{references!r} is not 'package.module:function'")
  return references


def _check_select(name: str, select: Any, columns: list[Column]) -> str | None:
  if select is not None and select not in [c.path for c in columns]:
    raise spec_error(name, "select", f"{select!r} is not the path of a column")
  return select


def _check_select_within(
    name: str, table: Mapping[str, Any], columns: list[Column]
) -> tuple[str, float] | None:
  within = table.get("select_within")
  if within is None:
    return None
  if not table.get("select"):
    raise spec_error(name, "select_within", "needs a select path")
  if (
      not isinstance(within, (tuple, list))
      or len(within) != 2
      or within[0] not in [c.path for c in columns]
      or not isinstance(within[1], (int, float))
      or within[1] < 0
  ):
    raise spec_error(
        name, "select_within", f"{within!r} is not (path of a column, non-negative margin)"
    )
  return str(within[0]), float(within[1])


def metric_value(report: Any, path: str) -> float | None:
  """The number at a dotted path: nested numbers give their mean, a bool 0 or 1; else None."""
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
  examples = metric_value(report, spec.examples)
  groups = {}
  if spec.groups:
    attributes = lookup(report, spec.groups)
    for attribute, entry in (attributes if isinstance(attributes, Mapping) else {}).items():
      for group, values in (entry.get("groups") or {}).items():
        groups[f"{attribute}={group}"] = int(values["n"])
  return {"examples": None if examples is None else int(examples), "groups": groups}


def unit_text(unit: Any) -> str:
  """A pairing unit as a reader names it: a seed, or `fold=0,seed=0` (keys' last parts)."""
  if not isinstance(unit, str):
    return str(unit)
  return ",".join(
      f"{key.rpartition('.')[2]}={value}"
      for key, _, value in (part.partition("=") for part in unit.split(","))
  )


def pair_units(spec: TableSpec) -> str:
  return " × ".join(k.split(".")[-1] + "s" for k in spec.pair_by)
