"""SLURM for real: jobs submitted to a one-node cluster (2 CPUs, no GPUs) that
`launch/testing/local_slurm.sh start` sets up and `.ci/run` starts.

- `launch/slurm.sh` runs a 2-task CPU training under `srun`: the two tasks join one JAX
  runtime from SLURM's variables alone (none of our JAX_* variables is set) and log the
  one-process run's losses;
- a batch-size sweep is submitted as one job array (`paper_runner.sweep --mode=commands`, then
  `launch/slurm_array.sh`); one array task is cancelled with `scancel` mid-run, the resubmission
  submits only that run, which resumes from its checkpoint; `--mode=collect` writes the table
  and the plots.

Every test here is marked `slurm` and skips, saying why, where no cluster answers.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_multiprocess import FAIRMOE_TINY, STEPS

from conftest import REPO_ROOT
from multiprocess import cpu_env, free_port
from trainkit.metric_writers import read_metrics

pytestmark = pytest.mark.slurm

REPO = REPO_ROOT
LOCAL_SLURM = REPO / "launch" / "testing" / "local_slurm.sh"
LOCAL_SLURM_DIR = pathlib.Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/local_slurm"))
# Long enough that a scancel sent after the second logged step lands mid-run, whatever the load.
SWEEP_STEPS = 30
# Bounds every wait on the cluster: a stuck job fails the test instead of hanging the suite.
JOB_TIMEOUT_S = 600


def _slurm_conf_env() -> dict[str, str]:
  """os.environ, with SLURM_CONF pointing at the test cluster's config when the clients would
  not find one themselves (local_slurm.sh links /etc/slurm/slurm.conf only where it is free)."""
  env = dict(os.environ)
  local_conf = LOCAL_SLURM_DIR / "slurm.conf"
  if (
      "SLURM_CONF" not in env
      and not os.path.exists("/etc/slurm/slurm.conf")
      and local_conf.exists()
  ):
    env["SLURM_CONF"] = str(local_conf)
  return env


@functools.cache
def _why_no_cluster() -> str | None:
  """None when the cluster's node answers and can run jobs, else why not (the skip reason)."""
  start = f"start one with `{LOCAL_SLURM.relative_to(REPO)} start` (root, apt-get)"
  not_started = LOCAL_SLURM_DIR / "not_started.txt"
  if not_started.exists():
    return f"the test SLURM cluster could not start: {not_started.read_text().strip()}"
  if shutil.which("sinfo") is None:
    return f"SLURM is not installed (no sinfo on PATH): {start}"
  try:
    result = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%t"],
        env=_slurm_conf_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
  except subprocess.TimeoutExpired:
    return f"sinfo did not answer within 30 s: {start}"
  states = result.stdout.split()
  if result.returncode != 0 or not states:
    first = (result.stderr.strip().splitlines() or ["no node"])[0]
    return f"no SLURM cluster answers ({first}): {start}"
  if not {"idle", "mix", "alloc", "comp"} & set(states):
    return f"the SLURM node is {states[0]}, not idle: restart it with `{LOCAL_SLURM} start`"
  return None


def _require_cluster() -> None:
  reason = _why_no_cluster()
  if reason:
    pytest.skip(reason)


def _job_env(**extra: str) -> dict[str, str]:
  """The submitting environment, which sbatch exports to the job (--export=ALL): this test's
  Python first on PATH (the jobs run `python`), one CPU device per process, and none of our
  JAX_* or an enclosing job's SLURM_* variables, so the job's SLURM variables alone count."""
  env = cpu_env(1)
  env.pop("TRAINKIT_DISTRIBUTED", None)
  for variable in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
    del env[variable]
  env.update({k: v for k, v in _slurm_conf_env().items() if k == "SLURM_CONF"})
  env.update(extra)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  return env


def _job_id(stdout: str) -> str:
  match = re.search(r"^Submitted batch job (\d+)$", stdout, re.M)
  assert match, f"sbatch printed no job id:\n{stdout}"
  return match.group(1)


def _job_active(job: str) -> bool:
  """Whether any task of the job (or job array) is pending or running."""
  result = subprocess.run(
      ["squeue", "--noheader", f"--jobs={job}", "--format=%i %T"],
      env=_slurm_conf_env(),
      capture_output=True,
      text=True,
      timeout=30,
  )
  # A job already purged from the controller's memory is "Invalid job id": not active either.
  return result.returncode == 0 and bool(result.stdout.strip())


