r"""Command line: run a grid of trainings (any package's main) and tabulate and plot the results.

  python -m trainkit.sweep --sweep=configs/sweeps/batch_experts.py:steps=50 --workdir=/tmp/sweep

A sweep file is a Python file whose `get_config(arg=None)` returns a ConfigDict (or a dict):

  from trainkit.config import parse_arg
  from trainkit.sweep import dotted

  def get_config(arg=None):
    arg = parse_arg(arg, steps=350)
    return ml_collections.ConfigDict(dict(
        module="fairmoe_jax.main",           # Run as `python -m module`.
        config="configs/quickstart.py",      # Its --config (repo-relative or absolute, may have :args).
        grid=dotted({                        # Runs: the Cartesian product, in this key order.
            "batch_size": (64, 128),
            "moe.num_experts": (4, 8),
            "seed": (0, 1),
        }),
        overrides=dotted({"num_train_steps": arg.steps}),  # Applied to every run.
        metrics=("accuracy", "mf.pqd"),      # Dotted paths into each run's report.json.
        throughput_keys=("examples_per_second", "tokens_per_second", "mfu"),  # Optional.
        timeout_s=0,                         # Optional: seconds per run, 0 = none.
    ))

`dotted()` keeps dotted keys and their order, which a plain dict inside a ConfigDict does not
(ml_collections sorts keys and rejects dots); nested dicts (`{"moe": {"num_experts": ...}}`) are
flattened to dotted keys too. Each run trains in `<workdir>/runs/<name>`, its name made from its
grid values (`batch_size=64,moe.num_experts=4,seed=0`), with
`--config.<key>=<value>` flags for the overrides and its grid values.

Modes (`--mode`):
  run       (default) runs the runs one after the other as subprocesses of this machine, each
            logging to `<run dir>/log.txt`. A run whose report.json exists is skipped if it was
            started with the same settings (`sweep_run.json`; otherwise the sweep stops with
            an error before running anything, or with `--retrain` moves it aside), and an
            interrupted one resumes from its checkpoint, so rerunning the command resumes the
            sweep; a failed run (non-zero exit or `timeout_s`) leaves `error.txt`, is retried
            next time and does not stop the others. Then collects. `--dry_run` only prints the
            commands.
  commands  writes `<workdir>/commands.sh`, one line per run, for a cluster. With
            `--launcher="launch/slurm.sh --nodes 2 --gpus-per-node 8 --"` each line is
              launch/slurm.sh --nodes 2 --gpus-per-node 8 --module fairmoe_jax.main -- \
                  --config=configs/quickstart.py --workdir=<workdir>/runs/<name> --config.k=v ...
            (`--module` is added for the repo's launchers when the launcher string lacks it;
            `launch/tpu_pod.sh --name pod --zone Z --accelerator v5litepod-16 --` works alike).
            Without a launcher each line is `python -m module ...`.
  collect   only collects: `<workdir>/sweep.csv`, `sweep.md` and `sweep.json` (one row per run:
            grid values, status ok/failed/missing, the metrics, and per throughput key the
            median over the second half of the logged steps, after compilation), and
            `<workdir>/plots/<metric>_vs_<key>.png` (mean ± std over seeds, one line per
            combination of the other keys).

The exit status is 1 when a run has no report.json (the tables are still written), 2 for a bad
sweep or flag.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

import ml_collections
import numpy as np
from absl import app, flags

from trainkit.config_files import resolve_config_args
from trainkit.errors import UserError, exit_on_user_error, fail
from trainkit.metric_writers import read_metrics
from trainkit.workdir import config_differences, move_aside, stale_runs_error

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("run", "commands", "collect")
DEFAULT_THROUGHPUT_KEYS = ("examples_per_second", "tokens_per_second", "mfu")
SWEEP_KEYS = ("module", "config", "grid", "overrides", "metrics", "throughput_keys", "timeout_s")
# The repo's launchers take `--module M` before their `--`; without it they run fairmoe_jax.main.
MODULE_LAUNCHERS = ("slurm.sh", "tpu_pod.sh", "local_multiprocess.sh")
REPORT, ERROR, LOG = "report.json", "error.txt", "log.txt"
RUN = "sweep_run.json"  # What a run was started with: module, config and every override.
ERROR_LOG_LINES = 30
# A timed-out or interrupted run gets SIGTERM first (the mains checkpoint on it), then SIGKILL.
TERMINATE_GRACE_S = 60
_NAME_LIMIT = 200  # Below the usual 255-byte file-name limit.


class SweepError(UserError):
  """A sweep key is missing, has a wrong type or an impossible value."""

  def __init__(self, key: str, message: str):
    self.key = key
    super().__init__(f"sweep key '{key}': {message}")


def dotted(mapping: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A ConfigDict that accepts dotted keys and keeps their order (for `grid` and `overrides`)."""
  return ml_collections.ConfigDict(dict(mapping), allow_dotted_keys=True, sort_keys=False)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in mapping.items():
    key = f"{prefix}{key}"
    if isinstance(value, Mapping) or isinstance(value, ml_collections.ConfigDict):
      flat.update(_flatten(value, f"{key}."))
    else:
      flat[key] = value
  return flat


