"""A results table's spec: the `TABLE` of `results/NAME.py` checked into a `TableSpec` (its keys
are described in docs/running.md), and what a dotted path reads of a run's report.json."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import tempfile
from typing import Any, Callable, Mapping

import jax
import ml_collections

from paper_runner import stats
from paper_runner.collect import is_number, lookup
from paper_runner.spec import REPO_ROOT, format_value, grid_points, load_sweep_file
from trainkit.errors import UserError

RESULTS_DIR = os.path.join(REPO_ROOT, "results")
RECORDS_DIR = os.path.join(RESULTS_DIR, "records")
SEED_KEY = "seed"
# The last part of a fairness metric's path, and of one the predictions alone decide.
FAIRNESS_KEYS = ("pqd", "dp", "eopp", "eodds")
PREDICTION_KEYS = ("accuracy", *FAIRNESS_KEYS, "bleu")
# The valid range of a metric by its path's last part (fractions, a cosine); others: any finite.
METRIC_RANGES = {
    **dict.fromkeys(("accuracy", *FAIRNESS_KEYS, "entailment", "non-entailment", "met"), (0, 1)),
    "gradient_cosine": (-1, 1),
}
# A reference row that reads the task's signal: it sets no accuracy bar.
SIGNAL_ROLE = "signal"
# A reference row that learnt nothing (an untrained model, a fixed router): `is_mechanism`'s.
CONTROL_ROLE = "control"
EVERY_ROW = "*"
# A report's sections that say what training did to routing, gradients, the constraint, attention.
MECHANISM_ROOTS = ("experts_active", "gradient_cosine", "mechanisms", "constraints", "attention")


# The generated summaries' names (`<!-- table:NAME -->`), reserved.
RERUN_SUMMARY = "reruns"
CLAIM_SUMMARY = "claims"
# The opening table: one row per claim, its data, model, budget, seeds, hardware and verdicts.
VERDICT_SUMMARY = "verdicts"
SUMMARIES = (RERUN_SUMMARY, CLAIM_SUMMARY, VERDICT_SUMMARY)

Column = collections.namedtuple("Column", "path label scale decimals")
Tuning = collections.namedtuple("Tuning", "row settings what")
# A choice that read the table's data: verdicts on `rows` (None: every row) are marked.
SelectionLeak = collections.namedtuple("SelectionLeak", "rows why")


@dataclasses.dataclass(frozen=True)
class Claim:
  row: str
  baseline: str
  metric: str
  better: str
  margin: float = 0.0  # > 0: non-inferiority, "not worse by more than" (docs/protocol.md, 3).


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

  def units(self) -> list[tuple[str, Any]]:
    """(row, pairing unit) of each run of the sweep, in grid order."""
    return [(format_value(p[self.rows]), self.pair(p)) for p in grid_points(self.sweep)]

  def column(self, path: str) -> Column:
    """The column of `path`, or a plain one for a metric only a claim reads."""
    return next((c for c in self.columns if c.path == path), Column(path, path, 1.0, 3))

  def label(self, row: Any) -> str:
    text = format_value(row)
    return self.row_names.get(text, text)

  def claim_text(self, claim: Claim) -> str:
    row, baseline = self.label(claim.row), self.label(claim.baseline)
    if not claim.margin:
      return f"{row} {claim.better} than {baseline}"
    worse = dict(zip(stats.DIRECTIONS, stats.DIRECTIONS[::-1]))[claim.better]
    margin = format_value(claim.margin * self.column(claim.metric).scale)
    return f"{row} not {worse} than {baseline} by more than {margin}"

  def metrics(self) -> list[str]:
    paths = [c.path for c in self.columns]
    return paths + [m for m in dict.fromkeys(c.metric for c in self.claims) if m not in paths]


def spec_error(name: str, key: str, message: str) -> UserError:
  return UserError(f"results/{name}.py: TABLE['{key}']: {message}")


def record_path(name: str) -> str:
  return os.path.join(RECORDS_DIR, f"{name}.json")


def table_names() -> list[str]:
  return sorted(f[:-3] for f in os.listdir(RESULTS_DIR) if f.endswith(".py") and f[0] != "_")


def recorded_tables() -> list[str]:
  """The tables with a record: each spec's, then each spec's at an argument (`NAME_paper`)."""
  names = table_names()
  records = sorted(f[:-5] for f in os.listdir(RECORDS_DIR) if f.endswith(".json"))
  for name in (n for n in records if n not in names):
    with open(record_path(name)) as f:
      names += [name] * bool(scaled_name(json.load(f).get("spec", "")))
  return [name for name in names if name in records]


def load_table(name: str) -> TableSpec:
  """`NAME`'s spec; `NAME:ARG` its sweep with the spec's argument (`scale=S,data=ROOT`:
  `paper_scale.at_scale`; a spec's own keys), recorded as `NAME_V..._S` (each value but data's
  and the scale, then the scale unless small); a name only a record has is that record's spec."""
  name, sep, arg = name.partition(":")
  path = os.path.join(RESULTS_DIR, f"{name}.py")
  values = dict(sorted(item.partition("=")[::2] for item in arg.split(",") if item))
  scale = values.pop("scale", "small")
  if not (sep or os.path.isfile(path)) and os.path.isfile(record_path(name)):
    with open(record_path(name)) as f:
      scaled = scaled_name(json.load(f).get("spec", ""))
    if scaled:
      return load_table(scaled)
  if name in SUMMARIES:
    raise UserError(
        f"results/{name}.py: '{name}' is reserved, the name of a generated summary "
        f"(<!-- table:{name} -->); give the table another name"
    )
  if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not os.path.isfile(path):
    raise UserError(f"no table spec results/{name}.py; known: {', '.join(table_names())}")
  sweep, module = load_sweep_file(path + sep + arg)
  table = getattr(module, "TABLE", None)
  table = table(arg or None) if callable(table) else table  # One that follows its argument.
  if not isinstance(table, Mapping):
    raise UserError(f"results/{name}.py has no TABLE dict (paper_runner/tables.py says what)")
  if scale != "small":  # The paper's runs: not the sample's folds, nor its choices.
    table = {k: v for k, v in table.items() if k not in ("cross_validation", "selection_leaks")}
    tuning = [(EVERY_ROW, 0, "the paper's settings")] * bool(table.get("tuning"))
    if tuning and sweep.row_settings:  # Rows that train their paper-scale search's choice.
      chosen = {
          format_value(v): (n, f"chosen on validation: {settings} (results/records/{record}.json)")
          for _, v, settings, n, record in sweep.row_settings
      }
      paper = (0, "the paper's settings")
      tuning = [(r, *chosen.get(r, paper)) for r in map(format_value, sweep.grid[table["rows"]])]
    table = dict(table, tuning=tuning, **getattr(module, "PAPER_TABLE", {}))
  values.pop("data", None)  # The record's name: each value of the argument but the data's.
  name += "".join(f"_{re.sub(r'[^A-Za-z0-9]', '_', v)}" for v in values.values())
  name += f"_{scale}" * (scale != "small")
  return make_spec(name, os.path.relpath(path, REPO_ROOT) + sep + arg, sweep, table)


