"""`--reproduce`: rerun a record's first run and compare every recorded value (`reproduce`)."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
from typing import Any, Mapping

from paper_runner.collect import read_run
from paper_runner.provenance import data_hash, data_hashes, differences, machine, source_state
from paper_runner.spec import LOG, REPO_ROOT, format_value, grid_points, run_command
from paper_runner.supervise import run_one, sigterm_as_interrupt
from paper_runner.table_record import read_record, save_record
from paper_runner.table_spec import TableSpec, metric_value, record_path
from trainkit.distributed import child_environment
from trainkit.errors import UserError
from trainkit.workdir import CONFIG_FILE, move_aside

NOT_REPRODUCED = "not_reproduced"


def tolerances(run: Mapping[str, Any], runs: list[Mapping]) -> dict[str, tuple[float, str]]:
  """(tolerance, why) per value of the recorded `run` from its row's finished `runs`: a rerun that
  rounds otherwise is another draw, so sqrt(2) x the value's spread (its seeds' s.d., or with one
  seed the binomial sqrt(p(1-p)/n) of the run's n examples) x the normal quantile at which any
  of the k values fails by chance 5% of the time (Bonferroni); no spread: exact."""
  first, n = run["metrics"], run.get("examples") or 0
  z = statistics.NormalDist().inv_cdf(1 - 0.05 / (2 * max(len(first), 1)))
  found = {}
  for path, value in first.items():
    seen = [r["metrics"][path] for r in runs if r["metrics"].get(path) is not None]
    if len(seen) > 1:
      spread, why = statistics.stdev(seen), f"{len(seen)} seeds' s.d."
    elif value is not None and n and 0 <= value <= 1:
      spread, why = math.sqrt(value * (1 - value) / n), f"binomial, n={n}"
    else:
      spread, why = 0.0, "no spread recorded"
    found[path] = (z * math.sqrt(2) * spread, why)
  return found


def compare(
    recorded: Mapping[str, float | None],
    report: Mapping[str, Any],
    tolerance: float | Mapping[str, tuple[float, str]],
) -> tuple[bool, list[str], dict[str, Any]]:
  """(every recorded value within its tolerance in `report` -- `tolerance`, or per value
  `(tolerance, why)` from `tolerances` -- one line per value, the value that moved most: a
  difference of None, one side without a value, first)."""
  ok, worst = True, {}
  lines = [f"  {'value':<32} {'recorded':>22} {'reproduced':>22} {'tolerance':>30}  equal"]
  for path, value in recorded.items():
    limit, why = tolerance[path] if isinstance(tolerance, Mapping) else (tolerance, "")
    again = metric_value(report, path)
    both_none = value is None and again is None
    moved = None if value is None or again is None else abs(again - value)
    equal = both_none if moved is None else moved <= limit
    ok &= equal
    shown = f"{limit:.3g}" + (f" ({why})" if why else "")
    lines.append(
        f"  {path:<32} {value!r:>22} {again!r:>22} {shown:>30}  {'yes' if equal else 'NO'}"
    )
    largest = worst.get("difference", -1.0)
    if not both_none and largest is not None and (moved is None or moved > largest):
      worst = dict(value=path, recorded=value, reproduced=again, difference=moved)
  return ok, lines, worst


def reproduce(
    spec: TableSpec, record: Mapping[str, Any], workdir: str | None = None, stamp: bool = False
) -> tuple[bool, list[str]]:
  """Reruns the record's first run in `workdir/run` and compares every recorded value: exactly
  where the machine, software and data are the record's or those of an exact reproduction stamped
  in it (`comparison_basis`), else within each value's `tolerances`. With
  `stamp`, the result is added to the record's provenance, one stamp per machine: under
  `reproduced`, or under `not_reproduced` with the value that moved most (never a voucher). A
  failed rerun is a UserError; SIGTERM stops its process group and raises KeyboardInterrupt."""
  first = grid_points(spec.sweep)[0]
  row, seed = format_value(first[spec.rows]), spec.pair(first)
  recorded = [r for r in record["runs"] if r["row"] == row and r["seed"] == seed]
  if not recorded or recorded[0]["status"] != "ok":
    raise UserError(f"table {spec.name}: the record has no result for {row} seed {seed}")
  provenance = record["provenance"]
  differs_from_record, voucher = comparison_basis(provenance)
  why_not_exact = [] if voucher is not None else differs_from_record
  same_machine = not why_not_exact
  row_runs = [r for r in record["runs"] if r["row"] == row and r["status"] == "ok"]
  limits = 0.0 if same_machine else tolerances(recorded[0], row_runs)
  workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix=f"reproduce_{spec.name}_"))
  run_dir = os.path.join(workdir, "run")
  command = run_command(spec.sweep, first, run_dir)
  if voucher is not None:  # Not the recording machine: one an exact reproduction ran on.
    where = f"the machine, software and data of the exact reproduction of {voucher['date']}"
  elif same_machine:
    where = "the recording machine, software and data"
  else:
    where = "not the recording machine, software or data"
  shown = "0" if same_machine else "each value's, below"
  lines = [
      f"Reproducing table {spec.name}: {spec.label(row)}, seed {seed} ({where}; tolerance {shown})"
  ]
  lines += [f"  differs: {why}" for why in why_not_exact]
  lines.append("  python " + " ".join(command[1:]))
  if os.path.lexists(run_dir):
    # An earlier rerun's report.json and config.json would pass for this rerun's, and the main
    # would resume its checkpoints instead of training: kept aside, never reused.
    lines.append(f"  moved the earlier run directory {run_dir} aside to {move_aside(run_dir)}")
  not_done = "nothing was compared" + (" or stamped" if stamp else "")
  with sigterm_as_interrupt():
    env = child_environment({"PYTHONUNBUFFERED": "1"})
    ran, why = run_one(command, run_dir, timeout_s=0, cwd=REPO_ROOT, env=env)
  report = read_run(first, run_dir)
  if not ran or report.status != "ok":
    raise UserError(
        f"--reproduce={spec.name}: the rerun failed ({why or report.error}); its log: "
        f"{os.path.join(run_dir, LOG)}; {not_done}"
    )
  ok, compared, worst = compare(recorded[0]["metrics"], report.report, limits)
  exact = compare(recorded[0]["metrics"], report.report, 0.0)[0]
  verdict = "Reproduced" + (" (every value exact)." if exact else ".") if ok else "NOT reproduced."
  lines += compared + [f"{verdict} Run directory: {run_dir}"]
  if stamp:
    with open(os.path.join(run_dir, CONFIG_FILE)) as f:  # What this rerun read, for data hashes.
      config = json.load(f)
    entry = {
        "date": datetime.date.today().isoformat(),
        **source_state(REPO_ROOT),
        "machine": machine(),
        "data": data_hashes([config]),
        "exact": exact,
        "tolerance": 0.0,
        "differs_from_record": differs_from_record,
    }
    if not same_machine:  # Each value's, and the largest: the table says "within" it.
      entry["tolerances"] = {path: limit for path, (limit, _) in limits.items()}
      entry["tolerance"] = max(entry["tolerances"].values(), default=0.0)
    if not ok:  # A finished rerun that did not come back is a measurement: kept, not a voucher.
      entry["largest_difference"] = worst
    key = "reproduced" if ok else NOT_REPRODUCED
    stamped = read_record(spec.name)
    stamps = stamped["provenance"]
    # One stamp per machine, the latest: a failure withdraws an earlier pass and vice versa.
    for listed in ("reproduced", NOT_REPRODUCED):
      if listed in stamps:
        stamps[listed] = [r for r in stamps[listed] if r["machine"] != entry["machine"]]
    stamps.setdefault(key, []).append(entry)
    if not stamps.get(NOT_REPRODUCED, True):
      del stamps[NOT_REPRODUCED]  # Records that never failed keep their shape.
    save_record(spec.name, stamped)
    what = "reproduction" if ok else f"reproduction, under {NOT_REPRODUCED},"
    lines.append(f"Added the {what} to {os.path.relpath(record_path(spec.name), REPO_ROOT)}.")
  return ok, lines


def comparison_basis(provenance: Mapping[str, Any]) -> tuple[list[str], Mapping[str, Any] | None]:
  """How this machine, software and data differ from a record's `provenance`, and the stamped
  exact reproduction on this very machine and data that vouches for comparing exactly anyway."""
  differs = _why_not_exact(provenance)
  stamps = provenance.get("reproduced", ()) if differs else ()
  return differs, next((s for s in stamps if s.get("exact") and not _why_not_exact(s)), None)


def _why_not_exact(provenance: Mapping[str, Any]) -> list[str]:
  """How this machine, software and input data differ from a record's (or a stamp's)."""
  why = differences(provenance["machine"], machine(), "machine.")
  recorded_data = provenance.get("data")
  if recorded_data is None:
    return why + ["data: the record has no hashes of its input files"]
  found = {p: data_hash(p) if os.path.exists(p) else "<missing>" for p in recorded_data}
  return why + differences(recorded_data, found, "data ")