def _is_scalar(value: Any) -> bool:
  return value is None or isinstance(value, (bool, int, float, str))


def _check_value(key: str, value: Any) -> Any:
  """A value a `--config.key=value` flag can carry: a scalar or a tuple of scalars."""
  if isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value):
    return tuple(value)
  if not _is_scalar(value):
    raise SweepError(key, f"value {value!r} is not a number, string, bool, None or tuple of them")
  return value


def validate_sweep(raw: Any) -> ml_collections.ConfigDict:
  """Checks a sweep definition and returns it normalised (grid and overrides as `dotted`)."""
  if not isinstance(raw, (Mapping, ml_collections.ConfigDict)):
    raise UserError(f"get_config() must return a ConfigDict or dict, got {type(raw).__name__}")
  raw = dict(raw.items())
  unknown = [k for k in raw if k not in SWEEP_KEYS]
  if unknown:
    raise SweepError(unknown[0], f"unknown key; known: {', '.join(SWEEP_KEYS)}")
  for key in ("module", "config"):
    if not isinstance(raw.get(key), str) or not raw[key].strip():
      raise SweepError(key, "required, a non-empty string")
  if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", raw["module"]):
    raise SweepError("module", f"{raw['module']!r} is not a dotted module name")

  if not isinstance(raw.get("grid"), (Mapping, ml_collections.ConfigDict)):
    raise SweepError("grid", "required, a mapping from dotted config keys to lists of values")
  grid = {}
  for key, values in _flatten(raw["grid"]).items():
    if not isinstance(values, (list, tuple)) or not values:
      raise SweepError(f"grid.{key}", "must be a non-empty list")
    values = [_check_value(f"grid.{key}", v) for v in values]
    duplicates = [v for i, v in enumerate(values) if v in values[:i]]
    if duplicates:
      raise SweepError(f"grid.{key}", f"value {duplicates[0]!r} is listed twice")
    grid[key] = values
  if not grid:
    raise SweepError("grid", "must name at least one config key")

  overrides_raw = raw.get("overrides") or {}
  if not isinstance(overrides_raw, (Mapping, ml_collections.ConfigDict)):
    raise SweepError("overrides", "must be a mapping from dotted config keys to values")
  overrides = {}
  for key, value in _flatten(overrides_raw).items():
    if key in grid:
      raise SweepError(f"overrides.{key}", "is also a grid key; keep it in one place")
    overrides[key] = _check_value(f"overrides.{key}", value)

  sweep = ml_collections.ConfigDict()
  sweep.module, sweep.config = raw["module"].strip(), raw["config"].strip()
  sweep.grid, sweep.overrides = dotted(grid), dotted(overrides)
  for key, default in (("metrics", ()), ("throughput_keys", DEFAULT_THROUGHPUT_KEYS)):
    value = raw.get(key, default)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise SweepError(key, f"must be a list of strings, got {value!r}")
    if not all(isinstance(v, str) and v for v in value):
      raise SweepError(key, f"must be a list of non-empty strings, got {value!r}")
    sweep[key] = tuple(value)
  timeout = raw.get("timeout_s") or 0
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
    raise SweepError("timeout_s", f"must be a non-negative number of seconds, got {timeout!r}")
  sweep.timeout_s = float(timeout)
  return sweep


