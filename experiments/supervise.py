"""Running a sweep's runs on this machine, one subprocess after the other.

The rules that make rerunning the same command safe:
* a run whose report.json exists is skipped, but only if it was started with the settings asked
  for now (its RUN record, or what `differences` says); otherwise the sweep stops before running
  anything, or with `retrain` moves the run aside and runs it again;
* a run without report.json is (re)started; the mains resume from their checkpoints;
* a failed run (non-zero exit, timeout, no report.json) leaves error.txt, is retried next time
  and does not stop the others;
* a timeout, Ctrl-C or SIGTERM gives the run SIGTERM (the mains checkpoint on it), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import ml_collections

from experiments.spec import (
    ERROR,
    LOG,
    REPO_ROOT,
    REPORT,
    RUN,
    SweepError,
    check_run_names,
    grid_points,
    run_command,
    run_dir,
    run_name,
    run_record,
)
from trainkit.workdir import config_differences, move_aside, stale_runs_error

ERROR_LOG_LINES = 30
# A timed-out or interrupted run gets SIGTERM first (the mains checkpoint on it), then SIGKILL.
TERMINATE_GRACE_S = 60
# How a finished run in a directory differs from what a grid point asks for now.
Differences = Callable[[Mapping[str, Any], str], list[str]]


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


def _raise_interrupt(signum: int, frame: Any) -> None:
  # Once: a second SIGTERM must not cut short the termination of the run this one started.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
  """SIGTERM to the runner (a preemption, `kill`) stops it like Ctrl-C.

  Without this the runner would die at once and leave the run it started (in a session of its
  own) training on unsupervised; as an interrupt, the run is terminated and checkpoints.
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # Signal handlers can only be set from the main thread.
    return
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _output_since(log_path: str, offset: int) -> list[str]:
  """The lines this attempt wrote to the log (earlier attempts' lines come before `offset`)."""
  try:
    with open(log_path, errors="replace") as f:
      f.seek(offset)
      return f.read().splitlines()
  except OSError:
    return []


def _run_one(
    command: list[str], directory: str, *, timeout_s: float, cwd: str, env: Mapping[str, str]
) -> tuple[bool, str]:
  """Runs one command, logging to log.txt; returns (ok, why not)."""
  os.makedirs(directory, exist_ok=True)
  log_path = os.path.join(directory, LOG)
  with open(log_path, "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n")
    log.flush()
    offset = log.tell()
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
    output = _output_since(log_path, offset)
    last = next((line.strip() for line in reversed(output) if line.strip()), "")
    if last and why.startswith("exit code"):
      # A main's last line is its `error: ...` or the exception that ended it: the reason.
      why = f"{why}: {last}"
    with open(error_path, "w") as f:
      f.write(f"{why}\n\nlast {ERROR_LOG_LINES} lines of {log_path}:\n")
      f.write("".join(f"{line}\n" for line in output[-ERROR_LOG_LINES:]))
  elif os.path.exists(error_path):  # A retry that succeeded: the old error no longer applies.
    os.remove(error_path)
  return not why, why


def _recorded_run(directory: str) -> dict[str, Any]:
  try:
    with open(os.path.join(directory, RUN)) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {"record": "missing"}  # Cannot be checked, so it is not reused.


def record_differences(
    sweep: ml_collections.ConfigDict, point: Mapping[str, Any], directory: str
) -> list[str]:
  """How the RUN record in `directory` differs from what `point` asks for now."""
  return config_differences(_recorded_run(directory), run_record(sweep, point))


def run_sweep(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    *,
    dry_run: bool = False,
    retrain: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str = REPO_ROOT,
    differences: Differences | None = None,
) -> dict[str, str]:
  """Runs every run without a report.json, in order; returns {name: ok|failed|skipped}.

  A finished run started with other settings is an error before anything runs, or with
  `retrain` is moved aside (`<run>.stale-<n>`) and run again. `differences(point, directory)`
  decides what "other settings" means; by default the run's RUN record against `run_record`
  (a front end that can build each run's whole config checks that instead).

  `env` adds to this process's environment (the runs inherit it, XLA_FLAGS included).
  """
  base = sweep.config.partition(":")[0]
  if not os.path.isfile(os.path.join(cwd, base)):
    raise SweepError("config", f"no such file {base!r} (relative to {cwd})")
  points = grid_points(sweep)
  check_run_names(points)
  if differences is None:
    differences = lambda point, directory: record_differences(sweep, point, directory)
  run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
  stale = []
  for point in points:
    directory = run_dir(workdir, point)
    if os.path.exists(os.path.join(directory, REPORT)):
      changed = differences(point, directory)
      if changed:
        stale.append((directory, changed))
  if stale and not dry_run:
    if not retrain:
      raise stale_runs_error(stale, "--retrain")
    for directory, _ in stale:
      print(f"moved the stale run {directory} to {move_aside(directory)}", flush=True)
  statuses = {}
  with _sigterm_as_interrupt():
    for i, point in enumerate(points):
      name, directory = run_name(point), run_dir(workdir, point)
      command = run_command(sweep, point, directory)
      done = os.path.exists(os.path.join(directory, REPORT))
      if dry_run:
        skipped = "# skipped (report.json exists): " if done else ""
        print(skipped + shlex.join(command), flush=True)
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
