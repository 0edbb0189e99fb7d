"""A table's statistics from its record (docs/protocol.md, section 3), and what a rerun of its runs
changes (the `reruns` summary and the marks beside verdicts)."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping

from paper_runner import stats
from paper_runner.spec import format_value
from paper_runner.table_spec import (
    CONTROL_ROLE,
    PREDICTION_KEYS,
    SIGNAL_ROLE,
    Claim,
    TableSpec,
    accuracy_path,
    gate_path,
    is_mechanism,
    unit_text,
)
from trainkit.errors import UserError


def chosen_row(spec: TableSpec, summary: dict[str, Any]) -> str | None:
  """The highest mean of `select` among the rows within `select_within`'s margin of the best."""
  rows = summary["rows"].items()
  means = lambda p: {row: e["cells"][p].mean for row, e in rows if e["cells"].get(p)}  # noqa: E731
  scores = means(spec.select)
  if spec.select_within:
    path, margin = spec.select_within
    guard = means(path)
    if guard:
      best = max(guard.values())
      scores = {row: v for row, v in scores.items() if guard.get(row, -math.inf) >= best - margin}
  return max(scores, key=scores.get) if scores else None


def claim_values(record: Mapping[str, Any], row: str, path: str) -> dict[int, float]:
  return {
      r["seed"]: r["metrics"][path]
      for r in record["runs"]
      if r["row"] == row and r["status"] == "ok" and r["metrics"].get(path) is not None
  }


def accuracy_bar(record: Mapping[str, Any], path: str) -> tuple[float, str] | None:
  """(bar, reference): the highest accuracy at `path` of a reference that reads no signal, at the
  upper end of its 95% range where it has one; None without one."""
  bars = []
  for reference in record.get("references", ()):
    high = (reference.get("ranges") or {}).get(path, [None, None])[1]
    value = reference["metrics"].get(path) if high is None else high
    if value is not None and reference.get("role") != SIGNAL_ROLE:
      bars.append((value, reference["name"]))
  return max(bars) if bars else None


def control_ranges(record: Mapping[str, Any], path: str) -> list[tuple[float, float]]:
  """(low, high) at `path` of each control reference: its 95% range over seeds, or its value."""
  return [
      (reference.get("ranges") or {}).get(path) or (reference["metrics"][path],) * 2
      for reference in record.get("references", ())
      if reference.get("role") == CONTROL_ROLE and reference["metrics"].get(path) is not None
  ]


@dataclasses.dataclass(frozen=True)
class Gate:
  """A claim's gate path (`gate_path`), bar (None: no reference) and whether its rows lie above."""

  path: str
  bar: tuple[float, str] | None
  above: bool


def final_verdict(holm: str, moved: str | None) -> str:
  """A claim's one verdict, in the claims summary and the prose alike: the Holm-adjusted one,
  read as undecided where a rerun moves the raw one (docs/protocol.md, section 5)."""
  return stats.UNDECIDED if moved and holm != stats.UNTESTABLE else holm


def _by_row(spec: TableSpec, units: list[tuple[str, str]]) -> str:
  """`row seeds u, v; row seeds w` of (row, pairing unit text) pairs."""
  rows: dict[str, list[str]] = {}
  for row, unit in units:
    rows.setdefault(spec.label(row), []).append(unit)
  return "; ".join(f"{row} seeds {', '.join(seeds)}" for row, seeds in rows.items())


