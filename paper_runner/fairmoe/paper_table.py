"""The table collector of `paper_runner.fairmoe.compare`: its methods over seeds as a results
table with the reference readers and claims against vanilla SMoE (`comparison.md`, `.json`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import ml_collections

from paper_runner import table_parts as parts
from paper_runner.collect import RunResult
from paper_runner.spec import format_value, validate_sweep
from paper_runner.table_record import reference_rows, run_entry
from paper_runner.table_render import render
from paper_runner.table_spec import TableSpec, make_spec
from paper_runner.table_summary import summarise
from trainkit import storage
from trainkit.errors import UserError

BASELINE = "vanilla_smoe"
# The paper's claims against vanilla SMoE (Sec. 6.2): more accurate, higher PQD, lower DP.
CLAIMS = (("accuracy", "higher"), ("mf.pqd", "higher"), ("mf.dp", "lower"))


def comparison_spec(sweep: ml_collections.ConfigDict, runs: Sequence[RunResult]) -> TableSpec:
  """One row per method; a PQD and a DP column per attribute a finished run reports."""
  methods = [format_value(m) for m in sweep.grid.method]
  reported = (r.report.get("attributes") or {} for r in runs if r.status == "ok")
  attributes = dict.fromkeys(a for names in reported for a in names)
  columns = [parts.ACCURACY, parts.MF_PQD, parts.MF_DP, parts.EXPERTS_ACTIVE]
  columns += [parts.GRADIENT_COSINE, parts.DROPPED_TRAIN]
  pairs = [(a, m) for a in attributes for m in ("pqd", "dp")]
  columns += [(f"attributes.{a}.{m}", f"{m.upper()} {a}", 1.0, 3) for a, m in pairs]
  against = [m for m in methods if m != BASELINE] if BASELINE in methods else []
  claims = parts.claims(against, (BASELINE,), CLAIMS)
  table = parts.fair_comparison_table("Method comparison", {}, columns, claims)
  return make_spec("comparison", "paper_runner.fairmoe.compare", sweep, table)


def comparison(
    sweep: ml_collections.ConfigDict, runs: Sequence[RunResult]
) -> tuple[str, dict[str, Any]]:
  """(comparison.md, comparison.json's content) of the sweep's `runs`."""
  spec = comparison_spec(sweep, runs)
  try:
    references = reference_rows(spec)
  except UserError:  # Rows on different data: no reference, so fairness claims stay undecided.
    references = []
  entries = [{**run_entry(spec, r), "run_dir": r.run_dir} for r in runs]
  record = {"references": references, "runs": entries}
  return render(spec, record), {"record": record, **summarise(spec, record)}


def write_comparison(workdir: str, runs: list[RunResult]) -> list[str]:
  """Writes comparison.md and comparison.json beside the runner's sweep.json, which it reads."""
  definition = json.loads(storage.read_text(storage.join(workdir, "sweep.json")))["definition"]
  markdown, summary = comparison(validate_sweep(definition), runs)
  paths = [storage.join(workdir, "comparison.md"), storage.join(workdir, "comparison.json")]
  storage.write_atomically(paths[0], markdown)
  storage.write_atomically(paths[1], json.dumps(summary, indent=2, default=dataclasses.asdict))
  return paths