def _resolve(path: str) -> str:
  """A path as given (absolute or from the current directory), else relative to the repo root."""
  if os.path.isabs(path) or os.path.exists(path):
    return os.path.abspath(path)
  return os.path.join(REPO_ROOT, path)


def load_sweep(path_with_args: str) -> ml_collections.ConfigDict:
  """Loads `file.py[:arg]`, calls its `get_config(arg)` and validates the result."""
  path, sep, arg = path_with_args.partition(":")
  resolved = _resolve(path)
  if not path or not os.path.isfile(resolved):
    raise UserError(f"--sweep: no such file {path!r}")
  spec = importlib.util.spec_from_file_location(f"_sweep_{abs(hash(resolved))}", resolved)
  try:
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    raw = module.get_config(arg) if sep else module.get_config()
  except UserError:
    raise
  except Exception as e:  # Any mistake inside the sweep file is the user's; say where.
    raise UserError(f"cannot load sweep {path_with_args}: {type(e).__name__}: {e}") from None
  return validate_sweep(raw)


def grid_points(sweep: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """The runs: the Cartesian product of the grid, the first key varying slowest."""
  keys = list(sweep.grid.keys())
  return [dict(zip(keys, values)) for values in itertools.product(*sweep.grid.values())]


def format_value(value: Any) -> str:
  """A value as a `--config.key=` flag writes it, so ml_collections parses it back."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    value = tuple(value)
  return repr(value)  # bool -> True/False, None -> None, numbers and tuples round-trip.


def _safe(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._=,-]", "_", text)


def run_name(point: Mapping[str, Any]) -> str:
  """`key=value,...` in grid order, with characters unsafe in a file name replaced by '_'."""
  name = _safe(",".join(f"{k}={format_value(v)}" for k, v in point.items()))
  if len(name) > _NAME_LIMIT:  # Still readable at the front, unique by the hash.
    name = f"{name[:_NAME_LIMIT - 11]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
  return name


def run_dir(workdir: str, point: Mapping[str, Any]) -> str:
  return os.path.join(os.path.abspath(workdir), "runs", run_name(point))


def run_command(
    sweep: ml_collections.ConfigDict,
    point: Mapping[str, Any],
    run_dir: str,
    launcher: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
  """The argv of one run: `python -m module` (or the launcher), then the main's flags."""
  settings = {**sweep.overrides, **point}
  args = [f"--config={sweep.config}", f"--workdir={run_dir}"]
  args += [f"--config.{k}={format_value(v)}" for k, v in settings.items()]
  if not launcher:
    return [python, "-m", sweep.module, *args]
  launcher = list(launcher)
  if (
      os.path.basename(launcher[0]) in MODULE_LAUNCHERS
      and "--module" not in launcher
      and "--" in launcher
  ):
    at = len(launcher) - 1 - launcher[::-1].index("--")
    launcher[at:at] = ["--module", sweep.module]
  return [*launcher, *args]


def _check_names(sweep: ml_collections.ConfigDict, points: list[dict[str, Any]]) -> None:
  seen: dict[str, dict[str, Any]] = {}
  for point in points:
    name = run_name(point)
    if name in seen:
      raise SweepError("grid", f"runs {seen[name]} and {point} get the same directory {name!r}")
    seen[name] = point


def _tail(path: str, lines: int) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def _terminate(process: subprocess.Popen) -> None:
  """SIGTERM to the run's process group (the main checkpoints), SIGKILL after a grace period."""
  for sig, wait_s in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, 10)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(timeout=wait_s)
      return
    except subprocess.TimeoutExpired:
      continue


def _run_one(
    command: list[str], directory: str, *, timeout_s: float, cwd: str, env: Mapping[str, str]
) -> tuple[bool, str]:
  """Runs one command, logging to log.txt; returns (ok, why not)."""
  os.makedirs(directory, exist_ok=True)
  log_path = os.path.join(directory, LOG)
  with open(log_path, "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n")
    log.flush()
    # A session of its own, so a timeout can stop the run's whole process tree.
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
      code = process.wait(timeout=timeout_s or None)
      why = "" if code == 0 else f"exit code {code}"
    except subprocess.TimeoutExpired:
      _terminate(process)
      why = f"timeout after {timeout_s:g} s (exit code {process.returncode})"
    except KeyboardInterrupt:
      _terminate(process)  # The main checkpoints on SIGTERM, so a rerun resumes it.
      raise
  if not why and not os.path.exists(os.path.join(directory, REPORT)):
    why = "exit code 0 but no report.json"
  error_path = os.path.join(directory, ERROR)
  if why:
    with open(error_path, "w") as f:
      f.write(f"{why}\n\nlast {ERROR_LOG_LINES} lines of {log_path}:\n")
      f.write(_tail(log_path, ERROR_LOG_LINES))
  elif os.path.exists(error_path):  # A retry that succeeded: the old error no longer applies.
    os.remove(error_path)
  return not why, why


