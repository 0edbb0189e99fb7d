r"""Command line: run a grid of trainings (any package's main) and tabulate and plot the results.

  python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py:steps=50 --workdir=/tmp/sweep

A sweep file is a Python file whose `get_config(arg=None)` returns a ConfigDict (or a dict):

  from paper_runner.spec import dotted
  from trainkit.config import parse_arg

  def get_config(arg=None):
    arg = parse_arg(arg, steps=350)
    return ml_collections.ConfigDict(dict(
        module="fairmoe_jax.main",           # Run as `python -m module`.
        config="configs/quickstart.py",      # Its --config (repo-relative or absolute; :args too).
        grid=dotted({                        # Runs: the Cartesian product, in this key order.
            "batch_size": (64, 128),
            "method": ("vanilla_smoe", "fairsmoe@fair.specialization=class_routing"),
            "seed": (0, 1),
        }),
        overrides=dotted({"num_train_steps": arg.steps}),  # Applied to every run.
        row_settings=(("method", "vanilla_smoe", "moe.top_k=1"),),  # Optional: a value's runs.
        metrics=("accuracy", "mf.pqd"),      # Dotted paths into each run's report.json.
        throughput_keys=("examples_per_second", "tokens_per_second", "mfu"),  # Optional.
        timeout_s=0,                         # Optional: seconds per run, 0 = none.
        tables=("paper_runner.fairmoe.paper_table:write_comparison",),  # Optional: table collectors.
    ))

`dotted()` keeps dotted keys in order (a ConfigDict sorts keys and rejects dots). Each run
trains in `<workdir>/runs/<name>`, named by its grid values (`batch_size=64,method=vanilla_smoe,
seed=0`). A grid value `VALUE@KEY=X@KEY2=Y` also passes `--config.KEY=X --config.KEY2=Y` to its
runs (over an override of the same key; never a grid key); `row_settings` passes its settings to
the runs of one grid value without renaming them (a search's choice at the paper's scale,
paper_runner/paper_scale.py). `tables` collectors,
`"module:function"`, are imported when the sweep loads and called after collecting as
`function(workdir, runs) -> [paths written]` with one `paper_runner.collect.RunResult` per run.

Modes (`--mode`; docs/scaling.md, "Sweeps"):
  run       (default) the runs one after another as subprocesses, then collect. A finished run
            is skipped only if its `sweep_run.json` and `config.json` match what the spec gives
            now; else an error names the changed keys (`--retrain` moves it aside). A failed
            run leaves `error.txt` and is retried next time. `--dry_run` (or `--dry-run`)
            prints the commands and a time estimate (paper_runner/sweep_estimate.py).
  commands  `<workdir>/commands.sh`, one line per run, optionally behind `--launcher=...`
            (a local or gs:// workdir).
  collect   `sweep.csv`, `sweep.md`, `sweep.json`, `plots/`, then the `tables` collectors.

`--only=KEY=VALUE` (repeatable) keeps the runs whose grid value of KEY is one of the VALUEs
given for it (written as the run names write them), e.g. the rows a results table's claims
compare: `--only=method=fairsmoe --only=method=vanilla_smoe`. The runs keep their names, so a
later full sweep in the same workdir reuses them. Their tables, plots and collectors' files go
to `<workdir>/only-KEY=VALUE,.../`, never over the full sweep's `sweep.md/.csv/.json`.

The exit status is 1 when a run has no report.json (the tables are still written), 2 for a bad
sweep or flag, 130 when interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import shlex
import sys
from typing import Mapping, Sequence

import ml_collections
from absl import app, flags

from paper_runner.collect import collect, table_rows, write_spec_tables, write_tables
from paper_runner.commands import write_commands
from paper_runner.plots import write_plots
from paper_runner.spec import REPO_ROOT, format_value, load_sweep, safe_name
from paper_runner.supervise import Differences, run_sweep
from trainkit import storage
from trainkit.config_files import resolve_config_args
from trainkit.errors import UserError, exit_on_user_error, fail

MODES = ("run", "commands", "collect")


def restrict_grid(sweep: ml_collections.ConfigDict, only: Sequence[str]) -> None:
  """Keeps, per grid key named in `only` ("KEY=VALUE" each), the values given for it, in the
  grid's order; a UserError names an unknown key or value."""
  wanted: dict[str, list[str]] = {}
  for item in only:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise UserError(f"--only={item}: not KEY=VALUE")
    if key not in sweep.grid:
      raise UserError(
          f"--only={item}: {key!r} is not a grid key; grid keys: {', '.join(sweep.grid)}"
      )
    values = [format_value(v) for v in sweep.grid[key]]
    if value not in values:
      raise UserError(
          f"--only={item}: {value!r} is not a value of {key}; values: {', '.join(values)}"
      )
    wanted.setdefault(key, []).append(value)
  for key, values in wanted.items():
    sweep.grid[key] = tuple(v for v in sweep.grid[key] if format_value(v) in values)