def summarise(spec: TableSpec, record: Mapping[str, Any]) -> dict[str, Any]:
  """Per row its seeds and each metric's interval; per claim its verdict, gate and Holm verdict;
  the flags."""
  ratio = None  # A cross-validated table's: the mean n_test / n_train over its folds.
  if spec.cross_validation:
    sizes = record.get("split_sizes")
    if not sizes:
      raise UserError(
          f"table {spec.name}: its record has no split_sizes, which the corrected interval of its "
          f"folds needs; add them with `python -m paper_runner.tables --references={spec.name}`"
      )
    ratio = math.fsum(s["test"] / s["train"] for s in sizes.values()) / len(sizes)
  ok = [r for r in record["runs"] if r["status"] == "ok"]
  rows = {}
  for row in map(format_value, spec.row_values):
    values = {path: claim_values(record, row, path) for path in spec.metrics()}
    rows[row] = {
        "seeds": sorted({r["seed"] for r in ok if r["row"] == row}),
        "cells": {
            p: stats.interval(list(v.values()), ratio) if v else None for p, v in values.items()
        },
    }
  claims = []
  gates: list[Gate | None] = []
  for claim in spec.claims:
    result = stats.decide(
        claim_values(record, claim.row, claim.metric),
        claim_values(record, claim.baseline, claim.metric),
        claim.better,
        ratio,
        claim.margin,
    )
    fairness, path = accuracy_path(claim.metric) is not None, gate_path(claim.metric)
    bar = accuracy_bar(record, path) if path else None
    gate = None
    if is_mechanism(claim.metric):
      # What training did: the claimed row's interval clear of every control's range.
      c, controls = rows[claim.row]["cells"][claim.metric], control_ranges(record, claim.metric)
      clear = c and c.low is not None and all(c.low > hi or c.high < lo for lo, hi in controls)
      gate = Gate(claim.metric, None, bool(controls and clear))
    elif bar is not None or fairness:
      cells = [rows[row]["cells"][path] for row in (claim.row, claim.baseline)]
      above = [bar is not None and c and c.low is not None and c.low > bar[0] for c in cells]
      # A fairness metric rewards a model that learnt nothing: both rows must have learnt.
      gate = Gate(path, bar, all(above) if fairness else any(above))
    if gate and not gate.above:  # Not decided, whatever its interval says (protocol, section 3).
      result = dataclasses.replace(result, verdict=stats.UNTESTABLE)
    claims.append((claim, result))
    gates.append(gate)
  # The family is every claim of the table, an untested one included (stats.holm).
  adjusted = stats.holm(
      [None if result.verdict == stats.UNTESTABLE else result.p for _, result in claims]
  )
  holm = [
      (p, stats.UNTESTABLE if p is None else stats.verdict_at(r.tested_mean, p, c.better))
      for (c, r), p in zip(claims, adjusted)
  ]
  flags = []
  examples = sorted({r["examples"] for r in ok if r.get("examples") is not None})
  if examples and examples[0] < stats.MIN_SPLIT_EXAMPLES:
    flags.append(
        f"small sample: the {spec.split} split has {examples[0]} examples "
        f"(< {stats.MIN_SPLIT_EXAMPLES})"
    )
  small_groups = {}
  for group, n in ((g, n) for r in ok for g, n in (r.get("groups") or {}).items()):
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
  failed = [
      (r["row"], f"{unit_text(r['seed'])} ({r['status']})")
      for r in record["runs"]
      if r["status"] != "ok"
  ]
  if failed:
    flags.append(f"runs without a result: {_by_row(spec, failed)}")
  recorded = {(r["row"], r["seed"]) for r in record["runs"]}
  absent = [(row, unit_text(unit)) for row, unit in spec.units() if (row, unit) not in recorded]
  if absent:  # Named, not counted away: `--check` says the record is stale too.
    flags.append(f"runs of the spec not in the record: {_by_row(spec, absent)}")
  if any(g and g.bar is None and not control_ranges(record, g.path) for g in gates):
    flags.append(
        "a claim on fairness needs a reference accuracy to be decided against, one on routing, "
        "gradients, the constraint or attention an untrained model or a reference router or "
        "attention (a reference row of role control); this table has none for some, so those "
        "claims are untestable"
    )
  return dict(rows=rows, claims=claims, holm=holm, gates=gates, ratio=ratio, flags=flags)


def leaks_of(spec: TableSpec, claim: Claim) -> list[int]:
  """The selection leaks whose rows include the claim's row or baseline."""
  return [
      i
      for i, leak in enumerate(spec.selection_leaks)
      if leak.rows is None or {claim.row, claim.baseline} & set(leak.rows)
  ]


IDENTICAL = "identical (not independent)"


# claims: (claim, recorded, rerun verdict, |change|); chosen: a tuning table's (recorded, rerun)
# choice or None; largest_change: (|change| in the column's scale, |change| / the recorded
# half-width or None, claim) or None.
RerunComparison = collections.namedtuple(
    "RerunComparison", "runs claims chosen largest_change identical"
)


