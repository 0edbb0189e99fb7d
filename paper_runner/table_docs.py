"""A document's marked tables (`<!-- table:NAME -->`): a table from its record or a summary across
records, written (`--write`) or compared (`--check`)."""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any, Sequence

from paper_runner import stats
from paper_runner.collect import markdown_table
from paper_runner.markers import marked_tables, read_doc, replace_tables
from paper_runner.spec import grid_points, resolved_config
from paper_runner.table_record import read_record, stale_runs
from paper_runner.table_render import render
from paper_runner.table_spec import (
    CLAIM_SUMMARY,
    RERUN_SUMMARY,
    VERDICT_SUMMARY,
    TableSpec,
    load_table,
    pair_units,
    recorded_tables,
)
from paper_runner.table_summary import (
    IDENTICAL,
    change_text,
    compare_rerun,
    final_verdict,
    leaks_of,
    moved_verdicts,
    rerun_machine,
    summarise,
)
from trainkit.errors import UserError
from trainkit.storage import write_atomically


def _claims_tables() -> list[tuple[str, TableSpec, dict[str, Any]]]:
  """(name, spec, record) of every recorded table that decides claims, the CPU tables' first."""
  specs = [(name, load_table(name)) for name in recorded_tables()]
  return [(name, spec, read_record(name)) for name, spec in specs if spec.claims]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  return "\n".join(markdown_table(header, rows)) + "\n"


def rerun_summary() -> str:
  """One row per rerun of every table that decides claims (or "not rerun")."""
  header = ("table", "rerun", "verdicts kept", "verdicts that change (recorded -> rerun)")
  header += ("largest change of a mean paired difference, in half-widths of its interval (change)",)
  rows = []
  counted = identical = claims_rerun = claims_kept = 0
  for name, spec, record in _claims_tables():
    if not record.get("reruns"):
      rows.append((f"`{name}`", "not rerun", "—", "—", "—"))
    # The spec's runs, not the record's: a record that lost a run would read "12 of 11 runs".
    total = len(spec.units())
    for rerun in record.get("reruns", ()):
      result = compare_rerun(spec, record, rerun)
      rerun_claims = len(result.claims)
      kept = sum(before == after for _, before, after, _ in result.claims)
      if result.identical:
        identical += 1
        kept_text = f"{IDENTICAL}: not counted"
      elif not rerun_claims:
        kept_text = "— (no claim has both its rows rerun)"
      else:
        counted += 1
        claims_rerun += rerun_claims
        claims_kept += kept
        kept_text = f"{kept} of {rerun_claims}"
        if rerun_claims < len(spec.claims):
          kept_text += f" ({rerun_claims} of {len(spec.claims)} claims rerun)"
      if result.chosen:
        before, after = result.chosen
        kept_text += "; same choice" if before == after else f"; chooses {spec.label(after)}"
      changed = "; ".join(
          f"{spec.label(c.row)} against {spec.label(c.baseline)}, "
          f"{spec.column(c.metric).label}: {before} -> {after}"
          for c, before, after, _ in result.claims
          if before != after
      )
      largest = "—"
      if result.largest_change:
        change, relative, claim = result.largest_change
        column = spec.column(claim.metric)
        largest = change_text(change, relative, column.decimals, column.label)
      how_much = "every run" if result.runs == total else f"{result.runs} of {total} runs"
      where = f"{how_much}, {rerun_machine(rerun['provenance'])}"
      rows.append((f"`{name}`", where, kept_text, changed or "none", largest))
  reruns = f"{counted + identical} reruns; {identical} {IDENTICAL}"
  kept_text = f"**{claims_kept} of {claims_rerun}** (the {counted} reruns that could differ)"
  rows.append(("**every table**", reruns, kept_text, "—", "—"))
  return _table(header, rows)


_VERDICTS = (stats.HOLDS, stats.DOES_NOT_HOLD, stats.UNDECIDED, stats.UNTESTABLE)


def claim_verdicts() -> dict[tuple[str, str], dict[str, list[str]]]:
  """Per claim (its text, its metric's label), per `final_verdict`, the tables that reach it with
  their notes: the one source of the claims summary and of the prose's verdicts."""
  found: dict[tuple[str, str], dict[str, list[str]]] = {}
  for name, spec, record in _claims_tables():
    summary = summarise(spec, record)
    moved = moved_verdicts(spec, record)
    for (claim, result), (_, holm) in zip(summary["claims"], summary["holm"]):
      column = spec.column(claim.metric)
      verdict = final_verdict(holm, moved.get(claim))
      notes = [f"raw: {result.verdict}"] if result.verdict != verdict else []
      if verdict != holm:
        notes.append(f"Holm: {holm}")
      if claim in moved:
        notes.append(f"a rerun: {moved[claim]}")
      if leaks_of(spec, claim):
        notes.append("selection leak")
      if not result.enough_seeds:
        notes.append("too few seeds")
      if verdict == stats.UNDECIDED and result.detectable is not None:
        notes.append(f"detectable: {column.scale * result.detectable:.{column.decimals}f}")
      entry = f"`{name}`" + (f" ({'; '.join(notes)})" if notes else "")
      by_verdict = found.setdefault((spec.claim_text(claim), column.label), {})
      by_verdict.setdefault(verdict, []).append(entry)
  return found