def scaled_name(spec_path: str) -> str:
  """`NAME:ARG` of a spec path with an argument (`results/NAME.py:ARG`), else ''."""
  path, sep, arg = spec_path.partition(":")
  return sep and os.path.basename(path)[:-3] + sep + arg


def _fits(entry: Any, *checks: Callable[[Any], bool]) -> bool:
  """Whether `entry` is a tuple or list with one item per check, each passing its check."""
  return (
      isinstance(entry, (tuple, list))
      and len(entry) == len(checks)
      and all(check(item) for check, item in zip(checks, entry))
  )


def _entries(
    name: str, table: Mapping[str, Any], key: str, fits: Callable[[Any], bool], shape: str
) -> list:
  """TABLE[key]'s entries; an error naming the first that `fits` refuses, and the `shape` due."""
  for i, entry in enumerate(table.get(key) or ()):
    if not fits(entry):
      raise spec_error(name, f"{key}[{i}]", f"{entry!r} is not {shape}")
  return list(table.get(key) or ())


def _is_target(value: Any) -> bool:
  return re.fullmatch(r"[\w.]+:\w+", str(value)) is not None


def make_spec(name: str, path: str, sweep: Any, table: Mapping[str, Any]) -> TableSpec:
  """The TableSpec of a TABLE dict over a validated `sweep` (`path`: where a reader finds it)."""
  known = {f.name for f in dataclasses.fields(TableSpec)} - {"name", "path", "sweep", "row_values"}
  unknown = sorted(set(table) - known)
  if unknown:
    raise spec_error(name, unknown[0], f"unknown key; known: {', '.join(sorted(known))}")
  rows = table.get("rows")
  folds = table.get("cross_validation")
  grid_key = lambda key: key in sweep.grid and key not in (rows, SEED_KEY)  # noqa: E731
  if folds is not None and not _fits(folds, grid_key, _is_target):
    what = "(a grid key other than rows and seed, 'package.module:function')"
    raise spec_error(name, "cross_validation", f"{folds!r} is not {what}")
  pair_by = (folds[0], SEED_KEY) if folds else (SEED_KEY,)
  if rows not in sweep.grid or rows in pair_by or SEED_KEY not in sweep.grid:
    raise spec_error(name, "rows", f"{rows!r} is not a grid key other than {pair_by}")
  others = [k for k, v in sweep.grid.items() if k not in (rows, *pair_by) and len(v) > 1]
  if others:
    raise spec_error(name, "rows", f"grid key {others[0]!r} also varies; a table has one")
  row_values = list(sweep.grid[rows])
  texts = [format_value(v) for v in row_values]
  is_str = lambda value: isinstance(value, str)  # noqa: E731
  entries = functools.partial(_entries, name, table)
  columns = [
      Column(path, label, float(scale), decimals)
      for path, label, scale, decimals in entries(
          "columns",
          lambda c: _fits(c, is_str, is_str, is_number, lambda d: isinstance(d, int)),
          "(path, label, scale, decimals)",
      )
  ]
  if not columns:
    raise spec_error(name, "columns", "at least one column is needed")
  claims = [
      Claim(**claim)
      for claim in entries(
          "claims",
          lambda c: isinstance(c, Mapping)
          and set(c) - {"margin"} == {"row", "baseline", "metric", "better"}
          and c["row"] in texts
          and c["baseline"] in texts
          and c["better"] in stats.DIRECTIONS
          and is_number(c.get("margin", 0))
          and c.get("margin", 0) >= 0,
          f"dict(row=, baseline=, metric=, better=[, margin=]) with rows of {texts}, better one "
          f"of {stats.DIRECTIONS} and a margin >= 0",
      )
  ]
  paths = [c.path for c in columns]
  for i, claim in enumerate(claims):
    accuracy = accuracy_path(claim.metric)
    if accuracy is not None and accuracy not in paths + [c.metric for c in claims]:
      raise spec_error(
          name,
          f"claims[{i}]",
          f"{claim.metric!r} is a fairness metric; deciding it needs the accuracy on its split, "
          f"{accuracy!r}, as a column or a claim",
      )
  tuning = entries(
      "tuning",
      lambda t: _fits(
          t,
          lambda r: r in (*texts, EVERY_ROW),
          lambda n: is_number(n) and isinstance(n, int) and n >= 0,
          is_str,
      ),
      f"(a row or {EVERY_ROW!r}, settings tried (an int >= 0), what)",
  )
  leaks = entries(
      "selection_leaks",
      lambda leak: isinstance(leak, Mapping)
      and set(leak) == {"rows", "why"}
      and (leak["rows"] is None or not is_str(leak["rows"]) and set(leak["rows"]) <= set(texts)),
      f"dict(rows=None or rows of {texts}, why=)",
  )
  select, within = table.get("select"), table.get("select_within")
  if select is not None and select not in paths:
    raise spec_error(name, "select", f"{select!r} is not the path of a column")
  if within is not None and not (
      select and _fits(within, paths.__contains__, lambda m: is_number(m) and m >= 0)
  ):
    what = "(path of a column, non-negative margin) beside a select path"
    raise spec_error(name, "select_within", f"{within!r} is not {what}")
  references = table.get("references")
  if references is not None and not _is_target(references):
    raise spec_error(name, "references", f"{references!r} is not 'package.module:function'")
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
      select=select,
      select_within=(str(within[0]), float(within[1])) if within is not None else None,
      references=references,
      cross_validation=tuple(folds) if folds else None,
      tuning=tuple(Tuning(*t) for t in tuning),
      selection_leaks=tuple(
          SelectionLeak(None if leak["rows"] is None else tuple(leak["rows"]), str(leak["why"]))
          for leak in leaks
      ),
  )


