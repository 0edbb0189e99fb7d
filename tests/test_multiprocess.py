"""Two JAX processes on this machine (CPU collectives over gloo, localhost coordinator).

The same tiny training on one process and on two gives the same losses, also across a
SIGTERM that reaches only one process (JAX's preemption sync point makes both save at the
same step) and a resume; a process that dies makes the other stop at once with a message.
"""

import json
import signal
import subprocess
import sys
import time

import numpy as np

from conftest import SHARED_DATA
from multiprocess import cpu_env, log_text, start
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
    "--config.checkpoint_every_steps=100",
    "--config.eval_every_steps=0",
    "--config.analysis_batches=1",
]
STEPS = 40


def _fairmoe_args(repo_root, workdir, steps=STEPS):
  return [f"--config={repo_root}/configs/quickstart.py:steps={steps}", f"--workdir={workdir}"] + (
      FAIRMOE_TINY
  )


def _losses(workdir):
  return np.array([m["loss"] for m in read_metrics(str(workdir))])


def _wait_for_steps(workdir, steps, processes, timeout=300):
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + timeout
  while time.time() < deadline:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
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


def test_two_processes_train_like_one_across_a_one_sided_sigterm(repo_root, tmp_path):
  _single_process("fairmoe_jax.main", _fairmoe_args(repo_root, tmp_path / "one"), repo_root)
  reference = _losses(tmp_path / "one")

  workdir, logs = tmp_path / "two", tmp_path / "first"
  processes = start(
      "fairmoe_jax.main", _fairmoe_args(repo_root, workdir), processes=2, cwd=repo_root, logs=logs
  )
  _wait_for_steps(workdir, 4, processes)
  processes[1].send_signal(signal.SIGTERM)  # Only one process is told.
  codes = [p.wait(timeout=300) for p in processes]
  assert codes == [0, 0], log_text(logs, 0)[-3000:] + log_text(logs, 1)[-3000:]
  saved = sorted(int(s.name) for s in (workdir / "checkpoints").iterdir() if s.name.isdigit())
  assert len(saved) == 1 and saved[0] < STEPS, f"checkpoints {saved}: no preemption save"
  # Printed by process 0 only.
  assert f"Stopped at step {saved[0]}" in log_text(logs, 0)
  assert "Stopped at step" not in log_text(logs, 1)

  logs = tmp_path / "resumed"
  processes = start(
      "fairmoe_jax.main", _fairmoe_args(repo_root, workdir), processes=2, cwd=repo_root, logs=logs
  )
  codes = [p.wait(timeout=300) for p in processes]
  assert codes == [0, 0], log_text(logs, 0)[-3000:] + log_text(logs, 1)[-3000:]
  assert f"Resumed from the checkpoint at step {saved[0]}" in log_text(logs, 0)
  np.testing.assert_allclose(_losses(workdir), reference, rtol=1e-5)
  report = json.loads((workdir / "report.json").read_text())
  assert report["step"] == STEPS
  assert (
      report["num_examples"]
      == json.loads((tmp_path / "one/report.json").read_text())["num_examples"]
  )


def test_a_dead_process_stops_the_other_at_once_with_a_message(repo_root, tmp_path):
  workdir, logs = tmp_path / "run", tmp_path / "run"
  processes = start(
      "fairmoe_jax.main",
      _fairmoe_args(repo_root, workdir, steps=2000),
      processes=2,
      cwd=repo_root,
      logs=logs,
  )
  _wait_for_steps(workdir, 3, processes)
  processes[0].kill()  # The coordinator's host: the harder case.
  killed_at = time.time()
  code = processes[1].wait(timeout=120)
  elapsed = time.time() - killed_at
  assert code not in (0, None)
  # Gloo notices the closed connection at once; the heartbeat timeout (15 s) is the bound.
  assert elapsed < 40, f"the surviving process took {elapsed:.0f} s to stop"
  assert "Another process has most likely died" in log_text(logs, 1)


def test_causal_transformer_on_two_processes_matches_one(repo_root, tmp_path):
  nli = SHARED_DATA / "nli"
  args = [
      f"--config={repo_root}/configs/mnli_hans.py:size=small,steps=4",
      f"--config.data.train_file={nli / 'mnli_dev_matched.tsv'}",
      f"--config.data.challenge_file={nli / 'hans_format_sample.txt'}",
      "--config.model.dim=16",
      "--config.model.num_layers=1",
      "--config.model.num_heads=2",
      "--config.model.mlp_dim=16",
      "--config.data.vocab_size=200",
      "--config.data.max_len=24",
      "--config.data.max_train_examples=256",
      "--config.data.max_eval_examples=64",
      "--config.batch_size=16",
      "--config.eval_batch_size=32",
      "--config.log_every_steps=1",
      "--config.eval_every_steps=0",
      "--config.plots.num_examples=1",
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