def claim_summary() -> str:
  """Per claim and verdict (`claim_verdicts`), the tables that reach it."""
  header = ["claim", "on", *_VERDICTS]
  rows = [
      [claim, metric, *(", ".join(by_verdict.get(word, [])) or "—" for word in _VERDICTS)]
      for (claim, metric), by_verdict in claim_verdicts().items()
  ]
  return _table(header, rows)


def _setup(spec: TableSpec, record: dict[str, Any]) -> tuple[str, ...]:
  """(data and its size, model, budget, pairing units, hardware) of a table's runs."""
  config = resolved_config(spec.sweep, grid_points(spec.sweep)[0])
  sizes = sorted({r["examples"] for r in record["runs"] if r.get("examples")})
  size = "-".join(map(str, sorted({sizes[0], sizes[-1]}))) if sizes else "?"
  data = f"{os.path.basename(spec.sweep.config.split(':')[0])[:-3]} ({size} {spec.split})"
  m, moe = config.model, config.get("moe")
  layers = m.get("depth", m.get("num_layers"))
  model = f"{m.get('backbone', 'transformer')}, dim {m.dim}, {layers} layers"
  epochs = config.get("num_epochs")
  budget = f"{epochs} epochs" if epochs else f"{config.num_train_steps} steps"
  machine = record["provenance"]["machine"]
  return (
      data,
      model + (f", {moe.num_experts} experts" if moe else ""),
      budget,
      f"{len(spec.units()) // len(spec.row_values)} ({pair_units(spec)})",
      f"{machine['device']}, {machine['cpu_cores']} cores",
  )


def claim_scale() -> str:
  """One row per claim: its tables' data, model, budget, seeds and hardware, and its verdicts
  (`claim_verdicts`, as the claims table's)."""
  setups: dict[tuple[str, str], list[tuple[str, ...]]] = {}
  for _, spec, record in _claims_tables():
    setup = _setup(spec, record)
    for claim in spec.claims:
      setups.setdefault((spec.claim_text(claim), spec.column(claim.metric).label), []).append(setup)
  header = ["claim", "on", "data (examples)", "model", "budget", "per row", "hardware", "verdict"]
  rows = []
  for (claim, metric), by_verdict in claim_verdicts().items():
    counts = {word: len(by_verdict[word]) for word in _VERDICTS if word in by_verdict}
    verdicts = "; ".join(f"**{w}** on {n} table{'s' * (n > 1)}" for w, n in counts.items())
    columns = ("; ".join(dict.fromkeys(column)) for column in zip(*setups[claim, metric]))
    rows.append([claim, metric, *columns, verdicts])
  return _table(header, rows)


_SUMMARY_RENDERERS: dict[str, Any] = {
    RERUN_SUMMARY: rerun_summary,
    CLAIM_SUMMARY: claim_summary,
    VERDICT_SUMMARY: claim_scale,
    # docs/scaling.md's tables, from the preflight's records (imported only where a document marks
    # them: they bring the compile machinery).
    "preflight_paper": "paper_runner.preflight_table:render",
    "calibration": "paper_runner.calibration:table",
}


def _render_marked(name: str) -> str:
  """A marked table of a document: a generated summary, or the table `name` from its record."""
  renderer = _SUMMARY_RENDERERS.get(name)
  if isinstance(renderer, str):
    module, _, function = renderer.partition(":")
    renderer = getattr(importlib.import_module(module), function)
  return renderer() if renderer else render(load_table(name), read_record(name))


def write_doc(path: str) -> list[str]:
  """Renders every marked table of the markdown file `path` in place."""
  text = read_doc(path)
  rendered = replace_tables(text, path, _render_marked)
  write_atomically(os.path.realpath(path), rendered)  # Messages above name the path as given.
  return [table.name for table in marked_tables(text, path)]


def check_doc(path: str) -> list[str]:
  """Problems with the marked tables of `path`: a table that differs from its record's
  rendering (with the diff), a record that no longer matches its spec."""
  text = read_doc(path)
  problems = []
  tables = marked_tables(text, path)
  if not tables:
    problems.append(f"{path}: no marked table (<!-- table:NAME --> ... <!-- /table:NAME -->)")
  for table in tables:
    name, body = table.name, text[table.body_start : table.body_end]
    try:
      if name not in _SUMMARY_RENDERERS:
        for why in stale_runs(load_table(name), read_record(name)):
          problems.append(f"{path}: table {name}: the record is stale: {why}")
      expected = _render_marked(name)
    except UserError as e:
      problems.append(f"{path}: table {name}: {e}")
      continue
    if body != expected:
      both = (body.splitlines(True), expected.splitlines(True))
      diff = "".join(difflib.unified_diff(*both, "in the file", "rendered"))
      problems.append(f"{path}: table {name} differs from its record:\n{diff}")
  return problems
