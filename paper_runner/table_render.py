"""One table's markdown, rendered from its record alone (deterministic: `--check` compares it)."""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from paper_runner import stats
from paper_runner.collect import markdown_table
from paper_runner.spec import REPO_ROOT, format_value
from paper_runner.table_reproduce import NOT_REPRODUCED
from paper_runner.table_spec import EVERY_ROW, Column, TableSpec, pair_units, record_path
from paper_runner.table_summary import (
    chosen_row,
    leaks_of,
    machine_text,
    moved_verdicts,
    summarise,
)

_FOLDS_MEAN = re.compile(r", mean over \d+ \w+$")  # A reference name's suffix, not its reader's.


def _interval_text(interval: stats.Interval | None, c: Column, sign: bool = False) -> str:
  """`mean [low, high]` in the column's scale and decimals (`sign`: the mean's sign always), with
  a typographic minus; "—" for no interval."""
  if interval is None:
    return "—"
  text = f"{c.scale * interval.mean:{'+' if sign else ''}.{c.decimals}f}"
  if interval.low is not None:
    text += f" [{c.scale * interval.low:.{c.decimals}f}, {c.scale * interval.high:.{c.decimals}f}]"
  return text.replace("-", "−")


def _p_text(p: float) -> str:
  return "<0.001" if p < 0.001 else f"{p:.3f}"


def _reference_cell(reference: Mapping[str, Any], c: Column) -> str:
  value = reference["metrics"].get(c.path)
  low, high = (reference.get("ranges") or {}).get(c.path) or (None, None)
  return _interval_text(None if value is None else stats.Interval(value, low, high, 0), c)


