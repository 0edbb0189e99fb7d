"""Running a sweep's runs on this machine, one subprocess after the other, so that rerunning
the same command is safe (docs/scaling.md, "Sweeps"; docs/reliability.md)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import ml_collections

from paper_runner.die_with_parent import wrapped
from paper_runner.provenance import host, source_state
from paper_runner.spec import (
    ERROR,
    LOG,
    REPO_ROOT,
    REPORT,
    RUN,
    RUN_PROVENANCE,
    SweepError,
    check_run_names,
    grid_points,
    resolved_config,
    run_command,
    run_dir,
    run_name,
    run_record,
)
from paper_runner.sweep_estimate import dry_run_summary
from trainkit.distributed import child_environment
from trainkit.storage import write_atomically
from trainkit.workdir import (
    CONFIG_FILE,
    config_differences,
    move_aside,
    stale_runs_error,
    trained_config_differences,
)

ERROR_LOG_LINES = 30
TERMINATE_GRACE_S = 60  # Between SIGTERM (the mains checkpoint on it) and SIGKILL.
# How a finished run in a directory differs from what a grid point asks for now.
Differences = Callable[[Mapping[str, Any], str], list[str]]


def terminate_group(process: subprocess.Popen) -> None:
  """SIGTERM to the run's process group (the main checkpoints), SIGKILL after a grace period."""
  for sig, wait_s in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, 10)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    with contextlib.suppress(subprocess.TimeoutExpired):
      process.wait(timeout=wait_s)
      return


def _raise_interrupt(signum: int, frame: Any) -> None:
  # Once: a second SIGTERM must not cut short the termination of the run this one started.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
  """SIGTERM to the runner stops it like Ctrl-C, so the run it started is terminated too."""
  if threading.current_thread() is not threading.main_thread():
    yield  # Signal handlers can only be set from the main thread.
    return
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


# A traceback's last line (`ValueError: ...`, `jaxlib...XlaRuntimeError: ...`, `KeyboardInterrupt`)
# or a crash the interpreter reports itself.
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b|Fatal Python error\b)"
)
# The progress bar's line in a log (trainkit/progress.py): `[####....] 20/40 | ...`.
_PROGRESS_LINE = re.compile(r"^\[[#.]*\] \d+/\d+")


def failure_line(output: list[str]) -> str:
  """The line of a failed run's output that says why: its last `error: ...` or exception line
  (other lines may follow it), else the last traceback's exception, else the last line that is
  not a progress line."""
  for line in reversed(output):
    line = line.rstrip()
    if line.lower().startswith("error:") or _EXCEPTION_LINE.match(line):
      return line
  tracebacks = [i for i, line in enumerate(output) if line.startswith("Traceback (")]
  if tracebacks:  # An exception of another name (`trainkit.errors.OutOfSpace: ...`).
    for line in output[tracebacks[-1] + 1 :]:
      if line.strip() and not line[0].isspace():
        return line.strip()
  return next(
      (l.strip() for l in reversed(output) if l.strip() and not _PROGRESS_LINE.match(l.strip())), ""
  )


def _output_since(log_path: str, offset: int) -> list[str]:
  """The lines this attempt wrote to the log (earlier attempts' lines come before `offset`)."""
  try:
    with open(log_path, errors="replace") as f:
      f.seek(offset)
      return f.read().splitlines()
  except OSError:
    return []