def _wait_for_job(job: str) -> None:
  deadline = time.time() + JOB_TIMEOUT_S
  while _job_active(job):
    if time.time() > deadline:
      subprocess.run(["scancel", job], env=_slurm_conf_env(), check=False)
      raise AssertionError(f"SLURM job {job} did not end within {JOB_TIMEOUT_S} s: cancelled")
    time.sleep(0.5)


def _logged_steps(run_dir: pathlib.Path) -> int:
  metrics = run_dir / "metrics.jsonl"
  return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait_for_steps(run_dir: pathlib.Path, steps: int, job: str) -> None:
  deadline, next_check = time.time() + JOB_TIMEOUT_S, 0.0
  while _logged_steps(run_dir) < steps:
    now = time.time()
    assert now < deadline, f"{run_dir.name}: {steps} steps not logged within {JOB_TIMEOUT_S} s"
    if now > next_check:  # squeue costs a round trip; the metrics file is polled faster.
      assert _job_active(job), f"job {job} ended before {run_dir.name} logged {steps} steps"
      next_check = now + 1.0
    time.sleep(0.02)


def _losses(workdir: pathlib.Path) -> np.ndarray:
  return np.array([m["loss"] for m in read_metrics(str(workdir))])


def _fairmoe_args(repo_root: pathlib.Path, workdir: pathlib.Path) -> list[str]:
  # tests/e2e/test_multiprocess.py's run, so JAX's compilation cache serves both files' programs.
  config = f"--config={repo_root}/configs/quickstart.py:steps={STEPS}"
  return [config, f"--workdir={workdir}", *FAIRMOE_TINY]