def execute_sweep(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    *,
    mode: str = "run",
    launcher: Sequence[str] = (),
    dry_run: bool = False,
    retrain: bool = False,
    env: Mapping[str, str] | None = None,
    sweep_path: str = "",
    differences: Differences | None = None,
    cwd: str = REPO_ROOT,
    subset_dir: str = "",
) -> int:
  """Runs, writes the commands of, or collects a validated sweep; returns the exit status.

  For front ends that build the spec themselves (`paper_runner.fairmoe.compare`); `execute` is the
  command line's way in. `sweep_path` names the sweep in the tables' titles; `differences`
  is `supervise.run_sweep`'s test of whether a finished run is stale, and `cwd` the directory
  the runs start in (relative paths in the config and its flags are read from there).
  `subset_dir`, for a sweep restricted to some of its runs (`--only`), is the folder under the
  workdir its tables, plots and collectors' files go to, so the full sweep's are kept.
  """
  if mode == "run" and storage.is_remote(workdir):
    # The runner gives each run's output a local log file, keeps its state beside it and moves
    # stale runs aside by renaming them: none of it goes through the path library.
    raise UserError(
        f"--workdir={workdir}: --mode=run runs the sweep on this machine, in a local directory; "
        "for a sweep on gs:// (a TPU pod's shared workdir) write its commands with "
        "--mode=commands (then `gcloud storage cat WORKDIR/commands.sh | launch/tpu_pod.sh ... "
        "--commands -`), and tabulate the runs with --mode=collect"
    )
  workdir = storage.resolve(workdir)  # A local directory, or gs:// for commands and collect.
  if mode == "commands":
    print(write_commands(sweep, workdir, launcher, sweep_path))
    return 0
  if mode == "run":
    run_sweep(
        sweep, workdir, dry_run=dry_run, retrain=retrain, env=env, cwd=cwd, differences=differences
    )
    if dry_run:
      return 0
  storage.makedirs(workdir)
  results = collect(sweep, workdir)
  rows = table_rows(sweep, results)
  # The runs are read from the workdir; a subset's tables are written beside, not over, the
  # full sweep's.
  tables_dir = storage.join(workdir, subset_dir) if subset_dir else workdir
  storage.makedirs(tables_dir)
  print("\n" + write_tables(sweep, tables_dir, rows, sweep_path))
  plots = write_plots(sweep, tables_dir, rows)
  print(f"Wrote {tables_dir}/sweep.csv, sweep.md, sweep.json and {len(plots)} plot(s) in plots/")
  if subset_dir:
    print(
        f"--only: these are the tables of {len(results)} of the sweep's runs, in {tables_dir}; "
        f"{workdir}/sweep.md, sweep.csv, sweep.json and plots/ are left as they were"
    )
  for path in write_spec_tables(sweep, tables_dir, results):
    print(f"Wrote {path}")
  missing = [r for r in results if r.status != "ok"]
  for result in missing:
    print(f"{result.name}: {result.status}: {result.error}")
  if missing:
    print(f"{len(missing)} run(s) without a usable report.json; rerun --mode=run to retry them.")
  return 1 if missing else 0


