"""`trainkit.recipe`, the skeleton both packages' train.py share, on a toy regression recipe:
training learns and writes the report once; a rerun resumes instead of retraining; a trained
workdir restores the same parameters; SIGTERM leaves a checkpoint and no report."""

import json
import os
import signal

import flax.nnx as nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from trainkit import recipe
from trainkit.checkpoint import restore_trained
from trainkit.metric_writers import read_metrics
from trainkit.optim import default_optimizer_config
from trainkit.train_state import create_train_state
from trainkit.workdir import save_config

TRUE_W = np.array([[2.0], [-3.0]], np.float32)


class _Regression:
  """Batches of y = x @ TRUE_W; sends SIGTERM while producing batch `signal_at` (1-based)."""

  def __init__(self, signal_at: int = -1):
    self.position, self.signal_at = 0, signal_at

  def __next__(self):
    self.position += 1
    if self.position == self.signal_at:
      os.kill(os.getpid(), signal.SIGTERM)
    x = np.random.default_rng(self.position).normal(size=(8, 2)).astype(np.float32)
    return {"x": x, "y": x @ TRUE_W}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = int(state["position"])


def _config(steps: int = 60) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(
      dict(
          seed=0,
          mesh=dict(data=-1, expert=1),
          batch_size=8,
          num_epochs=0.0,
          num_train_steps=steps,
          log_every_steps=10,
          eval_every_steps=20,
          checkpoint_every_steps=20,
          keep_checkpoints=2,
          peak_flops_per_device=0.0,
          optimizer=default_optimizer_config(),
      )
  )
  config.optimizer.update(learning_rate=0.1, warmup_steps=0, weight_decay=0.0)
  return config


def _loss_fn(model, batch, rng, step, extra):
  del rng, step, extra
  loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  return loss, {"mse": loss}


def _setup(config, workdir, training=True) -> recipe.Run:
  return recipe.setup(
      config,
      str(workdir),
      train_examples=1000,
      create_state=lambda tx, mesh: create_train_state(
          lambda: nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(params=0)), tx, mesh, 0
      ),
      training=training,
  )


def _weights(run: recipe.Run, state) -> np.ndarray:
  return np.asarray(nnx.merge(run.graphdef, state.params, state.model_state).kernel[...])


def _train_and_finish(workdir, config):
  run = _setup(config, workdir)
  evaluations = []
  trained = recipe.train(
      run,
      train_iterator=_Regression(),
      loss_fn=_loss_fn,
      evaluate=lambda state: evaluations.append(int(state.step)) or {"val/seen": 1.0},
  )
  report = {"w": _weights(run, trained.state).tolist(), "step": int(trained.state.step)}
  recipe.finish(
      run,
      trained.state,
      report,
      writer=trained.writer,
      scalars={"final/w0": report["w"][0][0]},
      write_report=lambda r: (workdir / "report.json").write_text(json.dumps(r)),
  )
  return run, trained, evaluations


def test_a_recipe_trains_evaluates_and_writes_one_report(tmp_path):
  run, trained, evaluations = _train_and_finish(tmp_path, _config())
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["step"] == 60 and int(trained.state.step) == 60
  np.testing.assert_allclose(report["w"], TRUE_W, atol=0.25)  # It learnt the regression.
  assert evaluations == [20, 40, 60]
  metrics = read_metrics(str(tmp_path))
  mse = [m["mse"] for m in metrics if "mse" in m]
  assert mse[-1] < mse[0] / 5  # Logged at steps 10..60; y's variance is 13.
  assert metrics[-1]["step"] == 60 and metrics[-1]["final/w0"] == pytest.approx(report["w"][0][0])
  assert os.path.exists(tmp_path / "config.json")  # resume_training saved the run's config.
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1].endswith("60")


def test_a_rerun_resumes_the_finished_run_and_a_trained_workdir_restores_it(tmp_path):
  first, trained, _ = _train_and_finish(tmp_path, _config())
  trained_w = _weights(first, trained.state)

  rerun, retrained, evaluations = _train_and_finish(tmp_path, _config())
  assert evaluations == []  # Nothing left to train: resumed at step 60.
  np.testing.assert_array_equal(_weights(rerun, retrained.state), trained_w)

  evaluation = _setup(_config(), tmp_path, training=False)
  state, step = restore_trained(evaluation.checkpointer, evaluation.state)
  assert step == 60
  np.testing.assert_array_equal(_weights(evaluation, state), trained_w)
  # finish after restore_trained (which closed the checkpointer) may close it again.
  report = recipe.finish(evaluation, state, {}, write_report=lambda r: None)
  assert list(report) == ["evaluated"] and report["evaluated"]["step"] == 60


def test_with_a_parameter_ema_the_evaluations_and_the_trained_state_read_it(tmp_path):
  """optimizer.ema_decay changes no training step; what `evaluate` and `Trained.state` (the
  final report's) see is the EMA in the optimizer state, not the trained parameters."""
  trained_w = {}
  for decay in (0.0, 0.9):
    config = _config(steps=20)
    config.optimizer.ema_decay = decay
    run = _setup(config, tmp_path / str(decay))
    seen = []
    trained = recipe.train(
        run,
        train_iterator=_Regression(),
        loss_fn=_loss_fn,
        evaluate=lambda state: seen.append(_weights(run, state)) or {"val/seen": 1.0},
    )
    trained_w[decay] = _weights(run, trained.state)
    np.testing.assert_array_equal(seen[-1], trained_w[decay])  # Step 20's evaluation.
  ema = optax.tree.get(trained.state.opt_state, "ema_params")["kernel"]
  np.testing.assert_array_equal(trained_w[0.9], ema)
  # From the initial weights, 0.9 per update: 20 updates leave it well behind the parameters.
  assert np.abs(trained_w[0.9] - trained_w[0.0]).max() > 0.1