def test_srun_two_tasks_join_one_jax_runtime_from_slurm_and_train_like_one_process(
    repo_root, tmp_path
):
  _require_cluster()
  # The one-process reference trains beside the job (its own process, not a SLURM job).
  with open(tmp_path / "one.log", "w") as log:
    reference = subprocess.Popen(
        [sys.executable, "-m", "fairmoe_jax.main", *_fairmoe_args(repo_root, tmp_path / "one")],
        cwd=repo_root,
        env=cpu_env(1),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
  try:
    # SBATCH_WAIT: sbatch returns when the job has ended, with its exit code. The port is the
    # documented knob of the SLURM path (a free one, should 12345 be taken on this machine);
    # the process count, the process id and the coordinator's host come from SLURM.
    env = _job_env(SBATCH_WAIT="1", JAX_COORDINATOR_PORT=str(free_port()))
    submitted = subprocess.run(
        [
            "bash",
            str(repo_root / "launch" / "slurm.sh"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--time",
            "00:10:00",
            "--",
            *_fairmoe_args(repo_root, tmp_path / "two"),
        ],
        cwd=tmp_path,  # slurm_gpu.sbatch writes slurm-<job>.out into the submitting directory.
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S + 60,
    )
    job = _job_id(submitted.stdout)
    output_file = tmp_path / f"slurm-{job}.out"
    output = output_file.read_text() if output_file.exists() else "(no job output)"
    assert submitted.returncode == 0, output[-4000:] + submitted.stderr
    assert reference.wait(timeout=JOB_TIMEOUT_S) == 0, (tmp_path / "one.log").read_text()[-3000:]
  finally:
    if reference.poll() is None:
      reference.kill()

  # srun --label prefixes each line with its task's rank. Process 0 of a 2-process runtime says
  # so, once; two tasks started as unconnected single processes would print neither that line
  # nor only one report (each would be a process 0 of 1, printing everything).
  assert "nodes: " in output and "tasks: 2" in output
  joined = re.findall(r"^(\d+): Process 0 of (\d+) \(jax\.distributed\)", output, re.M)
  assert joined == [("0", "2")], output[-4000:]
  assert re.findall(r"^(\d+): Fairness report", output, re.M) == ["0"], output[-4000:]
  reference_losses = _losses(tmp_path / "one")
  assert len(reference_losses) == STEPS
  # The same global batch, split over two processes: the same losses as one process.
  np.testing.assert_allclose(_losses(tmp_path / "two"), reference_losses, rtol=1e-5)


def _write_sweep(repo_root: pathlib.Path, path: pathlib.Path) -> None:
  """A 2x1 batch size x experts grid of the quickstart, as tiny as tests/e2e/test_multiprocess.py's."""
  tiny = {}
  for flag in FAIRMOE_TINY:
    key, value = flag.removeprefix("--config.").split("=", 1)
    if key != "batch_size":
      tiny[key] = value == "true" if value in ("true", "false") else int(value)
  path.write_text(textwrap.dedent(f"""\
          import ml_collections

          from paper_runner.spec import dotted


          def get_config(arg=None):
            return ml_collections.ConfigDict(dict(
                module="fairmoe_jax.main",
                config={str(repo_root / "configs" / "quickstart.py")!r},
                grid=dotted({{"batch_size": (16, 32), "moe.num_experts": (4,)}}),
                overrides=dotted({{**{tiny!r}, "num_train_steps": {SWEEP_STEPS}}}),
                metrics=("accuracy", "mf.pqd"),
            ))
          """))


def test_array_sweep_survives_a_cancelled_task_resumes_it_and_collects(repo_root, tmp_path):
  _require_cluster()
  sweep_file, workdir = tmp_path / "tiny_sweep.py", tmp_path / "sweep"
  _write_sweep(repo_root, sweep_file)
  sweep = [
      sys.executable,
      "-m",
      "paper_runner.sweep",
      f"--sweep={sweep_file}",
      f"--workdir={workdir}",
  ]
  written = subprocess.run(
      [*sweep, "--mode=commands"], cwd=repo_root, capture_output=True, text=True, timeout=300
  )
  assert written.returncode == 0, written.stderr
  commands = workdir / "commands.sh"
  kept = workdir / "runs" / "batch_size=16,moe.num_experts=4"
  cancelled = workdir / "runs" / "batch_size=32,moe.num_experts=4"
  array_script = str(repo_root / "launch" / "slurm_array.sh")

  # 1. Both runs as one array (1 CPU each: they run side by side); task 1 is cancelled mid-run.
  submitted = subprocess.run(
      ["bash", array_script, str(commands)],
      env=_job_env(),
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert submitted.returncode == 0, submitted.stdout + submitted.stderr
  assert "--array=0,1 " in submitted.stdout
  job = _job_id(submitted.stdout)
  try:
    _wait_for_steps(cancelled, 2, job)
    subprocess.run(["scancel", f"{job}_1"], env=_slurm_conf_env(), check=True, timeout=30)
    _wait_for_job(job)
  finally:
    subprocess.run(["scancel", job], env=_slurm_conf_env(), check=False, timeout=30)
  task_output = (workdir / "slurm" / f"{job}_0.out").read_text()
  # The job ran this test's interpreter (sbatch exported PATH), i.e. the repository's venv.
  assert f"python: {pathlib.Path(sys.executable).parent / 'python'}\n" in task_output
  assert (kept / "report.json").exists(), (kept / "log.txt").read_text()[-3000:]
  log = (cancelled / "log.txt").read_text()
  stopped = re.search(r"^Stopped at step (\d+);", log, re.M)
  assert stopped, f"scancel's SIGTERM did not stop the run with a checkpoint:\n{log[-3000:]}"
  stopped_at = int(stopped.group(1))
  assert 0 < stopped_at < SWEEP_STEPS and not (cancelled / "report.json").exists()
  kept_log = (kept / "log.txt").read_text()

  # 2. The same command again: only the cancelled run is submitted; it resumes and finishes.
  resubmitted = subprocess.run(
      ["bash", array_script, str(commands)],
      env=_job_env(SBATCH_WAIT="1"),
      capture_output=True,
      text=True,
      timeout=JOB_TIMEOUT_S,
  )
  assert resubmitted.returncode == 0, resubmitted.stdout + resubmitted.stderr
  assert f"done, skipped: {kept}\n" in resubmitted.stderr
  assert "--array=1 " in resubmitted.stdout
  assert (kept / "log.txt").read_text() == kept_log  # Not run again.
  log = (cancelled / "log.txt").read_text()
  assert f"Resumed from the checkpoint at step {stopped_at} in" in log, log[-3000:]
  assert [m["step"] for m in read_metrics(str(cancelled))] == list(range(1, SWEEP_STEPS + 1))
  # A task given a done run (a hand-made resubmission of the whole array) skips it too.
  task = subprocess.run(
      ["bash", str(repo_root / "launch" / "slurm_array.sbatch"), str(commands)],
      env={**_job_env(), "SLURM_ARRAY_TASK_ID": "0"},
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert task.returncode == 0 and "done, skipped" in task.stdout, task.stdout + task.stderr

  # 3. The table and the plots of both runs.
  collected = subprocess.run(
      [*sweep, "--mode=collect"], cwd=repo_root, capture_output=True, text=True, timeout=300
  )
  assert collected.returncode == 0, collected.stdout + collected.stderr
  table = (workdir / "sweep.md").read_text()
  rows = [line for line in table.splitlines() if re.match(r"\| (16|32) \| 4 \|", line)]
  assert len(rows) == 2 and all("| ok |" in row for row in rows), table
  assert (workdir / "plots" / "accuracy_vs_batch_size.png").exists()