def run_record(sweep: ml_collections.ConfigDict, point: Mapping[str, Any]) -> dict[str, Any]:
  """What decides a run's result, as written to its RUN file and compared on a rerun."""
  settings = {**sweep.overrides, **point}
  return {
      "module": sweep.module,
      "config": sweep.config,
      "settings": {k: format_value(v) for k, v in settings.items()},
  }


def _recorded_run(directory: str) -> dict[str, Any]:
  try:
    with open(os.path.join(directory, RUN)) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {"record": "missing"}  # Cannot be checked, so it is not reused.


def run_sweep(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    *,
    dry_run: bool = False,
    retrain: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str = REPO_ROOT,
) -> dict[str, str]:
  """Runs every run without a report.json, in order; returns {name: ok|failed|skipped}.

  A finished run started with another command (its RUN record) is an error before anything
  runs, or with `retrain` is moved aside (`<run>.stale-<n>`) and run again.

  `env` adds to this process's environment (the runs inherit it, XLA_FLAGS included).
  """
  base = sweep.config.partition(":")[0]
  if not os.path.isfile(os.path.join(cwd, base)):
    raise SweepError("config", f"no such file {base!r} (relative to {cwd})")
  points = grid_points(sweep)
  _check_names(sweep, points)
  run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
  # A finished run is reused only if it ran the command asked for now (its RUN record).
  stale = []
  for point in points:
    directory = run_dir(workdir, point)
    if os.path.exists(os.path.join(directory, REPORT)):
      differences = config_differences(_recorded_run(directory), run_record(sweep, point))
      if differences:
        stale.append((directory, differences))
  if stale and not dry_run:
    if not retrain:
      raise stale_runs_error(stale, "--retrain")
    for directory, _ in stale:
      print(f"moved the stale run {directory} to {move_aside(directory)}", flush=True)
  statuses = {}
  for i, point in enumerate(points):
    name, directory = run_name(point), run_dir(workdir, point)
    command = run_command(sweep, point, directory)
    done = os.path.exists(os.path.join(directory, REPORT))
    if dry_run:
      print(("# skipped (report.json exists): " if done else "") + shlex.join(command), flush=True)
      continue
    prefix = f"[{i + 1}/{len(points)}] {name}:"
    if done:
      statuses[name] = "skipped"
      print(f"{prefix} skipped (report.json exists)", flush=True)
      continue
    start = time.monotonic()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, RUN), "w") as f:
      json.dump(run_record(sweep, point), f, indent=2)
    try:
      ok, why = _run_one(command, directory, timeout_s=sweep.timeout_s, cwd=cwd, env=run_env)
    except KeyboardInterrupt:
      print(f"{prefix} interrupted; rerun the same command to resume the sweep", flush=True)
      raise
    statuses[name] = "ok" if ok else "failed"
    seconds = time.monotonic() - start
    detail = "" if ok else f" ({why}; see {os.path.join(directory, ERROR)})"
    print(f"{prefix} {statuses[name]}{detail} {seconds:.1f}s", flush=True)
  return statuses


def write_commands(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    launcher: Sequence[str] = (),
    sweep_path: str = "",
) -> str:
  """Writes `<workdir>/commands.sh`, one shell line per run; returns its path."""
  points = grid_points(sweep)
  _check_names(sweep, points)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "commands.sh")
  lines = [
      "#!/usr/bin/env bash",
      f"# Sweep {sweep_path or '?'}: {len(points)} runs, written by `python -m trainkit.sweep`.",
      "set -euo pipefail",
      f"cd {shlex.quote(REPO_ROOT)}  # Config and launcher paths are relative to the repo.",
  ]
  for point in points:
    command = run_command(sweep, point, run_dir(workdir, point), launcher, python="python")
    lines.append(" ".join(shlex.quote(word) for word in command))
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  os.chmod(path, 0o755)
  return path


