"""End to end through `python -m fairmoe_jax.main`: training, reports, resume, SIGTERM, bad input."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import QUICKSTART_RUN_ARGS, QUICKSTART_STEPS, QUICKSTART_TINY_ARGS, one_device_env
from fairmoe_jax import config as fairmoe_config
from trainkit.errors import USER_ERROR_EXIT_CODE, ConfigError
from trainkit.metric_writers import read_metrics

# A tiny model and dataset so each run takes seconds; everything else is the quickstart.
TINY = QUICKSTART_TINY_ARGS
_env = one_device_env
QUICKSTART = "configs/quickstart.py"
STEPS = QUICKSTART_STEPS  # The shared quickstart run's length: its train step, compiled once.


def _command(repo_root, workdir, *args, config="configs/quickstart.py"):
  return [
      sys.executable,
      "-m",
      "fairmoe_jax.main",
      f"--config={repo_root / config}",
      f"--workdir={workdir}",
      *args,
  ]


def _run(repo_root, workdir, *args, **kwargs):
  return subprocess.run(
      _command(repo_root, workdir, *args, **kwargs),
      cwd=repo_root,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=600,
  )


def _losses(workdir):
  return {m["step"]: m["loss"] for m in read_metrics(str(workdir))}


def test_quickstart_reduced_trains_evaluates_and_reports(quickstart_run, repo_root, tmp_path):
  # The session's reduced quickstart run (tests/conftest.py: QUICKSTART_RUN_ARGS).
  result, workdir = quickstart_run.result, quickstart_run.workdir
  assert result.returncode == 0, result.stderr
  report = json.loads((workdir / "report.json").read_text())
  assert report["num_examples"] == 128 and 0.0 <= report["accuracy"] <= 1.0
  assert set(report["attributes"]) == {"sex", "age", "site"}
  for attribute in report["attributes"].values():
    assert {"pqd", "dp", "eopp", "eodds", "groups"} <= set(attribute)
    assert sum(g["n"] for g in attribute["groups"].values()) == 128
  assert set(report["mf"]) >= {"pqd", "dp", "eodds"}
  plots = sorted(p.name for p in (workdir / "plots").iterdir())
  assert plots == [
      "allocation_history.png",
      "expert_activation_moe_block1.png",
      "gradient_cosine.png",
      "group_accuracy.png",
      "validation_curves.png",
  ]
  # Fig. 6's analysis: cosines between the attribute tasks' gradients at the MoE layer.
  cosines = [c for pair in report["gradient_cosine"].values() for c in pair]
  assert cosines and all(-1.0 - 1e-6 <= c <= 1.0 + 1e-6 for c in cosines)
  # FEM reviews on its own cadence (steps 10 and 20; none after the last step).
  history = report["allocation_history"]
  assert [h["step"] for h in history] == [10, 20]
  # What FEM did, read from those reviews, on the console.
  assert report["fem_reading"].startswith(f"FEM's reading: {len(report['fem_changes'])} change(s)")
  assert f" in {len(history)} reviews" in report["fem_reading"]
  assert report["fem_reading"] in result.stdout
  assert all(set(h["experts"]) == {"sex", "age", "site"} for h in history)
  assert set(report["experts_per_attribute"]) == {"sex", "age", "site"}
  # Expert usage by choices and by gate weight, each summarised as experts active.
  assert set(report["experts_active"]) == {"choices", "gate_weight"}
  assert set(report["expert_gate_weight"]["moe_block1"]) == {"sex", "age", "site"}
  assert "Experts active" in result.stdout
  # Whether FGR's SA classifiers beat the majority rate of the test split's groups.
  for name, classifier in report["sa_classifiers"]["moe_block1"].items():
    sizes = [g["n"] for g in report["attributes"][name]["groups"].values()]
    assert classifier["majority_rate"] == max(sizes) / sum(sizes)
    assert 0.0 <= classifier["accuracy"] <= 1.0
  assert "FGR's sensitive-attribute classifiers (moe_block1)" in result.stdout
  # Whether the accuracy means anything: above the test split's majority class and chance.
  check = report["reference_check"]
  assert report["meaningful"] is check["meaningful"] and check["num_examples"] == 128
  assert check["meaningful"] == (check["accuracy_interval"][0] > check["majority_rate"])
  assert ("Warning: accuracy" in result.stdout) is not check["meaningful"]
  # The progress line's loss is the total, and a line says once what it sums.
  assert "| total loss " in result.stderr and "| task loss " in result.stderr
  assert result.stderr.count("total loss = cross_entropy (the task loss) + ") == 1
  by_group = report["experts_active_by_group"]["choices"]["moe_block1"]["age"]
  assert set(by_group) <= set(report["attributes"]["age"]["groups"]) and by_group
  assert all(1.0 - 1e-6 <= v <= 4.0 + 1e-6 for v in by_group.values())
  # Routing by group, from the run's own per-group shares: the largest TV distance, named.
  from fairmoe_jax.evaluation import group_divergence

  shares = report["expert_utilisation"]["moe_block1"]
  split = np.asarray(report["expert_share"]["choices"]["moe_block1"], np.float64)
  expected, group = group_divergence(split, shares)
  routed = report["routing_by_group"]["moe_block1"]
  assert routed["group"] == group and 0.0 <= routed["divergence"] <= 1.0
  assert routed["divergence"] == pytest.approx(expected, abs=1e-5)  # Shares rounded to 1e-6.
  assert f"Routing by group (moe_block1): the group routed least like the split is {group}" in (
      result.stdout
  )
  metrics = read_metrics(str(workdir))
  assert [m["step"] for m in metrics if "loss" in m] == [10, 15, 20, 30]
  assert all("fem/experts/site" in m for m in metrics if m["step"] in (10, 20))
  for m in (m for m in metrics if "loss" in m):  # The loss is the sum of its logged terms.
    terms = [v for k, v in m.items() if k.startswith("loss/")]
    assert len(terms) == 5 and abs(sum(terms) - m["loss"]) < 1e-4 * abs(m["loss"])
  assert any("val/accuracy" in m for m in metrics) and "test/mf_pqd" in metrics[-1]
  # Throughput accounting: FLOPs from the compiled step (no MFU on CPU: no known peak).
  assert metrics[-1]["tokens_per_second"] == metrics[-1]["examples_per_second"] * 64
  assert metrics[-1]["model_tflops_per_second_per_device"] > 0 and "mfu" not in metrics[-1]
  assert os.listdir(workdir / "tensorboard")
  for name in ("sex", "age", "site", "MF"):
    assert name in result.stdout
  # --mode=eval on (a copy of) the workdir reproduces the report and the predictions from the
  # final checkpoint.
  copy = shutil.copytree(workdir, tmp_path / "run")
  (copy / "predictions.csv").unlink()
  args = QUICKSTART_RUN_ARGS[1:]  # Its overrides, after its --config.
  evaluated = _run(repo_root, copy, *args, "--mode=eval", config=f"{QUICKSTART}:steps={STEPS}")
  assert evaluated.returncode == 0, evaluated.stderr
  assert json.loads((copy / "report.json").read_text())["accuracy"] == report["accuracy"]
  assert (copy / "predictions.csv").read_text() == (workdir / "predictions.csv").read_text()


RESUME = TINY + [
    "--config.analysis_batches=0",
    "--config.log_every_steps=1",
    "--config.checkpoint_every_steps=5",
    "--config.eval_every_steps=0",
]


def _interrupt(repo_root, workdir, sig, after_step):
  """Starts a STEPS-step run and sends `sig` once `after_step` has been logged."""
  process = subprocess.Popen(
      _command(repo_root, workdir, *RESUME, config=f"{QUICKSTART}:steps={STEPS}"),
      cwd=repo_root,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= after_step:
      process.send_signal(sig)
      break
    time.sleep(0.01)
  stdout, stderr = process.communicate(timeout=300)
  return process.returncode, stdout, stderr


def test_sigterm_then_sigkill_then_resume_log_the_uninterrupted_losses(repo_root, tmp_path):
  reference = _run(repo_root, tmp_path / "reference", *RESUME, config=f"{QUICKSTART}:steps={STEPS}")
  assert reference.returncode == 0, reference.stderr
  reference_losses = _losses(tmp_path / "reference")
  workdir = tmp_path / "run"

  # SIGTERM saves at the current step, not only at the last periodic checkpoint, and exits 143
  # (a pre-emption, not a finished run).
  code, stdout, stderr = _interrupt(repo_root, workdir, signal.SIGTERM, after_step=7)
  assert code == 128 + signal.SIGTERM, stderr
  assert "Stopped at step" in stdout
  stopped = max(_losses(workdir))
  assert stopped < STEPS, "the run finished before the signal arrived"
  assert str(stopped) in os.listdir(workdir / "checkpoints")

  # The resumed run is killed outright: the next resume starts from the last periodic checkpoint.
  code, stdout, _ = _interrupt(repo_root, workdir, signal.SIGKILL, after_step=stopped + 8)
  assert code == -signal.SIGKILL
  assert f"Resumed from the checkpoint at step {stopped}" in stdout

  resumed = _run(repo_root, workdir, *RESUME, config=f"{QUICKSTART}:steps={STEPS}")
  assert resumed.returncode == 0, resumed.stderr
  assert "Resumed from the checkpoint at step" in resumed.stdout
  assert _losses(workdir) == reference_losses


# One process per way a config fails: its flag parse and its check (an unknown key's:
# tests/fairmoe_jax/test_cli_help.py); the check's other cases run in process below.
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--config.batch_size=abc"], "batch_size"),
        (
            ["--config.moe.num_experts=3", "--config.mesh.expert=1", "--config.moe.top_k=4"],
            "moe.top_k",
        ),
    ],
)
def test_bad_config_fails_fast_naming_the_key(repo_root, tmp_path, args, needle):
  result = _run(repo_root, tmp_path, *args)
  assert result.returncode != 0
  assert needle in result.stderr
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "checkpoints").exists()


def test_the_quickstart_config_check_names_the_key():
  # The check the command makes on one device before it writes anything, in process.
  for override in ({"mesh.data": 4}, {"model.patch_size": 5}, {"batch_size": 0}):
    config = fairmoe_config.quickstart_config()
    config.update_from_flattened_dict(override)
    with pytest.raises(ConfigError) as raised:
      fairmoe_config.validate(config, num_devices=1)
    assert raised.value.key == next(iter(override))


def test_bad_config_file_argument_names_the_key(repo_root, tmp_path):
  result = _run(repo_root, tmp_path, config="configs/quickstart.py:stepz=3")
  assert result.returncode != 0 and "stepz" in result.stderr


def test_unwritable_workdir_is_one_clear_message(repo_root, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  result = _run(repo_root, blocker / "run")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "not writable" in result.stderr and "Traceback" not in result.stderr


def test_eval_without_checkpoint_is_one_clear_message(repo_root, tmp_path):
  result = _run(repo_root, tmp_path, *TINY, "--mode=eval")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "no checkpoint" in result.stderr and "Traceback" not in result.stderr


def test_corrupt_checkpoint_directory_is_one_clear_message(repo_root, tmp_path):
  step_dir = tmp_path / "checkpoints" / "5"
  step_dir.mkdir(parents=True)
  (step_dir / "state").write_text("garbage")
  result = _run(repo_root, tmp_path, *TINY, "--mode=eval")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "no readable checkpoint" in result.stderr and "Traceback" not in result.stderr


def test_missing_config_file_is_one_clear_message(repo_root, tmp_path):
  result = _run(repo_root, tmp_path, config="configs/does_not_exist.py")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "does_not_exist.py" in result.stderr and "No such file" in result.stderr
  assert "Traceback" not in result.stderr


def test_the_report_says_how_many_tokens_the_moe_dropped_and_what_validation_gave(
    repo_root, tmp_path
):
  """`dropped` (train and test) is what a comparison of methods checks for equal treatment;
  `validation` is what a protocol that chooses on validation reads."""
  fractions = {}
  for factor in ("0.5", "2.0"):  # 4 experts, top-2: 0.5 must drop, 2.0 cannot.
    workdir = tmp_path / factor
    result = _run(
        repo_root,
        workdir,
        *TINY,
        "--config.method=vanilla_smoe_psi",
        "--config.eval_every_steps=0",
        "--config.log_every_steps=2",
        "--config.analysis_batches=0",  # The gradient analysis: a program of its own, unread here.
        f"--config.moe.capacity_factor={factor}",
        f"--config.moe.eval_capacity_factor={factor}",
        config="configs/quickstart.py:steps=6",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((workdir / "report.json").read_text())
    assert "Plots:" not in result.stdout and not (workdir / "plots").exists()  # plots=false.
    fractions[factor] = report["dropped"]
    assert report["validation"]["num_examples"] == 64
    assert 0.0 <= report["validation"]["accuracy"] <= 1.0 and "pqd" in report["validation"]["mf"]
    logged = [m["loss/fairness"] for m in read_metrics(str(workdir)) if "loss/fairness" in m]
    assert logged and all(v >= 0 for v in logged)  # vanilla_smoe_psi trains lambda * L_Psi.
  assert fractions["0.5"]["train"] > 0.2 and fractions["0.5"]["test"] > 0.2
  assert fractions["2.0"] == {"train": 0.0, "test": 0.0}


def test_a_workdir_deleted_while_training_is_one_line(repo_root, tmp_path):
  # It used to end in two chained tracebacks (the metrics log, then the empty-workdir clean-up).
  workdir = tmp_path / "run"
  process = subprocess.Popen(
      _command(repo_root, workdir, *RESUME, config="configs/quickstart.py:steps=100000"),
      cwd=repo_root,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
      shutil.rmtree(workdir)
      break
    time.sleep(0.01)
  _, stderr = process.communicate(timeout=300)
  assert process.returncode == USER_ERROR_EXIT_CODE, stderr[-3000:]
  (line,) = stderr.strip().splitlines()[-1:]
  assert line.startswith(f"error: the workdir {workdir} vanished while the run was using it")
  assert "Traceback" not in stderr, stderr[-3000:]
  assert not workdir.exists()  # Nothing recreated.


def _sigterm_once_locked(repo_root, workdir, *args, config=QUICKSTART, settle_s=0.0):
  """Starts a run, sends it SIGTERM `settle_s` after its `.run.lock` appears; (code, out, err)
  once it exits, which must be within 30 s of the signal."""
  process = subprocess.Popen(
      _command(repo_root, workdir, *args, config=config),
      cwd=repo_root,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  try:
    deadline = time.time() + 120
    while not (workdir / ".run.lock").exists():
      assert process.poll() is None and time.time() < deadline, process.communicate()
      time.sleep(0.05)
    time.sleep(settle_s)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
  finally:
    if process.poll() is None:
      process.kill()
  return process.returncode, out, err


def test_sigterm_before_the_first_step_ends_the_run_at_once_without_its_lock(repo_root, tmp_path):
  """Outside the training steps (set-up, the first compile, the plots) SIGTERM
  killed the run silently and left its lock; in the first compile it waited for a step."""
  workdir = tmp_path / "run"
  code, out, err = _sigterm_once_locked(
      repo_root, workdir, *RESUME, config=f"{QUICKSTART}:steps={STEPS}"
  )
  assert code == 128 + signal.SIGTERM, err
  assert "stopped by SIGTERM outside the training steps" in err or "Stopped at step 0;" in out
  assert not (workdir / ".run.lock").exists() and not (workdir / "metrics.jsonl").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiles for a TPU target: needs libtpu (python -m trainkit.preflight.compilers)",
)
def test_sigterm_during_compile_leaves_no_lock_and_no_stack_dump(repo_root, tmp_path):
  # SIGTERM killed `--mode=compile` without any clean-up: a stale .run.lock (a new workdir
  # held nothing else) and, for a TPU target, libtpu's native stack dump.
  workdir = tmp_path / "compile"
  args = ("--mode=compile", "--config.preflight.target=v5e-8")
  # Into the compilation; the run ends at once, not after it.
  code, _, err = _sigterm_once_locked(repo_root, workdir, *args, settle_s=1.0)
  assert code == 128 + signal.SIGTERM, err
  assert err.strip().splitlines()[-1] == (
      "stopped by SIGTERM during --mode=compile; nothing was written"
  ), err
  assert "RAW:" not in err and "SIGTERM received" not in err, err  # libtpu's crash report.
  assert not workdir.exists()  # Created by this run, and left with nothing.
  # In a workdir that existed, only the lock goes.
  workdir.mkdir()
  (workdir / "notes.txt").write_text("mine")
  code, _, err = _sigterm_once_locked(repo_root, workdir, *args)
  assert code == 128 + signal.SIGTERM, err
  assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
