"""Two JAX processes on this machine (CPU collectives over gloo, localhost coordinator).

The same tiny training on one process and on two gives the same losses, across a SIGTERM that
reaches only one process (JAX's preemption sync point makes both save at the same step), a
resume, a process killed mid-run (the other stops at once with a message) and a second resume.
"""

import json
import signal
import subprocess
import sys
import time

import numpy as np

from conftest import CAUSAL_TINY_ARGS as CAUSAL_TINY
from conftest import SHARED_DATA
from multiprocess import HEARTBEAT_TIMEOUT_S, cpu_env, log_text, start
from trainkit.metric_writers import read_metrics

FAIRMOE_TINY = [
    "--config.data.train_size=256",
    "--config.data.val_size=32",
    "--config.data.test_size=64",
    "--config.model.dim=32",
    "--config.model.depth=2",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.batch_size=32",
    "--config.eval_batch_size=32",
    "--config.log_every_steps=1",
    "--config.checkpoint_every_steps=4",
    "--config.eval_every_steps=0",
    "--config.analysis_batches=0",
    "--config.plots=false",
]
STEPS = 16


def _fairmoe_args(repo_root, workdir):
  config = f"--config={repo_root}/configs/quickstart.py:steps={STEPS}"
  return [config, f"--workdir={workdir}"] + FAIRMOE_TINY


def _losses(workdir):
  return np.array([m["loss"] for m in read_metrics(str(workdir))])


def _logged_steps(workdir) -> int:
  metrics = workdir / "metrics.jsonl"
  return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait_for_steps(workdir, steps, processes, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if _logged_steps(workdir) >= steps:
      return
    assert all(p.poll() is None for p in processes), "a process ended before the signal"
    time.sleep(0.02)
  raise AssertionError(f"{steps} steps were not logged within {timeout} s")


def _single_process(module, args, repo_root, devices=1):
  result = subprocess.run(
      [sys.executable, "-m", module, *args],
      cwd=repo_root,
      env=cpu_env(devices),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]


def _wait_all(processes, logs, code=0):
  codes = [p.wait(timeout=300) for p in processes]
  assert codes == [code] * len(processes), log_text(logs, 0)[-3000:] + log_text(logs, 1)[-3000:]


def _start_two(repo_root, workdir, logs):
  return start(
      "fairmoe_jax.main", _fairmoe_args(repo_root, workdir), processes=2, cwd=repo_root, logs=logs
  )


def _checkpoints(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_two_processes_train_like_one_through_sigterm_a_dead_process_and_resumes(
    repo_root, tmp_path
):
  _single_process("fairmoe_jax.main", _fairmoe_args(repo_root, tmp_path / "one"), repo_root)
  reference = _losses(tmp_path / "one")
  assert len(reference) == STEPS
  workdir = tmp_path / "two"

  # 1. SIGTERM reaches process 1 only: both save at the same step and exit 143.
  logs = tmp_path / "sigterm"
  processes = _start_two(repo_root, workdir, logs)
  _wait_for_steps(workdir, 2, processes)
  processes[1].send_signal(signal.SIGTERM)
  _wait_all(processes, logs, code=128 + signal.SIGTERM)
  stopped = _checkpoints(workdir)[-1]
  assert stopped < STEPS, f"the run ended before the preemption: {_checkpoints(workdir)}"
  assert f"Stopped at step {stopped}" in log_text(logs, 0)
  assert "Stopped at step" not in log_text(logs, 1)  # Process 0 alone prints.

  # 2. Resumed on two processes; process 0 (the coordinator's host) is killed mid-run: process 1
  # stops at once with a message instead of hanging in a collective.
  logs = tmp_path / "killed"
  processes = _start_two(repo_root, workdir, logs)
  _wait_for_steps(workdir, min(stopped + 6, STEPS - 2), processes)
  processes[0].kill()
  killed_at = time.time()
  code = processes[1].wait(timeout=120)
  elapsed = time.time() - killed_at
  assert code not in (0, None)
  # Gloo notices the closed connection at once; the heartbeat timeout is the bound (with room
  # for a loaded machine: a hang would last until the test's own timeout).
  assert elapsed < HEARTBEAT_TIMEOUT_S + 30, f"the surviving process took {elapsed:.0f} s to stop"
  # Either our message (a collective failed first) or JAX's own (its coordination service,
  # hosted by the killed process 0, noticed first and aborted the process): both say why.
  survivor = log_text(logs, 1)
  assert (
      "Another process has most likely died" in survivor
      or "This most likely indicates that another task died" in survivor
  ), survivor[-2000:]

  # 3. Resumed again from the last complete checkpoint, to the end: the one-process losses.
  logs = tmp_path / "resumed"
  processes = _start_two(repo_root, workdir, logs)
  _wait_all(processes, logs)
  assert "Resumed from the checkpoint at step" in log_text(logs, 0)
  np.testing.assert_allclose(_losses(workdir), reference, rtol=1e-5)
  one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
  assert two["step"] == STEPS and two["num_examples"] == one["num_examples"]
  np.testing.assert_allclose(two["accuracy"], one["accuracy"], atol=1 / one["num_examples"])


def test_causal_transformer_on_two_processes_matches_one(repo_root, tmp_path):
  nli = SHARED_DATA / "nli"
  args = [
      f"--config={repo_root}/configs/mnli_hans.py:size=small,steps=4",
      f"--config.data.train_file={nli / 'mnli_dev_matched.tsv'}",
      f"--config.data.challenge_file={nli / 'hans_format_sample.txt'}",
      *CAUSAL_TINY,
      "--config.log_every_steps=1",
  ]
  _single_process("causal_attn_jax.main", args + [f"--workdir={tmp_path / 'one'}"], repo_root)
  logs = tmp_path / "two"
  processes = start(
      "causal_attn_jax.main",
      args + [f"--workdir={tmp_path / 'two'}"],
      processes=2,
      cwd=repo_root,
      logs=logs,
  )
  codes = [p.wait(timeout=300) for p in processes]
  assert codes == [0, 0], log_text(logs, 0)[-3000:] + log_text(logs, 1)[-3000:]
  np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)
  one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
  for key in ("accuracy", "macro_f1", "num_examples"):
    assert two[key] == one[key], key
  # The tokenizer was trained once (by process 0) and loaded by process 1.
  assert (tmp_path / "two" / "spm.model").is_file()