def test_sigterm_stops_with_a_checkpoint_and_the_same_command_finishes(tmp_path, capsys):
  config = _config()
  run = _setup(config, tmp_path)
  with pytest.raises(SystemExit) as stopped:
    recipe.train(run, train_iterator=_Regression(signal_at=7), loss_fn=_loss_fn)
  assert stopped.value.code == 128 + signal.SIGTERM  # A pre-emption, not a finished run.
  # The signal comes while batch 7 is read; the loop reads batches ahead of its steps
  # (trainkit.prefetch), so it stops at step 7 or a little before.
  [stopped_at] = run.checkpointer.all_steps()
  assert 1 <= stopped_at <= 7
  assert not (tmp_path / "report.json").exists()

  capsys.readouterr()
  _, resumed, evaluations = _train_and_finish(tmp_path, config)
  assert f"Resumed from the checkpoint at step {stopped_at}" in capsys.readouterr().out
  assert int(resumed.state.step) == 60 and evaluations == [20, 40, 60]
  steps = [m["step"] for m in read_metrics(str(tmp_path)) if "mse" in m]
  assert steps == sorted(set(steps))  # The log was rewound to step 7, not duplicated.


def test_sigterm_before_the_first_step_stops_after_the_compile_with_nothing_to_save(
    tmp_path, capsys
):
  """A SIGTERM during the first compile was acted on after one more step,
  and the run exited 0."""
  run = _setup(_config(), tmp_path)
  with pytest.raises(SystemExit) as stopped:
    recipe.train(run, train_iterator=_Regression(signal_at=1), loss_fn=_loss_fn)
  assert stopped.value.code == 128 + signal.SIGTERM
  assert run.checkpointer.all_steps() == [] and not (tmp_path / "metrics.jsonl").exists()
  assert "Stopped at step 0; rerun the same command to resume." in capsys.readouterr().out


def test_an_evaluation_that_falls_back_keeps_the_record_of_the_step_it_could_not_read(tmp_path):
  _train_and_finish(tmp_path, _config())
  (tmp_path / "predictions.csv").write_text("index,prediction\n0,1\n")
  finished = json.loads((tmp_path / "report.json").read_text())
  assert finished["step"] == 60
  for root, _, files in os.walk(tmp_path / "checkpoints" / "60"):  # A corrupt newest step.
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  evaluation = _setup(_config(), tmp_path, training=False)
  state, step = restore_trained(evaluation.checkpointer, evaluation.state)
  assert step == 40  # Fell back.
  report = recipe.finish(
      evaluation,
      state,
      {"step": step},
      write_report=lambda r: (tmp_path / "report.json").write_text(json.dumps(r)),
  )
  assert json.loads((tmp_path / "report.json").read_text())["step"] == 40
  assert report["earlier_report"] == "report.step-60.json"
  assert json.loads((tmp_path / "report.step-60.json").read_text()) == finished
  assert (tmp_path / "predictions.step-60.csv").read_text() == "index,prediction\n0,1\n"
  assert not (tmp_path / "predictions.csv").exists()  # This evaluation writes its own.


def test_an_evaluation_of_other_data_at_the_same_step_keeps_the_earlier_record(tmp_path, capsys):
  _train_and_finish(tmp_path, _config())
  save_config(_config(), str(tmp_path))  # As the entry point saves it: what training used.
  (tmp_path / "predictions.csv").write_text("index,prediction\n0,1\n")
  finished = json.loads((tmp_path / "report.json").read_text())
  assert finished["evaluated"]["step"] == 60

  def evaluate(config):
    evaluation = _setup(config, tmp_path, training=False)
    state, _ = restore_trained(evaluation.checkpointer, evaluation.state)
    return recipe.finish(
        evaluation,
        state,
        {"step": 60},
        write_report=lambda r: (tmp_path / "report.json").write_text(json.dumps(r)),
    )

  # The same evaluation again replaces the record (a rerun, nothing kept).
  capsys.readouterr()
  assert "earlier_report" not in evaluate(_config())
  assert "differs from training" not in capsys.readouterr().out
  assert json.loads((tmp_path / "report.json").read_text())["evaluated"] == finished["evaluated"]
  # Other data at the same step: the earlier record is kept under its config's fingerprint.
  other = _config()
  other.seed = 7
  report = evaluate(other)
  kept = f"report.step-60.config-{finished['evaluated']['config_sha256'][:12]}.json"
  assert report["earlier_report"] == kept
  # The report names the settings, and the console says what it kept.
  assert report["evaluated"]["differs_from_training"] == ["seed: 0 -> 7"]
  out = capsys.readouterr().out
  assert "This evaluation differs from training in seed: 0 -> 7\n" in out
  assert f"Kept the earlier record as {kept} (its predictions beside it)" in out
  assert json.loads((tmp_path / kept).read_text())["evaluated"] == finished["evaluated"]
  assert (tmp_path / kept.replace("report", "predictions").replace(".json", ".csv")).exists()
  assert report["evaluated"]["config_sha256"] != finished["evaluated"]["config_sha256"]
  # Back to the first config: the seed-7 record is kept too, and nothing is overwritten.
  seed_7 = report["evaluated"]["config_sha256"][:12]
  report = evaluate(_config())
  assert report["earlier_report"] == f"report.step-60.config-{seed_7}.json"
  assert sorted(p.name for p in tmp_path.glob("report*.json")) == sorted(
      ["report.json", kept, f"report.step-60.config-{seed_7}.json"]
  )