def execute(
    sweep_path: str,
    workdir: str,
    *,
    mode: str = "run",
    launcher: str = "",
    dry_run: bool = False,
    retrain: bool = False,
    env: Mapping[str, str] | None = None,
    only: Sequence[str] = (),
) -> int:
  """The command line's work; returns the exit status (1 when a run has no report.json)."""
  if mode not in MODES:
    raise UserError(f"--mode: unknown mode {mode!r}; choose from {', '.join(MODES)}")
  if not workdir:
    raise UserError("--workdir is required")
  if dry_run and mode != "run":
    raise UserError("--dry_run only applies to --mode=run")
  try:
    launcher_words = shlex.split(launcher)
  except ValueError as e:
    raise UserError(f"--launcher: {e}") from None
  if launcher_words and mode != "commands":
    raise UserError("--launcher only applies to --mode=commands")
  sweep = load_sweep(sweep_path)
  restrict_grid(sweep, only)
  return execute_sweep(
      sweep,
      workdir,
      mode=mode,
      launcher=launcher_words,
      dry_run=dry_run,
      retrain=retrain,
      env=env,
      sweep_path=sweep_path,
      # The folder of the tables of the runs --only keeps: only-KEY=VALUE,... in the order given.
      subset_dir=safe_name("only-" + ",".join(only)) if only else "",
  )


def _define_flags() -> dict[str, flags.FlagHolder]:
  """The command line's flags, defined only when run as a script: front ends such as
  paper_runner.fairmoe.compare import this module and define flags of the same names (--workdir)."""
  holders = dict(
      sweep=flags.DEFINE_string("sweep", None, "Sweep file, optionally `file.py:arg`."),
      workdir=flags.DEFINE_string(
          "workdir", None, "Directory of the sweep: runs/, tables, plots/."
      ),
      mode=flags.DEFINE_string("mode", "run", f"One of {', '.join(MODES)}."),
      launcher=flags.DEFINE_string(
          "launcher", "", 'commands mode: prefix of each line, e.g. "launch/slurm.sh --nodes 2 --".'
      ),
      dry_run=flags.DEFINE_bool(
          "dry_run",
          False,
          "run mode: print the commands, the number of runs and an estimate of their time; run "
          "nothing (--dry-run works too).",
      ),
      retrain=flags.DEFINE_bool(
          "retrain",
          False,
          "run mode: move finished runs started with other settings aside and run them again "
          "(without it they are an error).",
      ),
      only=flags.DEFINE_multi_string(
          "only", [], "KEY=VALUE: run only the grid points with one of these values of KEY."
      ),
  )
  flags.mark_flags_as_required(["sweep", "workdir"])
  return holders


def dashed_flag_names(argv: Sequence[str]) -> list[str]:
  """`argv` with `--dry-run` (the launchers' spelling; `--nodry-run`, `--dry-run=false` too)
  written `--dry_run`, absl's; arguments after `--` are left alone."""
  out = list(argv[:1])
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      out.extend(argv[i:])
      break
    for prefix in ("--", "-", "--no", "-no"):
      flag = prefix + "dry-run"
      if arg == flag or arg.startswith(flag + "="):
        arg = prefix + "dry_run" + arg[len(flag) :]
        break
    out.append(arg)
  return out


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(resolve_config_args(dashed_flag_names(argv)))
  except flags.Error as e:
    fail(str(e))


def main(argv: list[str], holders: dict[str, flags.FlagHolder]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    status = exit_on_user_error(execute)(
        holders["sweep"].value,
        holders["workdir"].value,
        mode=holders["mode"].value,
        launcher=holders["launcher"].value,
        dry_run=holders["dry_run"].value,
        retrain=holders["retrain"].value,
        only=holders["only"].value,
    )
  except KeyboardInterrupt:  # The running run got SIGTERM and checkpointed; rerun resumes.
    sys.exit(130)
  sys.exit(status)


if __name__ == "__main__":
  _HOLDERS = _define_flags()
  app.run(lambda argv: main(argv, _HOLDERS), flags_parser=_parse_flags)