def gate_path(metric: str) -> str | None:
  """Where a claim's rows must lie above the references that read no signal: a score's own path
  (accuracy, BLEU), a fairness metric's split accuracy; None for any other metric."""
  return metric if metric.split(".")[-1] in ("accuracy", "bleu") else accuracy_path(metric)


def is_mechanism(metric: str) -> bool:
  """Whether a claim on `metric` is about what training does (read against CONTROL_ROLE rows)."""
  return metric.split(".")[0] in MECHANISM_ROOTS


def untrained_control(train: Callable, config: Mapping, settings: dict, keys, seeds) -> dict:
  """A control row: the report `keys` (a tuple) of `config` with `settings` (dotted keys) after
  one step at learning rate 0, one draw per seed of `seeds`; a model that learnt nothing."""
  draws, at_rate_0 = [], {"num_train_steps": 1, "optimizer.learning_rate": 0.0, **settings}
  for seed in seeds:
    run = ml_collections.ConfigDict(dict(config))
    run.update_from_flattened_dict({"seed": seed, **at_rate_0})
    run.num_epochs = type(run.num_epochs)(0)  # Else the config's epochs set the steps.
    with tempfile.TemporaryDirectory() as workdir:
      report = train(run, workdir)
    draws.append({k: report.get(k) for k in keys})
  return dict(draws=draws, role=CONTROL_ROLE)


def accuracy_path(metric: str) -> str | None:
  """The same split's accuracy path for a fairness metric, None for any other."""
  parts = metric.split(".")
  if parts[-1] not in FAIRNESS_KEYS:
    return None
  return "validation.accuracy" if parts[0] == "validation" else "accuracy"


def import_spec_object(spec: TableSpec, key: str, target: str) -> Any:
  module_name, function = target.split(":")
  try:
    return getattr(importlib.import_module(module_name), function)
  except (ImportError, AttributeError) as e:
    raise spec_error(spec.name, key, f"cannot import {target}: {e}") from None


def metric_value(report: Any, path: str) -> float | None:
  """The number at a dotted path: nested numbers give their mean, a bool 0 or 1; else None."""
  value = lookup(report, path)
  if isinstance(value, bool):
    return float(value)
  if isinstance(value, (Mapping, list, tuple)):
    numbers = jax.tree_util.tree_leaves(value, is_leaf=lambda leaf: leaf is None)
    if not numbers or not all(is_number(v) for v in numbers):
      return None
    return math.fsum(numbers) / len(numbers)
  return float(value) if is_number(value) else None


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