def _relative_change(change: float, interval: stats.Interval, scale: float) -> float | None:
  if interval.low is None:
    return None
  half_width = (interval.high - interval.low) / 2 * scale
  if half_width <= 0:  # Every seed the same difference: any change is beyond the interval.
    return math.inf if change > 0 else 0.0
  return change / half_width


def compare_rerun(
    spec: TableSpec, record: Mapping[str, Any], rerun: Mapping[str, Any]
) -> RerunComparison:
  recorded = summarise(spec, record)
  # The rerun is read as the record is: against its references and with its folds' sizes.
  again = summarise(spec, {**record, "runs": rerun["runs"], "reruns": []})
  claims = []
  changes: list[tuple[float, float | None, Claim]] = []
  for (claim, before), (_, after) in zip(recorded["claims"], again["claims"]):
    if before.difference is None or after.difference is None:
      continue  # A row of the claim was not rerun.
    scale = spec.column(claim.metric).scale
    change = abs(after.difference.mean - before.difference.mean) * scale
    claims.append((claim, before.verdict, after.verdict, change))
    changes.append((change, _relative_change(change, before.difference, scale), claim))
  chosen = None
  if spec.select and all(entry["seeds"] for entry in again["rows"].values()):
    chosen = (chosen_row(spec, recorded), chosen_row(spec, again))
  largest = max(changes, key=lambda c: (-1.0 if c[1] is None else c[1], c[0]), default=None)
  identical = identical_predictions(spec, record, rerun)
  return RerunComparison(len(rerun["runs"]), claims, chosen, largest, identical)


def moved_verdicts(spec: TableSpec, record: Mapping[str, Any]) -> dict[Claim, str]:
  """Per claim whose verdict a rerun of the record changes, the rerun verdicts."""
  moved: dict[Claim, list[str]] = {}
  for rerun in record.get("reruns", ()):
    for claim, before, after, _ in compare_rerun(spec, record, rerun).claims:
      if after != before:
        moved.setdefault(claim, []).append(after)
  return {claim: ", ".join(verdicts) for claim, verdicts in moved.items()}


def identical_predictions(
    spec: TableSpec, record: Mapping[str, Any], rerun: Mapping[str, Any]
) -> bool:
  """Whether every rerun run has its recorded run's prediction values and sizes to the last bit
  (then it cannot disagree with the record and is no evidence)."""
  # The paths the predictions alone decide (accuracy, fairness, BLEU, HANS heuristics).
  paths = [
      p
      for p in spec.metrics()
      if p.split(".")[-1] in PREDICTION_KEYS or ".by_heuristic." in f".{p}"
  ]
  if not paths or not rerun["runs"]:
    return False
  recorded = {(r["row"], r["seed"]): r for r in record["runs"] if r["status"] == "ok"}

  def predicted(run: Mapping[str, Any] | None) -> list[Any] | None:
    return run and [run["metrics"].get(p) for p in paths] + [run.get("examples"), run.get("groups")]

  return all(predicted(recorded.get((r["row"], r["seed"]))) == predicted(r) for r in rerun["runs"])


def machine_text(m: Mapping[str, Any]) -> str:
  processor = f", {m['processor']['model']}" if "processor" in m else ""
  flags = (m.get("environment") or {}).get("XLA_FLAGS")
  return f"{m['device']}, {m['cpu_cores']} CPU cores ({m['arch']}{processor}), JAX {m['jax']}" + (
      f", `XLA_FLAGS={flags}`" if flags else ""
  )


def change_text(change: float, relative: float | None, decimals: int, label: str) -> str:
  """`0.4 (0.0061, label)`: half-widths of the recorded interval, then the change itself."""
  detail = f"{change:.{decimals + 1}f}, {label}"
  if relative is None:
    return f"{change:.{decimals + 1}f} ({label})"
  if math.isinf(relative):
    return f"beyond a zero-width interval ({detail})"
  return f"{relative:.1f} ({detail})"


def rerun_machine(provenance: Mapping[str, Any]) -> str:
  m = provenance["machine"]
  flags = (m.get("environment") or {}).get("XLA_FLAGS")
  return f"`XLA_FLAGS={flags}`" if flags else m.get("processor", {}).get("model") or m["device"]