def run_one(
    command: list[str], directory: str, *, timeout_s: float, cwd: str, env: Mapping[str, str]
) -> tuple[bool, str]:
  """Runs one command, logging to log.txt; returns (ok, why not)."""
  os.makedirs(directory, exist_ok=True)
  log_path = os.path.join(directory, LOG)
  with open(log_path, "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n")
    log.flush()
    offset = log.tell()
    # A session of its own: a timeout stops the run's whole process tree; and SIGTERM when the
    # runner dies, even by SIGKILL.
    process = subprocess.Popen(
        wrapped(command), cwd=cwd, env=env, stdout=log, stderr=log, start_new_session=True
    )
    try:
      code = process.wait(timeout=timeout_s or None)
      why = "" if code == 0 else f"exit code {code}"
    except subprocess.TimeoutExpired:
      terminate_group(process)
      why = f"timeout after {timeout_s:g} s (exit code {process.returncode})"
    except KeyboardInterrupt:
      terminate_group(process)  # The main checkpoints on SIGTERM, so a rerun resumes it.
      raise
  if not why and not os.path.exists(os.path.join(directory, REPORT)):
    why = "exit code 0 but no report.json"
  error_path = os.path.join(directory, ERROR)
  if why:
    output = _output_since(log_path, offset)
    last = failure_line(output)
    if last and why.startswith("exit code"):
      why = f"{why}: {last}"
    write_atomically(
        error_path,
        f"{why}\n\nlast {ERROR_LOG_LINES} lines of {log_path}:\n"
        + "".join(f"{line}\n" for line in output[-ERROR_LOG_LINES:]),
    )
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
    sweep: ml_collections.ConfigDict, point: Mapping[str, Any], directory: str, cwd: str = REPO_ROOT
) -> list[str]:
  """How the finished run in `directory` differs from what `point` asks for now: its RUN record,
  then its config.json against the config the same flags give now (an edited config file)."""
  changed = config_differences(_recorded_run(directory), run_record(sweep, point))
  if changed or not os.path.exists(os.path.join(directory, CONFIG_FILE)):
    return changed
  return trained_config_differences(directory, resolved_config(sweep, point, cwd))


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

  A finished run that `differences` (default `record_differences`) finds stale is an error
  before anything runs, or with `retrain` is moved aside and run again. `env` adds to this
  process's environment.
  """
  base = sweep.config.partition(":")[0]
  if not os.path.isfile(os.path.join(cwd, base)):
    raise SweepError("config", f"no such file {base!r} (relative to {cwd})")
  points = grid_points(sweep)
  check_run_names(points)
  if differences is None:
    differences = lambda point, directory: record_differences(sweep, point, directory, cwd)
  run_env = child_environment({"PYTHONUNBUFFERED": "1", **(env or {})})
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
  stale_changes = dict(stale)
  source = source_state(REPO_ROOT)  # The code the runs import.
  statuses = {}
  finished = []  # Dry run: the runs it would skip.
  with sigterm_as_interrupt():
    for i, point in enumerate(points):
      name, directory = run_name(point), run_dir(workdir, point)
      command = run_command(sweep, point, directory)
      done = os.path.exists(os.path.join(directory, REPORT))
      if dry_run:
        changed = stale_changes.get(directory)
        if changed:
          note = f"# stale, trained with another config ({', '.join(changed[:3])}): "
        else:
          note = "# skipped (report.json exists): " if done else ""
        print(note + shlex.join(command), flush=True)
        if done and not changed:
          finished.append(point)
        continue
      prefix = f"[{i + 1}/{len(points)}] {name}:"
      if done:
        statuses[name] = "skipped"
        print(f"{prefix} skipped (report.json exists)", flush=True)
        continue
      start = time.monotonic()
      os.makedirs(directory, exist_ok=True)
      write_atomically(os.path.join(directory, RUN), json.dumps(run_record(sweep, point), indent=2))
      write_atomically(
          os.path.join(directory, RUN_PROVENANCE),
          json.dumps({**source, "host": host(run_env)}, indent=2),
      )
      try:
        ok, why = run_one(command, directory, timeout_s=sweep.timeout_s, cwd=cwd, env=run_env)
      except KeyboardInterrupt:
        print(f"{prefix} interrupted; rerun the same command to resume the sweep", flush=True)
        raise
      statuses[name] = "ok" if ok else "failed"
      seconds = time.monotonic() - start
      detail = "" if ok else f" ({why}; see {os.path.join(directory, ERROR)})"
      print(f"{prefix} {statuses[name]}{detail} {seconds:.1f}s", flush=True)
  if dry_run:
    to_run = [point for point in points if point not in finished]
    summary = dry_run_summary(
        workdir, points, to_run, lambda point: resolved_config(sweep, point, cwd)
    )
    print("\n".join(summary), flush=True)
  return statuses