def _lookup(report: Any, path: str) -> Any:
  for part in path.split("."):
    if not isinstance(report, Mapping) or part not in report:
      return None
    report = report[part]
  return report


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def throughput(directory: str, keys: Sequence[str]) -> dict[str, float]:
  """Per key in metrics.jsonl: the median over the logged steps after half the run's steps.

  The first steps include compilation, so they would drag a mean or a whole-run median down.
  """
  try:
    records = read_metrics(directory)
  except (OSError, ValueError):
    return {}
  result = {}
  for key in keys:
    logged = [(r.get("step", 0), r[key]) for r in records if _is_number(r.get(key))]
    if not logged:
      continue
    last = max(step for step, _ in logged)
    later = [v for step, v in logged if step > last / 2] or [v for _, v in logged]
    result[key] = float(np.median(later))
  return result


def collect(sweep: ml_collections.ConfigDict, workdir: str) -> list[dict[str, Any]]:
  """One row per run: grid values, status, metrics from report.json, then throughput medians."""
  rows = []
  for point in grid_points(sweep):
    directory = run_dir(workdir, point)
    row: dict[str, Any] = dict(point)
    report = None
    try:
      with open(os.path.join(directory, REPORT)) as f:
        report = json.load(f)
      row["status"] = "ok"
    except FileNotFoundError:
      row["status"] = "failed" if os.path.exists(os.path.join(directory, ERROR)) else "missing"
    except (OSError, ValueError):
      row["status"] = "failed"  # An unreadable report: the run must be redone.
    for metric in sweep.metrics:
      row[metric] = _lookup(report, metric)
    row.update(throughput(directory, sweep.throughput_keys))
    row["run_dir"] = directory
    rows.append(row)
  return rows


