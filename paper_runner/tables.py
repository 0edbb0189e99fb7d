r"""Results tables generated from specs: record a sweep's runs, write and check the tables, rerun one.

  python -m paper_runner.sweep  --sweep=results/NAME.py --workdir=DIR   # train the runs
  python -m paper_runner.tables --record=NAME --workdir=DIR             # results/records/NAME.json
  python -m paper_runner.tables --write=docs/results.md                 # every marked table
  python -m paper_runner.tables --check=docs/results.md                 # exit 1 if one differs
  python -m paper_runner.tables --reproduce=NAME [--workdir=DIR] [--stamp]
  python -m paper_runner.tables --rerun=NAME --workdir=DIR              # add a rerun to the record
  python -m paper_runner.tables --references=NAME                       # score the reference rows
  python -m paper_runner.tables --estimate=NAME --scale=paper --target=h100x8  # device-hours

A spec is a sweep file `results/NAME.py` with a `TABLE` (keys: docs/running.md); its record
holds all a table renders from (statistics: docs/protocol.md section 3).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Sequence

from absl import app, flags

from paper_runner.paper_scale import paper_estimate
from paper_runner.spec import REPO_ROOT
from paper_runner.table_docs import check_doc, write_doc
from paper_runner.table_record import add_references, add_rerun, read_record, write_record
from paper_runner.table_render import render
from paper_runner.table_reproduce import reproduce
from paper_runner.table_spec import load_table
from trainkit.errors import UserError, exit_on_user_error

MODES = ("record", "rerun", "references", "write", "check", "reproduce", "estimate")


def _define_flags() -> dict[str, flags.FlagHolder]:
  """Defined only when run as a script: front ends that import this module define --workdir."""
  strings = dict(
      record="Table name, or NAME:scale=paper,data=ROOT: record its sweep in --workdir.",
      rerun="Table name: add the finished runs of its sweep in --workdir to its record's reruns.",
      references="Table name: score its spec's reference readers into its record.",
      write="Markdown file whose marked tables to render.",
      check="Markdown file whose marked tables to check.",
      reproduce="Table name: rerun the first seed of its first row.",
      estimate="Table name: the device-hours of its runs and equal tuning budgets at --scale on "
      "--target, from the preflight (docs/reproducing.md).",
      scale="--estimate: paper, the scale the preflight compiled.",
      target="--estimate: the preflight target (h100x1, h100x8, v5e-16, v4-32).",
      workdir="--record, --rerun: the sweep's workdir; --reproduce: where to rerun "
      "(default: a temporary directory).",
  )
  return dict(
      **{name: flags.DEFINE_string(name, None, text) for name, text in strings.items()},
      stamp=flags.DEFINE_bool(
          "stamp", False, "--reproduce: add a passing reproduction to the record's provenance."
      ),
  )


@exit_on_user_error
def run(argv: Sequence[str], f: Mapping[str, Any]) -> int:
  """The command line's work on the parsed flag values `f`; returns the exit status."""
  if len(argv) > 1:
    raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  given = [m for m in MODES if f.get(m)]
  if len(given) != 1:
    raise UserError("give exactly one of " + ", ".join(f"--{m}" for m in MODES))
  mode, target = given[0], f[given[0]]
  if f.get("stamp") and mode != "reproduce":  # Else ignored without a word.
    raise UserError(f"--stamp only applies to --reproduce, not --{mode}")
  if mode in ("record", "rerun") and not f.get("workdir"):
    raise UserError(f"--{mode} needs --workdir, the directory the sweep ran in")
  if mode == "write":
    names = write_doc(target)
    print(f"Rendered {len(names)} table(s) in {target}: {', '.join(names)}")
    return 0
  if mode == "check":
    problems = check_doc(target)
    print("\n".join(problems) or f"Every marked table of {target} matches its record.")
    return 1 if problems else 0
  spec = load_table(target)
  if mode == "estimate":
    print("\n".join(paper_estimate(spec.path, spec.rows, f.get("scale"), f.get("target"))))
    return 0
  if mode == "reproduce":
    try:
      ok, lines = reproduce(spec, read_record(spec.name), f.get("workdir"), bool(f.get("stamp")))
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: `reproduce` has stopped the rerun.
      print(
          f"error: --reproduce={spec.name}: interrupted; the rerun was stopped, nothing was "
          "compared or stamped",
          file=sys.stderr,
      )
      return 130
    print("\n".join(lines))
    return 0 if ok else 1
  if mode == "references" and not spec.references:
    raise UserError(f"results/{spec.name}.py: TABLE has no 'references' to score")
  written = {"record": write_record, "rerun": add_rerun}.get(mode)
  path = written(spec, f["workdir"]) if written else add_references(spec)
  print(f"Wrote {os.path.relpath(path, REPO_ROOT)}")
  print(render(spec, read_record(spec.name)))
  return 0


if __name__ == "__main__":
  _FLAGS = _define_flags()
  app.run(lambda argv: sys.exit(run(argv, {k: v.value for k, v in _FLAGS.items()})))
