"""A sweep's dry-run summary: how many runs, and how long they would take, priced only from the
runs of the sweep that finished in its workdir (`sweep_run.json` to `report.json`, per step, or
per run where `num_epochs` sets the length); without one, no estimate.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from paper_runner.spec import REPORT, RUN, run_dir
from trainkit.errors import UserError


def _steps(directory: str) -> int | None:
  """The steps a finished run trained: its report's `step`, else its config's num_train_steps."""
  for name, key in ((REPORT, "step"), ("config.json", "num_train_steps")):
    try:
      with open(os.path.join(directory, name)) as f:
        value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
      continue
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
      return value
  return None


def finished_timing(directory: str) -> tuple[float, int | None] | None:
  """(wall seconds, steps or None) of the finished run in `directory`; None when it has not
  finished here or its start is unknown (no sweep_run.json, or a clock that went back)."""
  try:
    seconds = os.path.getmtime(os.path.join(directory, REPORT)) - os.path.getmtime(
        os.path.join(directory, RUN)
    )
  except OSError:
    return None
  return (seconds, _steps(directory)) if seconds > 0 else None


def planned_steps(config: ml_collections.ConfigDict) -> int | None:
  """The steps a run of `config` will train; None when num_epochs sets them from its data."""
  if config.get("num_epochs", 0) > 0:
    return None
  steps = config.get("num_train_steps")
  return steps if isinstance(steps, int) and steps > 0 else None


def format_duration(seconds: float) -> str:
  if seconds < 90:
    return f"{seconds:.0f} s"
  return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


def dry_run_summary(
    workdir: str,
    points: Sequence[Mapping[str, Any]],
    to_run: Sequence[Mapping[str, Any]],
    config_of: Callable[[Mapping[str, Any]], ml_collections.ConfigDict],
) -> list[str]:
  """The lines a dry run ends with: the number of runs, then the time estimate or why there is
  none.

  Args:
    workdir: the sweep's workdir (its finished runs are the measurements).
    points: every grid point.
    to_run: the points a run would start (no report.json, or stale).
    config_of: the config a point's run trains with (`spec.resolved_config`).
  """
  finished = [
      timing
      for timing in (finished_timing(run_dir(workdir, point)) for point in points)
      if timing is not None
  ]
  done = len(points) - len(to_run)
  lines = [
      f"dry run: {len(points)} run(s) in the sweep, {len(to_run)} to run, {done} finished "
      "(skipped)"
  ]
  if not to_run:
    return lines + ["estimate: nothing to run"]
  if not finished:
    return lines + [
        f"no estimate: no run of this sweep has finished in {workdir} on this machine yet (the "
        "estimate is the measured wall time per step of finished runs); rerun with --dry_run "
        "once one has"
    ]
  per_step = [seconds / steps for seconds, steps in finished if steps]
  per_run = statistics.median(seconds for seconds, _ in finished)
  step_rate = statistics.median(per_step) if per_step else None
  total, by_steps, by_runs, steps_total = 0.0, 0, 0, 0
  for point in to_run:
    try:
      steps = planned_steps(config_of(point))
    except UserError:  # A config this module cannot build is the run's to report, not this.
      steps = None
    if steps is not None and step_rate is not None:
      total += steps * step_rate
      by_steps += 1
      steps_total += steps
    else:
      total += per_run
      by_runs += 1
  basis = []
  if by_steps:
    basis.append(f"{by_steps} run(s), {steps_total:,} steps, at {step_rate:.3g} s per step")
  if by_runs:
    why = " (their steps are not known before they start)" if step_rate is not None else ""
    basis.append(f"{by_runs} run(s) at {format_duration(per_run)} each{why}")
  return lines + [
      f"estimate: about {format_duration(total)} for the {len(to_run)} run(s) to run, one after "
      f"the other ({'; '.join(basis)}): the median wall time of the {len(finished)} finished "
      f"run(s) in {workdir} on this machine, compilation and evaluation included, from each "
      "one's last start"
  ]