def table_columns(sweep: ml_collections.ConfigDict, rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """Grid keys, status, metrics, then the throughput keys some run logged."""
  present = [k for k in sweep.throughput_keys if any(k in r for r in rows)]
  return [*sweep.grid.keys(), "status", *sweep.metrics, *present]


def _cell(value: Any) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    return f"{value:.4g}"
  return format_value(value)


def write_tables(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    rows: Sequence[Mapping[str, Any]],
    sweep_path: str = "",
) -> str:
  """Writes sweep.csv, sweep.md and sweep.json into `workdir`; returns the markdown."""
  columns = table_columns(sweep, rows)
  with open(os.path.join(workdir, "sweep.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: "" if r.get(k) is None else r[k] for k in columns} for r in rows)
  ok = sum(r["status"] == "ok" for r in rows)
  lines = [
      f"# Sweep `{sweep_path or '?'}`",
      "",
      f"{ok} of {len(rows)} runs finished. Throughput columns: median over the second half of"
      " the logged steps.",
      "",
      "| " + " | ".join(columns) + " |",
      "|" + "|".join("---" for _ in columns) + "|",
  ]
  lines += ["| " + " | ".join(_cell(r.get(k)) for k in columns) + " |" for r in rows]
  markdown = "\n".join(lines) + "\n"
  with open(os.path.join(workdir, "sweep.md"), "w") as f:
    f.write(markdown)
  definition = {**sweep.to_dict(), "grid": dict(sweep.grid), "overrides": dict(sweep.overrides)}
  with open(os.path.join(workdir, "sweep.json"), "w") as f:
    json.dump({"sweep": sweep_path, "definition": definition, "rows": list(rows)}, f, indent=2)
  return markdown


def write_plots(
    sweep: ml_collections.ConfigDict, workdir: str, rows: Sequence[Mapping[str, Any]]
) -> list[str]:
  """`plots/<column>_vs_<key>.png` per varied non-seed grid key and numeric column; returns paths.

  y is the mean over seeds (error bar: sample std when several), one line per combination of
  the other varied keys; only finished runs count.
  """
  varied = [k for k, values in sweep.grid.items() if k != "seed" and len(values) > 1]
  ok = [r for r in rows if r["status"] == "ok"]
  columns = [c for c in table_columns(sweep, rows)[len(sweep.grid) + 1 :]]
  columns = [c for c in columns if any(_is_number(r.get(c)) for r in ok)]
  if not varied or not columns:
    return []
  import matplotlib  # Lazily: only collecting plots needs it.

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plots_dir = os.path.join(workdir, "plots")
  os.makedirs(plots_dir, exist_ok=True)
  paths = []
  for column, key in itertools.product(columns, varied):
    xs = list(sweep.grid[key])
    numeric = all(_is_number(x) for x in xs)
    positions = xs if numeric else list(range(len(xs)))
    others = [k for k in varied if k != key]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for combo in itertools.product(*(sweep.grid[k] for k in others)):
      same = [r for r in ok if all(r[k] == v for k, v in zip(others, combo))]
      cells = [[r[column] for r in same if r[key] == x and _is_number(r.get(column))] for x in xs]
      kept = [(p, c) for p, c in zip(positions, cells) if c]
      if not kept:
        continue
      label = ", ".join(f"{k}={format_value(v)}" for k, v in zip(others, combo)) or None
      ax.errorbar(
          [p for p, _ in kept],
          [np.mean(c) for _, c in kept],
          yerr=[np.std(c, ddof=1) if len(c) > 1 else 0.0 for _, c in kept],
          marker="o",
          capsize=3,
          label=label,
      )
    if numeric and min(xs) > 0 and max(xs) >= 4 * min(xs):
      ax.set_xscale("log", base=2)
    ax.set_xticks(positions, [format_value(x) for x in xs])
    ax.set_xlabel(key)
    ax.set_ylabel(column)
    ax.grid(alpha=0.3)
    if others:
      ax.legend(fontsize="small")
    fig.tight_layout()
    path = os.path.join(plots_dir, f"{_safe(f'{column}_vs_{key}')}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths


def execute(
    sweep_path: str,
    workdir: str,
    *,
    mode: str = "run",
    launcher: str = "",
    dry_run: bool = False,
    retrain: bool = False,
    env: Mapping[str, str] | None = None,
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
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if mode == "commands":
    print(write_commands(sweep, workdir, launcher_words, sweep_path))
    return 0
  if mode == "run":
    run_sweep(sweep, workdir, dry_run=dry_run, retrain=retrain, env=env)
    if dry_run:
      return 0
  os.makedirs(workdir, exist_ok=True)
  rows = collect(sweep, workdir)
  print("\n" + write_tables(sweep, workdir, rows, sweep_path))
  plots = write_plots(sweep, workdir, rows)
  print(f"Wrote {workdir}/sweep.csv, sweep.md, sweep.json and {len(plots)} plot(s) in plots/")
  missing = [r for r in rows if r["status"] != "ok"]
  if missing:
    print(f"{len(missing)} run(s) without report.json; rerun --mode=run to retry them.")
  return 1 if missing else 0


def _define_flags() -> dict[str, flags.FlagHolder]:
  """The command line's flags, defined only when run as a script: sweep files import this module
  (for `dotted`), and defining them at import would define them twice under `python -m`."""
  holders = dict(
      sweep=flags.DEFINE_string("sweep", None, "Sweep file, optionally `file.py:arg`."),
      workdir=flags.DEFINE_string(
          "workdir", None, "Directory of the sweep: runs/, tables, plots/."
      ),
      mode=flags.DEFINE_string("mode", "run", f"One of {', '.join(MODES)}."),
      launcher=flags.DEFINE_string(
          "launcher", "", 'commands mode: prefix of each line, e.g. "launch/slurm.sh --nodes 2 --".'
      ),
      dry_run=flags.DEFINE_bool("dry_run", False, "run mode: print the commands, run nothing."),
      retrain=flags.DEFINE_bool(
          "retrain",
          False,
          "run mode: move finished runs started with other settings aside and run them again "
          "(without it they are an error).",
      ),
  )
  flags.mark_flags_as_required(["sweep", "workdir"])
  return holders


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(resolve_config_args(argv))
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
    )
  except KeyboardInterrupt:  # The running run got SIGTERM and checkpointed; rerun resumes.
    sys.exit(130)
  sys.exit(status)


if __name__ == "__main__":
  _HOLDERS = _define_flags()
  app.run(lambda argv: main(argv, _HOLDERS), flags_parser=_parse_flags)
