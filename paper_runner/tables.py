r"""Results tables generated from specs: record a sweep's runs, write and check the tables, rerun one.

  python -m paper_runner.sweep  --sweep=results/NAME.py --workdir=DIR   # train the runs
  python -m paper_runner.tables --record=NAME --workdir=DIR             # results/records/NAME.json
  python -m paper_runner.tables --write=docs/results.md                 # every marked table
  python -m paper_runner.tables --check=docs/results.md                 # exit 1 if one differs
  python -m paper_runner.tables --reproduce=NAME [--workdir=DIR] [--tolerance=X]
  python -m paper_runner.tables --rerun=NAME --workdir=DIR              # add a rerun to the record
  python -m paper_runner.tables --references=NAME                       # score the reference rows
  python -m paper_runner.tables --list

A table spec is a sweep file under `results/` (`results/NAME.py`: its `get_config()` is the
sweep, see paper_runner/sweep.py) with a module-level `TABLE` saying how to tabulate its runs:

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
(paper_runner/stats.py), then the flags (too few seeds, a split or group too small), then the
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
runs, or the rows its claims compare with `paper_runner.sweep --only`) to the record's `reruns`,
with that sweep's own provenance; the table then says under its claims, per rerun, which
verdicts (and which tuning choice) the rerun keeps and the largest change of a mean paired
difference. In a document, `<!-- table:reruns -->` marks the summary of every table's reruns
(`rerun_summary`), `<!-- table:machines -->` every record's machine and stamped reproductions
(`machine_summary`), `verdicts` and `claims` the verdicts across tables; each is rendered and
checked with the tables.

The code, one job a module, each importing only the ones before it: paper_runner/table_spec.py
(the TABLE checked, the paths read of a report), table_references.py (the reference rows),
table_record.py (a record made, read and checked; reruns and references added to it),
table_summary.py (intervals, claims, accuracy gates, Holm), table_reruns.py (what a rerun
changes), table_render.py (one table's markdown), table_docs.py (the summaries across tables,
`--write` and `--check`) and table_reproduce.py (`--reproduce`, `--stamp`); this module is the
command line.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Mapping, Sequence

from absl import app, flags

from paper_runner.spec import REPO_ROOT
from paper_runner.table_docs import check_doc, write_doc
from paper_runner.table_record import (
    add_references,
    add_rerun,
    make_record,
    read_record,
    write_record,
)
from paper_runner.table_render import render
from paper_runner.table_reproduce import reproduce
from paper_runner.table_spec import load_table, record_path, table_names
from trainkit.errors import UserError, exit_on_user_error
from trainkit.platforms import skip_absent_accelerators


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
  # A record names this machine's devices: without an accelerator, skip the probes that print
  # the preflight extra's tracebacks (trainkit/platforms.py).
  skip_absent_accelerators()
  app.run(lambda argv: sys.exit(run(argv, {k: v.value for k, v in _FLAGS.items()})))
