"""What a rerun of a table's runs changes, and the paragraph printed under the table per rerun."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from paper_runner import stats
from paper_runner.spec import format_value, grid_points
from paper_runner.table_spec import PREDICTION_KEYS, Claim, TableSpec, pair_units, unit_text
from paper_runner.table_summary import chosen_row, claim_values, summarise

IDENTICAL = "identical (not independent)"


@dataclasses.dataclass(frozen=True)
class RerunComparison:

  runs: int
  rows: list[str]
  seeds: list[int]
  claims: list[tuple[Claim, str, str, float]]  # (claim, recorded, rerun verdict, |change|)
  chosen: tuple[str, str] | None  # A tuning table's (recorded, rerun) choice.
  # (|change| in the column's scale, |change| / the recorded half-width or None, claim[, seed]).
  largest_change: tuple[float, float | None, Claim] | None = None
  largest_seed_change: tuple[float, float | None, Claim, Any] | None = None
  identical: bool = False


def _relative_change(change: float, interval: stats.Interval, scale: float) -> float | None:
  if interval.low is None:
    return None
  half_width = (interval.high - interval.low) / 2 * scale
  if half_width <= 0:  # Every seed the same difference: any change is beyond the interval.
    return math.inf if change > 0 else 0.0
  return change / half_width


def _by_relative_change(entry: tuple) -> tuple[float, float]:
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
        stats.paired(claim_values(r, claim.row, claim.metric), claim_values(r, claim.baseline, claim.metric))
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
  """The record's paths the predictions alone decide (accuracy, fairness, BLEU, HANS heuristics)."""
  return [
      p
      for p in spec.metrics()
      if p.split(".")[-1] in PREDICTION_KEYS or ".by_heuristic." in f".{p}"
  ]


def identical_predictions(
    spec: TableSpec, record: Mapping[str, Any], rerun: Mapping[str, Any]
) -> bool:
  """Whether every rerun run has its recorded run's prediction values and sizes to the last bit
  (then it cannot disagree with the record and is no evidence)."""
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
  return (m.get("environment") or {}).get("XLA_FLAGS")


def machine_text(m: Mapping[str, Any]) -> str:
  processor = f", {m['processor']['model']}" if "processor" in m else ""
  flags = _xla_flags(m)
  return (
      f"{m['device']}, {m['cpu_cores']} CPU cores ({m['arch']}{processor}), JAX {m['jax']}"
      + (f", `XLA_FLAGS={flags}`" if flags else "")
  )


def change_text(change: float, relative: float | None, decimals: int, label: str = "") -> str:
  """`0.4 (0.0061[, label])`: half-widths of the recorded interval, then the change itself."""
  absolute = f"{change:.{decimals + 1}f}"
  if relative is None:
    return f"{absolute} ({label})" if label else absolute
  detail = f"{absolute}, {label}" if label else absolute
  if math.isinf(relative):
    return f"beyond a zero-width interval ({detail})"
  return f"{relative:.1f} ({detail})"


def rerun_lines(spec: TableSpec, record: Mapping[str, Any]) -> list[str]:
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
        + f"; {pair_units(spec)} {', '.join(unit_text(u) for u in result.seeds)}"
    )
    text = (
        f"**Rerun** ({which}; runs of {p['date']}, commit {p['commit']}; "
        f"{machine_text(p['machine'])}): "
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
          f"interval, is {change_text(change, relative, decimals)} "
          f"({spec.label(claim.row)} against {spec.label(claim.baseline)}, {label})"
      )
    if result.largest_seed_change:
      change, relative, claim, seed = result.largest_seed_change
      label, decimals = labels.get(claim.metric, (claim.metric, 3))
      text += (
          f", of one pair's {change_text(change, relative, decimals)} "
          f"({spec.label(claim.row)} against {spec.label(claim.baseline)}, {label}, "
          f"{' × '.join(k.split('.')[-1] for k in spec.pair_by)} {unit_text(seed)})"
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


def rerun_machine(provenance: Mapping[str, Any]) -> str:
  m = provenance["machine"]
  flags = _xla_flags(m)
  if flags:
    return f"`XLA_FLAGS={flags}`"
  return m.get("processor", {}).get("model") or m["device"]
