"""What the tools tell a user before anything costs time: a sweep's dry run counts its runs and
estimates their time, both spellings of the dry-run flag work in every tool, the preflight names
the MoE dispatch it compiled, and docs/scaling.md says its figures depend on the jax version."""

import json
import os
import re
import subprocess
import sys

import pytest

from paper_runner import spec
from paper_runner import sweep as sweep_cli
from paper_runner.sweep_estimate import dry_run_summary, format_duration
from trainkit.preflight.compile import settings_text

SWEEP = "configs/sweeps/batch_experts.py:steps=30"  # 12 runs of 30 steps.


def _finish(directory, seconds, steps, record=None):
  """A finished run as the runner leaves it: started (sweep_run.json, what it was started
  with), ended (report.json)."""
  os.makedirs(directory, exist_ok=True)
  for name, content in ((spec.RUN, record or {}), (spec.REPORT, {"step": steps})):
    with open(os.path.join(directory, name), "w") as f:
      json.dump(content, f)
  start = 1_800_000_000
  os.utime(os.path.join(directory, spec.RUN), (start, start))
  os.utime(os.path.join(directory, spec.REPORT), (start + seconds, start + seconds))


def test_a_dry_run_without_a_finished_run_says_it_has_no_estimate(tmp_path, capsys, repo_root):
  os.chdir(repo_root)
  assert sweep_cli.execute(SWEEP, str(tmp_path), dry_run=True) == 0
  *commands, count, estimate = capsys.readouterr().out.strip().splitlines()
  assert len(commands) == 12
  assert count == "dry run: 12 run(s) in the sweep, 12 to run, 0 finished (skipped)"
  assert estimate.startswith("no estimate: no run of this sweep has finished in ")


def test_a_dry_run_estimates_from_the_runs_finished_in_the_workdir(tmp_path, capsys, repo_root):
  os.chdir(repo_root)
  sweep = sweep_cli.load_sweep(SWEEP)
  points = spec.grid_points(sweep)
  # Two finished runs of 30 steps, in 60 s and 90 s: 2 and 3 s per step, median 2.5 s.
  for point, seconds in zip(points, (60, 90)):
    _finish(spec.run_dir(str(tmp_path), point), seconds, 30, spec.run_record(sweep, point))
  assert sweep_cli.execute(SWEEP, str(tmp_path), dry_run=True) == 0
  *commands, count, estimate = capsys.readouterr().out.strip().splitlines()
  assert sum(line.startswith("# skipped") for line in commands) == 2
  assert count == "dry run: 12 run(s) in the sweep, 10 to run, 2 finished (skipped)"
  # 10 runs x 30 steps x 2.5 s = 750 s.
  assert estimate.startswith(
      "estimate: about 12 min for the 10 run(s) to run, one after the other (10 run(s), 300 "
      "steps, at 2.5 s per step): the median wall time of the 2 finished run(s) in "
  ), estimate


def test_runs_of_unknown_length_are_priced_per_run(tmp_path):
  points = [{"seed": 0}, {"seed": 1}, {"seed": 2}]
  _finish(spec.run_dir(str(tmp_path), points[0]), 600, 100)

  class Epochs(dict):
    get = dict.get

  lines = dry_run_summary(
      str(tmp_path), points, points[1:], lambda point: Epochs(num_epochs=3, num_train_steps=1)
  )
  assert lines[-1].startswith(
      "estimate: about 20 min for the 2 run(s) to run, one after the other (2 run(s) at 10 min "
      "each (their steps are not known before they start))"
  ), lines
  assert format_duration(30) == "30 s" and format_duration(3 * 3600) == "3.0 h"


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["--dry-run", "--dry_run"])
def test_the_sweep_takes_both_spellings_of_the_dry_run(tmp_path, repo_root, spelling):
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "paper_runner.sweep",
          f"--sweep={SWEEP}",
          f"--workdir={tmp_path}",
          spelling,
      ],
      cwd=repo_root,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert "dry run: 12 run(s) in the sweep, 12 to run" in result.stdout
  assert not (tmp_path / "runs").exists()  # Nothing ran.


def test_dashed_flag_names_leave_the_rest_alone():
  argv = ["sweep", "--dry-run", "--nodry-run", "--dry-run=false", "--dry-running", "--"]
  argv.append("--dry-run")  # After `--`: a positional argument.
  assert sweep_cli.dashed_flag_names(argv) == [
      "sweep",
      "--dry_run",
      "--nodry_run",
      "--dry_run=false",
      "--dry-running",
      "--",
      "--dry-run",
  ]


LAUNCHERS = {
    "local.sh": ["configs/quickstart.py", "/tmp/wd"],
    "local_multiprocess.sh": ["--processes", "2", "--", "--config=configs/quickstart.py"],
    "slurm.sh": [
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--",
        "--config=configs/quickstart.py",
        "--workdir=/tmp/wd",
    ],
    "tpu_pod.sh": [
        "--name",
        "pod",
        "--zone",
        "z",
        "--accelerator",
        "v5litepod-16",
        "--",
        "--config=configs/quickstart.py",
        "--workdir=gs://bucket/run",
    ],
}


@pytest.mark.parametrize("script", [*LAUNCHERS, "slurm_array.sh"])
def test_every_launcher_takes_both_spellings_of_the_dry_run(script, tmp_path, repo_root):
  args = LAUNCHERS.get(script)
  if args is None:  # The array launcher reads a sweep's commands.sh.
    commands = tmp_path / "commands.sh"
    commands.write_text(
        f"cd {repo_root}\npython -m fairmoe_jax.main --config=configs/quickstart.py "
        f"--workdir={tmp_path / 'run'}\n"
    )
    args = [str(commands)]
  env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": "python3"}
  outputs = []
  for spelling in ("--dry-run", "--dry_run"):
    result = subprocess.run(
        ["bash", str(repo_root / "launch" / script), spelling, *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, (spelling, result.stderr)
    outputs.append(result.stdout)
  assert outputs[0] == outputs[1] and outputs[0]


def test_the_preflight_names_the_dispatch_it_compiled():
  auto = {"settings": {"moe.dispatch": "sort"}, "settings_given": {"moe.dispatch": "auto"}}
  assert settings_text(auto) == "moe.dispatch=auto (compiled: sort)"
  named = {"settings": {"moe.dispatch": "einsum"}, "settings_given": {"moe.dispatch": "einsum"}}
  assert settings_text(named) == "moe.dispatch=einsum"
  assert settings_text({"settings": {}}) == ""  # causal_attn_jax: no MoE.


def test_scaling_md_says_its_figures_depend_on_the_jax_version(repo_root):
  text = (repo_root / "docs" / "scaling.md").read_text()
  intro = text.split("\n## ", 1)[0]  # Under the first heading, before any table.
  paragraph = " ".join(intro.split())
  assert "depend on the jax version" in paragraph
  assert "with jax 0.12.x, `h100x8` gave 12.3 device-hours where 0.10.2 then gave 8.9" in paragraph
  assert "470 against 235 MiB of all-reduces" in paragraph
  # The 0.10.2 figure the intro states is the table's own (device-hours, CelebA / ISIC).
  stated = re.search(r"recompiled since on 0\.10\.2, gives ([\d.]+) for FairSMoE DeiT-S", paragraph)
  row = next(
      line for line in text.splitlines() if line.startswith("| fairsmoe/deit_s | h100x8 (sort) |")
  )
  assert stated and row.split("|")[9].split("/")[0].strip() == stated.group(1)
