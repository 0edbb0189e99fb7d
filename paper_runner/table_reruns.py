"""What a rerun of a table's runs changes (the `reruns` summary and the marks beside verdicts)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from paper_runner import stats
from paper_runner.table_spec import PREDICTION_KEYS, Claim, TableSpec
from paper_runner.table_summary import chosen_row, summarise

IDENTICAL = "identical (not independent)"


@dataclasses.dataclass(frozen=True)
class RerunComparison:

  runs: int
  claims: list[tuple[Claim, str, str, float]]  # (claim, recorded, rerun verdict, |change|)
  chosen: tuple[str, str] | None  # A tuning table's (recorded, rerun) choice.
  # (|change| in the column's scale, |change| / the recorded half-width or None, claim).
  largest_change: tuple[float, float | None, Claim] | None
  identical: bool


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
  return RerunComparison(
      runs=len(rerun["runs"]),
      claims=claims,
      chosen=chosen,
      largest_change=max(changes, key=lambda c: (-1.0 if c[1] is None else c[1], c[0]))
      if changes
      else None,
      identical=identical_predictions(spec, record, rerun),
  )


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
  flags = _xla_flags(m)
  if flags:
    return f"`XLA_FLAGS={flags}`"
  return m.get("processor", {}).get("model") or m["device"]