def _claims_notes(spec: TableSpec, summary: Mapping[str, Any]) -> list[str]:
  """The paragraphs under a claims table."""
  column = spec.column
  notes = []
  gates = [gate for gate in summary["gates"] if gate]
  if gates:
    bars = {gate.path: gate.bar for gate in gates if gate.bar is not None}
    bar_text = "; ".join(
        f"{column(path).label} {column(path).scale * value:.{column(path).decimals}f} "
        f"({_FOLDS_MEAN.sub('', name)})"
        for path, (value, name) in bars.items()
    )
    untestable = sum(1 for gate in gates if not gate.above)
    notes.append(
        "**Claims need a model that learnt** (docs/protocol.md, section 3): a claim on a score "
        "(accuracy, BLEU) is decided only where a row's interval lies above the best score of a "
        "reference that reads no signal (chance at the upper end of its 95% range), a claim on "
        "a fairness metric only where both rows' accuracy interval on its split does"
        + (f": {bar_text}" if bar_text else "")
        + "; a claim on routing, gradients, the constraint or attention only where the claimed "
        "row's interval is clear of each control's (an untrained model's 95% range over seeds, "
        "a reference router's or uniform attention's value)"
        + f". {untestable} of the table's {len(gates)} gated claims are "
        f"**{stats.UNTESTABLE}**."
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
    named = ", ".join(spec.label(r) for r in leak.rows or ())
    rows = "every row" if leak.rows is None else f"the row{'s' * (len(leak.rows) > 1)} {named}"
    notes.append(
        f"**Selection leak {i + 1}** ({rows}; {marked} of the {len(summary['claims'])} verdicts "
        f"above are marked): {leak.why}"
    )
  return notes


def render(spec: TableSpec, record: Mapping[str, Any]) -> str:
  summary = summarise(spec, record)
  confidence = round(100 * stats.CONFIDENCE)
  interval = f"{confidence}% Student-t interval"
  if summary["ratio"] is not None:
    interval = (
        f"{confidence}% Nadeau–Bengio corrected resampled t-interval, test-to-train "
        f"{summary['ratio']:.3f}"
    )
  lines = [f"**{spec.title}** ({spec.split} split; mean [{interval}] over {pair_units(spec)})", ""]
  body = []
  for row, entry in summary["rows"].items():
    cells = [_interval_text(entry["cells"][c.path], c) for c in spec.columns]
    body.append([spec.label(row), *cells, str(len(entry["seeds"]))])
  for reference in record.get("references", ()):
    cells = [_reference_cell(reference, c) for c in spec.columns]
    draws = reference.get("draws")
    drawn = f"; mean [95% range] of {draws} seeded draws" if draws else ""
    body.append([f"*reference: {reference['name']}{drawn}*", *cells, "—"])
  lines += markdown_table(["", *(c.label for c in spec.columns), pair_units(spec)], body)
  if summary["claims"]:
    moved = moved_verdicts(spec, record)
    body = []
    for (claim, result), (holm_p, holm_verdict) in zip(summary["claims"], summary["holm"]):
      column = spec.column(claim.metric)
      few = "" if result.enough_seeds else " (too few seeds)"
      # A verdict a rerun does not reach is marked where it is read, not only below the table.
      notes = [f"a rerun: {moved[claim]}"] if claim in moved else []
      if result.verdict == stats.UNDECIDED and result.detectable is not None:
        detectable = stats.Interval(result.detectable, None, None, 1)
        notes.append(f"detectable: {_interval_text(detectable, column)}")
      notes += ["selection leak"] if leaks_of(spec, claim) else []
      verdict = f"**{result.verdict}{few}**" + (f" ({'; '.join(notes)})" if notes else "")
      # The leak is marked once, beside the raw verdict.
      adjusted = f"**{holm_verdict}{few}**" + ("" if holm_p is None else f" ({_p_text(holm_p)})")
      difference = _interval_text(result.difference, column, sign=True)
      p = _p_text(result.p) if result.difference else "—"
      body.append([spec.claim_text(claim), column.label, difference, str(len(result.seeds)), p])
      body[-1] += [verdict, adjusted]
    header = ["claim", "on", f"paired difference [{confidence}% interval]", "pairs", "p"]
    lines += ["", *markdown_table([*header, "verdict", "Holm-adjusted verdict (adjusted p)"], body)]
  best = chosen_row(spec, summary) if spec.select else None
  if best is not None:
    rule = f"the highest mean {spec.column(spec.select).label}"
    if spec.select_within:
      path, margin = spec.select_within
      guard = spec.column(path)
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
  if "provenance" in record:  # A sweep's own table (paper_runner.fairmoe.compare) has none.
    lines += ["", _provenance_line(spec, record["provenance"])]
  return "\n".join(lines) + "\n"


def _provenance_line(spec: TableSpec, p: Mapping[str, Any]) -> str:
  m, changes = p["machine"], p.get("uncommitted_changes")
  commit = p["commit"] + (f" with uncommitted changes to {', '.join(changes)}" if changes else "")
  processor = f", {m['processor']['model']}" if "processor" in m else ""  # Older records: none.
  hashed = "input file(s) or folder(s) hashed"
  parts = [
      f"commit {commit}",
      f"runs of {p['date']}",
      f"{m['device']}, {m['cpu_cores']} CPU cores ({m['arch']}{processor}), "
      f"{m['devices']} device(s), JAX {m['jax']}",
      *([f"{len(p['data'])} {hashed} in the record"] if p.get("data") else []),
      *(_stamp_text(r, hashed) for r in (*p.get("reproduced", ()), *p.get(NOT_REPRODUCED, ()))),
      f"seeds {', '.join(map(str, p['seeds']))}",
      f"spec `{spec.path}`, record `{os.path.relpath(record_path(spec.name), REPO_ROOT)}`",
      *(f"`{c}`" for c in p["commands"]),
  ]
  return f"<sub>Provenance: {'; '.join(parts)}.</sub>"


def _stamp_text(stamp: Mapping[str, Any], hashed: str) -> str:
  """A stamped reproduction: its outcome, whether on the recording machine (older stamps do not
  say), and a failed one's value that moved most, recorded and again."""
  if "largest_difference" in stamp:
    moved = stamp["largest_difference"]
    values = [
        "no value" if v is None else format(v, ".6g")
        for v in (moved["recorded"], moved["reproduced"])
    ]
    outcome = f"not reproduced, beyond {stamp['tolerance']:g}"
    detail = f"; `{moved['value']}` {values[0]} recorded, {values[1]} again"
  else:
    outcome = "reproduced " + ("exactly" if stamp["exact"] else f"within {stamp['tolerance']:g}")
    detail = ""
  where = ""
  if "differs_from_record" in stamp:
    keys = list(dict.fromkeys(why.split(":", 1)[0] for why in stamp["differs_from_record"]))
    where = " on the recording machine, software and data"
    if keys:
      where = f" on another machine, software or data (differs in {', '.join(keys)})"
  return (
      f"first run {outcome}{where} on {stamp['date']} (commit {stamp['commit']}; "
      f"{machine_text(stamp['machine'])}; {len(stamp['data'])} {hashed}{detail})"
  )
