"""A sweep as a shell script, one launcher command per run, for a cluster to run."""

from __future__ import annotations

import os
import shlex
from typing import Sequence

import ml_collections

from paper_runner.spec import REPO_ROOT, check_run_names, grid_points, run_command, run_dir
from trainkit import storage
from trainkit.storage import write_atomically


def write_commands(
    sweep: ml_collections.ConfigDict,
    workdir: str,
    launcher: Sequence[str] = (),
    sweep_path: str = "",
) -> str:
  """Writes `<workdir>/commands.sh` (an object on gs://), one line per run, `python -m module ...`
  or the launcher's words then the main's flags, into the directories `--mode=run` uses."""
  points = grid_points(sweep)
  check_run_names(points)
  storage.makedirs(workdir)
  path = storage.join(workdir, "commands.sh")
  # launch/slurm_array.sbatch reads this layout: the lines after the `cd` line are the runs, in
  # grid order, one per array task.
  lines = [
      "#!/usr/bin/env bash",
      f"# Sweep {sweep_path or '?'}: {len(points)} runs, written by `python -m paper_runner.sweep`.",
      "set -euo pipefail",
      f"cd {shlex.quote(REPO_ROOT)}  # Config and launcher paths are relative to the repo.",
  ]
  for point in points:
    command = run_command(sweep, point, run_dir(workdir, point), launcher, python="python")
    lines.append(" ".join(shlex.quote(word) for word in command))
  write_atomically(path, "\n".join(lines) + "\n")
  if not storage.is_remote(path):  # An object has no mode: `gcloud storage cat PATH | bash`.
    os.chmod(path, 0o755)
  return path
