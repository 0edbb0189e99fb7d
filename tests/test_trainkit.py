"""The shared training kit: mesh, config arguments, optimiser, checkpoints, metric writer."""

import contextlib
import errno
import gc
import glob
import gzip
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_disk
from trainkit import checkpoint as checkpoint_module
from trainkit import config as cfg
from trainkit.checkpoint import Checkpointer
from trainkit.errors import ConfigError, OutOfSpace, UserError, exit_on_user_error, is_out_of_space
from trainkit.loop import TrainingDiverged, train_loop
from trainkit.mesh import batch_sharding, make_mesh, mesh_shape, shard_batch
from trainkit.metric_writers import MetricWriter, read_metrics
from trainkit.optim import default_optimizer_config, learning_rate_schedule, make_optimizer
from trainkit.progress import ProgressBar
from trainkit.train_state import TrainState
from trainkit.workdir import prepare_workdir, save_config, workdir_lock


def test_eight_fake_devices_are_visible():
  assert jax.device_count() == 8


@pytest.mark.parametrize("data,expert", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_mesh_shapes_on_eight_devices(data, expert):
  mesh = make_mesh({"data": data, "expert": expert})
  assert dict(mesh.shape) == {"data": data, "expert": expert}
  batch = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3)}
  x = shard_batch(batch, mesh)["x"]
  assert x.sharding == batch_sharding(mesh)
  # Each device holds a distinct 1/8 of the batch rows.
  rows = sorted(int(s.data[0, 0]) // 3 for s in x.addressable_shards)
  assert rows == list(range(0, 16, 2))
  np.testing.assert_array_equal(np.asarray(x), batch["x"])


def test_mesh_minus_one_fills_remaining_devices():
  assert mesh_shape({"data": -1, "expert": 2}, 8) == (4, 2)
  assert mesh_shape({"data": 2, "expert": -1}, 8) == (2, 4)
  assert mesh_shape({"data": 2, "expert": 2}, 8) == (2, 2)  # A smaller mesh uses the first devices.


@pytest.mark.parametrize(
    "mesh_config,key",
    [
        ({"data": 4, "expert": 4}, "mesh"),
        # The key set to a number that does not divide 8, not mesh.data's default -1.
        ({"data": -1, "expert": 3}, "mesh.expert"),
        ({"data": -1, "expert": -1}, "mesh"),
        ({"data": 0, "expert": 1}, "mesh.data"),
        ({"data": 1, "expert": "2"}, "mesh.expert"),
        ({"data": -1, "expert": 16}, "mesh.expert"),  # The key set too large, not the -1.
        ({"data": 9, "expert": 1}, "mesh.data"),
    ],
)
def test_impossible_meshes_name_the_key(mesh_config, key):
  with pytest.raises(ConfigError) as e:
    mesh_shape(mesh_config, 8)
  assert e.value.key == key
  assert key in str(e.value)


def test_parse_arg_converts_to_default_types():
  arg = cfg.parse_arg(
      "steps=10,lr=0.5,name=x,flag,blocks=(1, 2)",
      steps=1,
      lr=1.0,
      name="a",
      flag=False,
      blocks=(0,),
  )
  assert (arg.steps, arg.lr, arg.name, arg.flag, arg.blocks) == (10, 0.5, "x", True, (1, 2))
  assert cfg.parse_arg(None, steps=3).steps == 3


@pytest.mark.parametrize(
    "arg,key", [("nope=1", "nope"), ("steps=ten", "steps"), ("flag=maybe", "flag")]
)
def test_parse_arg_errors_name_the_key(arg, key):
  with pytest.raises(ConfigError, match=f"'{key}'"):
    cfg.parse_arg(arg, steps=1, flag=False)


def test_schedule_warms_up_then_decays_to_the_floor():
  config = default_optimizer_config()
  config.learning_rate, config.warmup_steps, config.final_lr_fraction = 1.0, 10, 0.1
  schedule = learning_rate_schedule(config, 110)
  np.testing.assert_allclose(
      [schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
      [0.0, 0.5, 1.0, 0.55, 0.1],
      rtol=1e-5,
      atol=1e-6,
  )


@pytest.mark.parametrize(
    "scaling,batch_size,expected",
    [("none", 1024, 0.4), ("linear", 1024, 1.6), ("linear", 64, 0.1), ("sqrt", 1024, 0.8)],
)
def test_peak_learning_rate_scales_with_the_batch_size(scaling, batch_size, expected):
  config = default_optimizer_config()
  config.learning_rate, config.base_batch_size, config.lr_scaling = 0.4, 256, scaling
  config.warmup_steps, config.final_lr_fraction = 4, 0.25
  schedule = learning_rate_schedule(config, 20, batch_size)
  # The warm-up ends at the scaled peak and the floor is scaled with it.
  np.testing.assert_allclose([schedule(4), schedule(20)], [expected, expected * 0.25], rtol=1e-6)


def test_lr_scaling_is_a_validated_config_key(tmp_path):
  from fairmoe_jax import config as fairmoe_config

  config = fairmoe_config.base_config()
  config.optimizer.lr_scaling = "cubic"
  with pytest.raises(ConfigError, match="optimizer.lr_scaling"):
    fairmoe_config.validate(config, num_devices=1)


def test_optimizer_clips_and_skips_decay_on_vectors():
  config = default_optimizer_config()
  config.learning_rate, config.warmup_steps, config.weight_decay, config.grad_clip_norm = (
      0.1,
      0,
      0.5,
      1.0,
  )
  tx = make_optimizer(config, 10)
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  # With zero gradients only decoupled weight decay moves parameters: matrices, not vectors.
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_allclose(updates["b"], 0.0)
  huge = {"w": jnp.full((2, 2), 1e6), "b": jnp.full((2,), 1e6)}
  clip = optax.clip_by_global_norm(1.0)
  clipped, _ = clip.update(huge, clip.init(params))
  assert abs(float(optax.tree.norm(clipped)) - 1.0) < 1e-5


@flax.struct.dataclass
class _State:
  step: jax.Array
  w: jax.Array


def test_checkpoint_round_trip_keeps_n_and_restores_sharding(tmp_path):
  mesh = make_mesh({"data": 2, "expert": 4})
  sharding = jax.sharding.NamedSharding(mesh, P("expert"))
  state = _State(step=jnp.array(0), w=jax.device_put(jnp.arange(8.0), sharding))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.save(
        step, state.replace(step=jnp.array(step), w=state.w * step), {"pos": step}, force=True
    )
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3]
  restored, data_state, step = ckpt.restore(state)
  assert step == 3 and data_state == {"pos": 3} and int(restored.step) == 3
  np.testing.assert_array_equal(restored.w, np.arange(8.0) * 3)
  assert restored.w.sharding == sharding
  ckpt.close()


def _corrupt(step_dir):
  for root, _, files in os.walk(step_dir):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")


def test_corrupt_latest_checkpoint_falls_back_with_warning(tmp_path, caplog):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=3, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state.replace(step=jnp.array(step)), {"pos": step}, force=True)
  ckpt.close()
  _corrupt(tmp_path / "ckpt" / "2")
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    restored, data_state, step = ckpt.restore(state)
  assert step == 1 and data_state == {"pos": 1}
  assert any("step 2" in r.getMessage() for r in caplog.records)
  # Only our one line per skipped step: Orbax's and TensorStore's own error logs are silenced.
  assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
  assert ckpt.skipped and ckpt.skipped[0].startswith("step 2:")
  # The corrupt step is kept aside, not left to block a new save of step 2.
  assert (tmp_path / "ckpt" / "corrupt" / "2").is_dir()
  assert ckpt.all_steps() == [1]
  assert ckpt.save(2, state.replace(step=jnp.array(2)), {"pos": 2}, force=True)
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  _, data_state, step = ckpt.restore(state)
  assert (step, data_state, ckpt.skipped) == (2, {"pos": 2}, [])


def test_all_checkpoints_corrupt_is_a_user_error(tmp_path):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {}, force=True)
  ckpt.close()
  _corrupt(tmp_path / "ckpt" / "1")
  # Each step says what is wrong with it (a file that does not parse), not a pybind11 repr.
  with pytest.raises(
      UserError, match=r"no readable checkpoint.*\n  step 1: \S+ is (not valid JSON|unreadable)"
  ):
    Checkpointer(str(tmp_path / "ckpt")).restore(state)


def test_checksum_manifest_catches_a_flipped_byte_that_orbax_would_restore(tmp_path, caplog):
  state = _State(step=jnp.array(0), w=jnp.arange(256.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=True)
  for step in (1, 2):
    ckpt.save(step, state.replace(step=jnp.array(step)), {"pos": step}, force=True)
  ckpt.close()
  for step in (1, 2):
    assert (tmp_path / "ckpt" / str(step) / "trainkit_manifest.json").is_file()
  # Flip one byte in the largest file of step 2 (array data): the structure still parses.
  files = [
      p
      for p in (tmp_path / "ckpt" / "2").rglob("*")
      if p.is_file() and p.name != "trainkit_manifest.json"
  ]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x01
  largest.write_bytes(bytes(data))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    _, iterator_state, step = ckpt.restore(state)
  assert step == 1 and iterator_state == {"pos": 1}
  assert "does not match its checksum" in ckpt.skipped[0]


def test_unusable_iterator_state_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
  """An iterator state of {} must not restart the data stream silently (nor be a traceback)."""
  from causal_attn_jax.data.iterator import TrainIterator

  data = {"ids": np.arange(40).reshape(20, 2)}
  iterator = TrainIterator(data, 4, seed=0, seq_keys=("ids",))
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {"epoch": 0, "index": 8}, force=True)
  ckpt.save(2, state, {}, force=True)
  ckpt.close()
  with caplog.at_level("WARNING"):
    _, iterator_state, step = Checkpointer(str(tmp_path / "ckpt")).restore(
        state, check_iterator_state=iterator.set_state
    )
  assert step == 1 and iterator_state == {"epoch": 0, "index": 8}
  assert "step 2" in caplog.text and "lacks ['epoch', 'index']" in caplog.text
  assert (iterator.epoch, iterator.index) == (0, 8)
  with pytest.raises(ValueError, match="lacks"):
    iterator.set_state({})


def test_checkpoint_of_a_different_model_is_a_user_error_naming_the_array(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, _State(step=jnp.array(0), w=jnp.arange(4.0)), {}, force=True)
  ckpt.close()
  with pytest.raises(UserError, match=r"different model .*w has shape \(4,\), expected \(5,\)"):
    Checkpointer(str(tmp_path / "ckpt")).restore(_State(step=jnp.array(0), w=jnp.arange(5.0)))


def test_checkpoint_path_that_is_a_file_is_a_user_error(tmp_path):
  (tmp_path / "ckpt").write_text("not a directory")
  with pytest.raises(UserError, match="not a directory"):
    Checkpointer(str(tmp_path / "ckpt"))


def test_metric_writer_merges_steps_and_truncates_on_resume(tmp_path):
  writer = MetricWriter(str(tmp_path))
  writer.write_scalars(1, {"loss": np.float32(2.0)})
  writer.write_scalars(1, {"val/accuracy": 0.5})
  writer.write_scalars(2, {"loss": 1.0})
  writer.write_scalars(3, {"loss": float("nan")})
  writer.flush()
  writer.write_scalars(3, {"test/accuracy": 0.25})  # After a flush: merged into step 3's line.
  writer.close()
  assert read_metrics(str(tmp_path)) == [
      {"step": 1, "loss": 2.0, "val/accuracy": 0.5},
      {"step": 2, "loss": 1.0},
      {"step": 3, "loss": None, "test/accuracy": 0.25},
  ]
  assert any(
      name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard")
  )
  MetricWriter(str(tmp_path), tensorboard=False).truncate_after(2)
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]
  for line in open(tmp_path / "metrics.jsonl"):
    json.loads(line)


def test_changed_config_on_resume_is_reported(tmp_path, caplog):
  config = ml_collections.ConfigDict({"batch_size": 8, "mesh": {"data": 1}})
  save_config(config, str(tmp_path))
  config.mesh.data = 2
  with caplog.at_level("WARNING"):
    save_config(config, str(tmp_path))
  assert "mesh.data: 1 -> 2" in caplog.text and "batch_size" not in caplog.text
  assert json.loads((tmp_path / "config.json").read_text())["mesh"]["data"] == 2
  # The earlier config is kept, numbered, not overwritten; an unchanged config adds nothing.
  assert (
      json.loads((tmp_path / "config_history" / "config.1.json").read_text())["mesh"]["data"] == 1
  )
  save_config(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "config_history")) == ["config.1.json"]
  config.batch_size = 16
  save_config(config, str(tmp_path))
  kept = json.loads((tmp_path / "config_history" / "config.2.json").read_text())
  assert kept["batch_size"] == 8 and kept["mesh"]["data"] == 2


def test_unwritable_workdir_is_a_user_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(UserError, match="not writable"):
    prepare_workdir(str(blocker / "sub"))


class _SignallingIterator:
  """Yields constant batches and sends this process SIGTERM while producing batch `signal_at`."""

  def __init__(self, signal_at: int):
    self.position, self.signal_at = 0, signal_at

  def __next__(self):
    self.position += 1
    if self.position == self.signal_at:
      os.kill(os.getpid(), signal.SIGTERM)
    return {"x": np.ones((8, 1), np.float32)}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def _toy_train_state(w: float = 0.0) -> TrainState:
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params={"w": jnp.full((), w)},
      model_state={},
      opt_state=(),
      rng=jax.random.PRNGKey(0),
  )


@pytest.mark.parametrize("device_prefetch", [0, 2])
def test_sigterm_checkpoints_the_current_step_and_stops(tmp_path, device_prefetch):
  mesh, state = make_mesh({"data": 8, "expert": 1}), _toy_train_state()
  iterator = _SignallingIterator(4)

  def train_step(state, batch):
    return state.replace(step=state.step + 1), {"loss": jnp.sum(batch["x"])}

  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  previous_handler = signal.getsignal(signal.SIGTERM)
  state, preempted = train_loop(
      state=state,
      train_step=jax.jit(train_step),
      train_iterator=iterator,
      mesh=mesh,
      checkpointer=ckpt,
      writer=MetricWriter(str(tmp_path), tensorboard=False),
      num_train_steps=100,
      log_every_steps=10,
      eval_every_steps=0,
      checkpoint_every_steps=0,
      examples_per_step=8,
      show_progress=False,
      device_prefetch=device_prefetch,
  )
  step = int(state.step)
  # Read synchronously, batch 4 is read by step 4; read ahead, the signal comes earlier.
  assert preempted and (step == 4 if device_prefetch == 0 else 1 <= step <= 4)
  assert ckpt.all_steps() == [step]
  _, data_state, restored_step = ckpt.restore(state)
  # The saved data state is that of the batches the steps consumed, not of those read ahead.
  assert (restored_step, data_state) == (step, {"position": step})
  if device_prefetch:
    assert iterator.position > step
  assert [(m["step"], m["loss"]) for m in read_metrics(str(tmp_path))] == [(step, 8.0)]
  assert signal.getsignal(signal.SIGTERM) == previous_handler  # The guard restores the handler.
  ckpt.close()


def test_progress_bar_reports_throughput_eta_and_scalars():
  stream = io.StringIO()  # Not a terminal: one line per update.
  bar = ProgressBar(100, initial=20, examples_per_step=32, stream=stream)
  bar.update(60, steps_per_second=2.0, scalars={"loss": 0.123456})
  bar.close()
  line = stream.getvalue().strip()
  assert line.startswith("[#########") and "60/100" in line
  assert "64.0 ex/s" in line and "ETA " in line and "loss 0.1235" in line
  assert "\r" not in stream.getvalue()


def _train_ten_steps(
    tmp_path, train_step, ckpt, *, log_every_steps: int, w: float = 0.0, **loop_kwargs
):
  """train_loop over 10 steps of the toy state, checkpointing every 2 steps."""
  return train_loop(
      state=_toy_train_state(w),
      train_step=jax.jit(train_step),
      train_iterator=_SignallingIterator(-1),
      mesh=make_mesh({"data": 8, "expert": 1}),
      checkpointer=ckpt,
      writer=MetricWriter(str(tmp_path), tensorboard=False),
      num_train_steps=10,
      log_every_steps=log_every_steps,
      eval_every_steps=0,
      checkpoint_every_steps=2,
      examples_per_step=8,
      show_progress=False,
      **loop_kwargs,
  )


def test_diverged_loss_stops_without_checkpointing_nan(tmp_path):

  def train_step(state, batch):
    loss = jnp.where(state.step >= 4, jnp.nan, 1.0)  # Diverges at the 5th step.
    return state.replace(step=state.step + 1), {"loss": loss}

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  with pytest.raises(
      TrainingDiverged, match="loss became nan at step 5.*latest checkpoint, at step 4"
  ):
    _train_ten_steps(tmp_path, train_step, ckpt, log_every_steps=1)
  assert ckpt.all_steps() == [2, 4]
  assert [(m["step"], m["loss"]) for m in read_metrics(str(tmp_path))][-1] == (5, None)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_exploding_loss_or_gradient_is_divergence_before_any_save(tmp_path, key):
  """A finite but exploded loss (lr 1e6) must not be checkpointed as if it were healthy."""

  def train_step(state, batch):
    exploded = jnp.where(state.step >= 3, 3.8e15, 1.0)  # From the 4th step on.
    metrics = {"loss": jnp.asarray(2.0), "grad_norm": jnp.asarray(0.5)}
    metrics[key] = metrics[key] * exploded
    return state.replace(step=state.step + 1), metrics

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  with pytest.raises(
      TrainingDiverged, match=f"the {key} exploded to .* at step 4.*latest checkpoint, at step 2"
  ):
    _train_ten_steps(tmp_path, train_step, ckpt, log_every_steps=0)
  assert ckpt.all_steps() == [2]  # Step 4 was due but diverged: never saved.


def test_exploding_parameters_are_divergence_even_when_the_loss_looks_healthy(tmp_path):
  """A scale-invariant model (normalised layers) keeps a sane loss while a huge learning rate
  blows its weights up; the parameter norm is measured against the starting parameters."""

  def train_step(state, batch):
    w = state.params["w"] * jnp.where(state.step >= 2, 1e3, 1.01)  # Explodes at the 3rd step.
    metrics = {"loss": jnp.asarray(2.0), "grad_norm": jnp.asarray(0.5), "param_norm": jnp.abs(w)}
    return state.replace(step=state.step + 1, params={"w": w}), metrics

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  with pytest.raises(
      TrainingDiverged,
      match="the param_norm exploded to .* at step 4.*latest checkpoint, at step 2",
  ):
    _train_ten_steps(tmp_path, train_step, ckpt, log_every_steps=0, w=3.0)
  assert ckpt.all_steps() == [2]
  restored, _, _ = ckpt.restore(_toy_train_state())
  assert float(restored.params["w"]) == pytest.approx(3.0 * 1.01**2)


def test_profile_steps_config_is_parsed_and_checked():
  config = ml_collections.ConfigDict(dict(profile_steps=""))
  assert cfg.parse_profile_steps(config) is None
  config.profile_steps = "3:5"
  assert cfg.parse_profile_steps(config) == (3, 5)
  for bad in ("5", "5:3", "a:b", "-1:2", "2:2"):
    config.profile_steps = bad
    with pytest.raises(ConfigError, match="profile_steps"):
      cfg.parse_profile_steps(config)


def test_profile_steps_trace_exactly_those_steps(tmp_path):
  def train_step(state, batch):
    return state.replace(step=state.step + 1), {"loss": jnp.asarray(1.0)}

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  _train_ten_steps(tmp_path, train_step, ckpt, log_every_steps=0, profile_steps=(3, 5))
  [trace] = glob.glob(str(tmp_path / "profile" / "**" / "*.trace.json.gz"), recursive=True)
  with gzip.open(trace) as f:
    events = json.load(f)["traceEvents"]
  spans = sorted(
      (e["ts"], e["ts"] + e["dur"])
      for e in events
      if e.get("ph") == "X" and e.get("name") == "PjitFunction(train_step)"
  )
  calls, end = 0, -1.0
  for start, stop in spans:  # JAX nests one such event inside another per call.
    if start >= end:
      calls, end = calls + 1, stop
  assert calls == 2  # Steps 4 and 5.


def test_a_symlinked_step_is_set_aside_and_what_it_points_to_is_untouched(tmp_path, capsys):
  # `ln -s /outside/dir W/checkpoints/5`: Orbax's clean-up of old steps refused to rmtree the
  # link, so every save failed ("Cannot call rmtree on a symbolic link").
  outside = tmp_path / "outside"
  (outside / "state").mkdir(parents=True)
  (outside / "state" / "precious.txt").write_text("keep me")
  directory = tmp_path / "ckpt"
  directory.mkdir()
  (directory / "5").symlink_to(outside, target_is_directory=True)
  ckpt = Checkpointer(str(directory), max_to_keep=1, async_save=False)
  assert "is a symbolic link (to " in capsys.readouterr().out
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  for step in (10, 20):
    ckpt.save(step, state, {}, force=True)
  ckpt.close()
  assert ckpt.all_steps() == [20]
  assert (outside / "state" / "precious.txt").read_text() == "keep me"
  assert os.path.islink(directory / "set-aside" / "5")
  assert sorted(os.listdir(directory)) == ["20", "set-aside"]


def test_leftover_temporary_checkpoint_is_removed_on_start(tmp_path):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {}, force=True)
  ckpt.close()
  # What a save cut short by SIGKILL leaves behind (Orbax's temporary-directory name).
  leftover = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234567890"
  (leftover / "state").mkdir(parents=True)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert not leftover.exists()
  assert ckpt.all_steps() == [1] and ckpt.restore(state)[2] == 1


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path):
  small = _State(step=jnp.array(0), w=jnp.zeros(1000))
  big = _State(step=jnp.array(0), w=jnp.zeros(1 << 20))  # 4 MiB: cannot fit beside the margin.
  with small_disk(tmp_path, 6) as disk:
    ckpt = Checkpointer(str(disk / "ckpt"), async_save=False)
    ckpt.save(1, small, {}, force=True)
    with pytest.raises(OutOfSpace, match=r"step 2 in '.*ckpt'.*resume from step 1"):
      ckpt.save(2, big, {}, force=True)
    assert sorted(os.listdir(disk / "ckpt")) == ["1"]
    ckpt.close()


def test_a_save_that_fills_the_disk_is_one_error_and_leaves_no_partial_step(tmp_path, monkeypatch):
  # The check before writing is disabled to reach the failure inside Orbax's writer threads.
  monkeypatch.setattr(checkpoint_module, "_SAVE_MARGIN_BYTES", -(1 << 30))
  big = _State(step=jnp.array(0), w=jax.random.normal(jax.random.key(0), (1 << 20,)))
  with small_disk(tmp_path, 2) as disk:
    ckpt = Checkpointer(str(disk / "ckpt"))
    with pytest.raises(OutOfSpace, match="no space left to save the checkpoint of step 1"):
      ckpt.save(1, big, {}, force=True)
      ckpt.wait()
    assert os.listdir(disk / "ckpt") == []


def test_a_full_disk_while_writing_metrics_is_a_user_error():
  @exit_on_user_error
  def write():
    raise OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")

  with pytest.raises(SystemExit) as exit_info:
    write()
  assert exit_info.value.code == 2
  assert is_out_of_space(
      ValueError("RESOURCE_EXHAUSTED: ...: No space left on device [os_error_code='28']")
  )
  assert not is_out_of_space(OSError(errno.ENOENT, "No such file"))


def test_a_step_that_does_not_fit_in_memory_is_one_line_naming_the_keys(capsys):
  # A real allocation XLA refuses at once (4 TiB), as a too-large batch or model gets.
  @exit_on_user_error
  def run():
    jax.jit(lambda: jnp.ones((1 << 40,), jnp.float32))().block_until_ready()

  with pytest.raises(SystemExit) as exit_info:
    run()
  assert exit_info.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("error: the run does not fit in memory (RESOURCE_EXHAUSTED")
  assert "batch_size" in line and "moe.num_experts" in line and "--mode=compile" in line


def test_a_full_disk_in_a_library_s_own_error_is_a_user_error(tmp_path, capsys):
  # safetensors reports a full disk as its own SafetensorError, not an OSError.
  from safetensors.numpy import save_file

  with small_disk(tmp_path, 1) as disk:

    @exit_on_user_error
    def export():
      save_file({"w": np.zeros(1 << 20, np.float32)}, str(disk / "model.safetensors"))

    with pytest.raises(SystemExit) as exit_info:
      export()
  assert exit_info.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("error: no space left on the device"), line


def test_workdir_lock_refuses_a_second_run_and_takes_over_stale_locks(tmp_path, caplog):
  with workdir_lock(str(tmp_path)):
    owner = json.loads((tmp_path / ".run.lock").read_text())
    assert owner["pid"] == os.getpid()
    with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()}"):
      with workdir_lock(str(tmp_path)):
        pass
  assert not (tmp_path / ".run.lock").exists()  # released on exit
  # A lock left by a dead process on this host (kill -9) is stale.
  dead = subprocess.run(
      [sys.executable, "-c", "import os; print(os.getpid())"],
      capture_output=True,
      text=True,
      check=True,
  )
  (tmp_path / ".run.lock").write_text(
      json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "started": 0})
  )
  with caplog.at_level("WARNING"):
    with workdir_lock(str(tmp_path)):
      assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
  assert "stale run lock" in caplog.text
  # Released also when the run fails.
  with pytest.raises(RuntimeError):
    with workdir_lock(str(tmp_path)):
      raise RuntimeError("boom")
  assert not (tmp_path / ".run.lock").exists()
  # Another host's lock cannot be checked: refused, with the way out.
  (tmp_path / ".run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
  with pytest.raises(UserError, match="remove .*run.lock"):
    with workdir_lock(str(tmp_path)):
      pass


def test_the_progress_line_shows_the_task_loss_and_learning_rate_beside_the_total():
  from trainkit.loop import evaluation_summary, progress_scalars

  logged = {
      "loss": 9.6,
      "loss/cross_entropy": 0.59,
      "loss/specialization": 9.0,
      "learning_rate": 1e-3,
      "grad_norm": 2.0,
  }
  assert progress_scalars(logged) == {"loss": 9.6, "task loss": 0.59, "lr": 1e-3}
  assert progress_scalars({"loss": 1.0, "task_loss": 0.7}) == {"loss": 1.0, "task loss": 0.7}
  line = evaluation_summary(
      40, {"val/accuracy": 0.5, "val/mf_pqd": 0.8, "val/sex/pqd": 0.7, "val/loss": 1.25}
  )
  assert line == "step 40 val: accuracy 0.5, mf_pqd 0.8, loss 1.25"


def test_a_torn_last_line_of_metrics_jsonl_is_dropped_and_a_resume_goes_on(tmp_path, caplog):
  # A kill or a full disk mid-append leaves a partial last line (`truncate -s -50`).
  from trainkit.metric_writers import MetricWriter, read_metrics

  writer = MetricWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3):
    writer.write_scalars(step, {"loss": 1.0 / step, "note": "x" * 40})
  writer.flush()
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(path.read_bytes()[:-50])
  with caplog.at_level("WARNING"):
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
  assert "torn write" in caplog.text
  MetricWriter(str(tmp_path), tensorboard=False).truncate_after(2)  # What a resume does.
  assert path.read_text().endswith("\n")
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_a_corrupt_line_inside_metrics_jsonl_names_the_file_and_line(tmp_path):
  from trainkit.errors import UserError
  from trainkit.metric_writers import read_metrics

  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
  with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not a JSON record"):
    read_metrics(str(tmp_path))


def test_a_fresh_restart_after_an_attempt_that_saved_nothing_does_not_duplicate_metrics(tmp_path):
  # An attempt that diverged (or was killed) before its first checkpoint logged steps 1-5; the
  # rerun starts from step 0 again, so those lines must go, not be followed by a second step 5.
  import ml_collections

  from trainkit.loop import resume_training

  writer = MetricWriter(str(tmp_path), tensorboard=False)
  for step in range(1, 6):
    writer.write_scalars(step, {"loss": 1.0})
  writer.flush()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  state = resume_training(
      ml_collections.ConfigDict({"seed": 0}),
      str(tmp_path),
      _toy_train_state(0.0),
      ckpt,
      _SignallingIterator(-1),
      MetricWriter(str(tmp_path), tensorboard=False),
  )
  assert int(state.step) == 0
  assert read_metrics(str(tmp_path)) == []


def test_an_empty_run_lock_is_stale_once_old_and_held_while_fresh(tmp_path, caplog):
  lock = tmp_path / ".run.lock"
  lock.write_text("")  # Its writer died between creating the file and naming itself.
  with pytest.raises(UserError, match="has not named itself"):  # Fresh: maybe being written.
    with workdir_lock(str(tmp_path)):
      pass
  old = time.time() - 60
  os.utime(lock, (old, old))
  with caplog.at_level("WARNING"):
    with workdir_lock(str(tmp_path)):
      assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert "names no owner" in caplog.text


def test_a_review_that_changes_something_prints_one_line_per_change(tmp_path, capsys):
  def train_step(state, batch):
    return state.replace(step=state.step + 1), {"loss": jnp.asarray(1.0)}

  def review(state):
    return state, {"review/n": 1.0}, [f"grew at {int(state.step)}"]

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  train_loop(
      state=_toy_train_state(0.0),
      train_step=jax.jit(train_step),
      train_iterator=_SignallingIterator(-1),
      mesh=make_mesh({"data": 8, "expert": 1}),
      checkpointer=ckpt,
      writer=MetricWriter(str(tmp_path), tensorboard=False),
      num_train_steps=10,
      log_every_steps=5,
      eval_every_steps=0,
      checkpoint_every_steps=10,
      examples_per_step=8,
      reviews=[(4, review)],
  )
  captured = capsys.readouterr()
  console = captured.out + captured.err  # The progress stream.
  assert "step 4: grew at 4" in console and "step 8: grew at 8" in console


class _WaitingIterator:
  """Constant batches; before producing batch `at`, runs `before(position)` (e.g. waits for a
  save to finish, then crashes as a SIGKILL would: nothing after it runs)."""

  def __init__(self, at: set[int], before):
    self.position, self.at, self.before = 0, at, before

  def __next__(self):
    self.position += 1
    if self.position in self.at:
      self.before(self.position)
    return {"x": np.ones((8, 1), np.float32)}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def _wait_until(condition, what: str, timeout: float = 60.0) -> None:
  deadline = time.time() + timeout
  while not condition():
    if time.time() > deadline:
      raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
    time.sleep(0.01)


def _flip_a_byte(step_dir) -> None:
  """Flips one byte in the middle of the largest file (array data: the structure still parses)."""
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "trainkit_manifest.json"]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x01
  largest.write_bytes(bytes(data))


def _toy_loop(tmp_path, checkpointer, iterator, *, steps=40, writer=None, device_prefetch=2):
  def train_step(state, batch):
    params = {"w": state.params["w"] + jnp.sum(batch["x"])}
    return state.replace(step=state.step + 1, params=params), {"loss": jnp.asarray(1.0)}

  return train_loop(
      state=_toy_train_state(0.0),
      train_step=jax.jit(train_step),
      train_iterator=iterator,
      mesh=make_mesh({"data": 8, "expert": 1}),
      checkpointer=checkpointer,
      writer=writer or MetricWriter(str(tmp_path), tensorboard=False),
      num_train_steps=steps,
      log_every_steps=5,
      eval_every_steps=0,
      checkpoint_every_steps=10,
      examples_per_step=8,
      show_progress=False,
      device_prefetch=device_prefetch,
  )


def test_a_step_has_its_manifest_as_soon_as_it_is_finalised_so_a_kill_leaves_none_unverified(
    tmp_path,
):
  # SIGKILL at step 15 of a run that checkpoints every 10 steps. Step 10 was
  # finalised long before; its manifest must not wait for the save of step 20.
  steps = tmp_path / "ckpt"
  ckpt = Checkpointer(str(steps))

  def crash(position):
    _wait_until(lambda: (steps / "10").is_dir(), "the commit of step 10")
    raise KeyboardInterrupt("killed at step 15")  # Nothing of the loop runs after it.

  with pytest.raises(KeyboardInterrupt):
    _toy_loop(tmp_path, ckpt, _WaitingIterator({16}, crash))
  assert sorted(os.listdir(steps)) == ["10"]
  assert (steps / "10" / "trainkit_manifest.json").is_file()
  assert checkpoint_module.verify_manifest(str(steps / "10")) == ""
  # The rerun (a new process) verifies it: a flipped byte is caught, never restored.
  _flip_a_byte(steps / "10")
  with pytest.raises(UserError, match=r"step 10: \S+ does not match its checksum"):
    Checkpointer(str(steps)).restore(_toy_train_state(0.0))

  # The manifest is written before Orbax's commit, so the commit's own two files are named
  # without a checksum; the first check after the commit adds theirs (`poll`, between steps).
  state = _State(step=jnp.array(0), w=jnp.arange(64.0))
  ckpt = Checkpointer(str(tmp_path / "polled"))
  ckpt.save(1, state, {"pos": 1}, force=True)
  _wait_until(lambda: (tmp_path / "polled" / "1").is_dir(), "the commit of step 1")
  manifest = json.loads((tmp_path / "polled" / "1" / "trainkit_manifest.json").read_text())
  assert manifest["files"]["_CHECKPOINT_METADATA"] == {"at_commit": True}
  assert checkpoint_module.verify_manifest(str(tmp_path / "polled" / "1")) == ""
  _wait_until(lambda: not ckpt._manager.is_saving_in_progress(), "the end of the save")
  ckpt.poll()
  manifest = json.loads((tmp_path / "polled" / "1" / "trainkit_manifest.json").read_text())
  assert all("sha256" in entry for entry in manifest["files"].values()), manifest
  assert checkpoint_module.verify_manifest(str(tmp_path / "polled" / "1")) == ""
  ckpt.close()


def test_a_step_without_a_manifest_is_never_restored_unverified(tmp_path, caplog, capsys):
  # A deleted manifest (or a step saved before checksums) must not turn the check
  # off. Policy: such a step is skipped like a corrupt one (fallback, with the reason); with no
  # verified step left, one error naming the steps and the command that vouches for them.
  from trainkit.checkpoint import restore_trained

  state = _State(step=jnp.array(0), w=jnp.arange(256.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  for step in (1, 2):
    ckpt.save(
        step, state.replace(step=jnp.array(step), w=state.w * step), {"pos": step}, force=True
    )
  ckpt.close()
  (tmp_path / "ckpt" / "2" / "trainkit_manifest.json").unlink()
  _flip_a_byte(tmp_path / "ckpt" / "2")
  # What --mode=eval restores (and a resumed training, through the same restore).
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    restored, step = restore_trained(ckpt, state)
  assert step == 1
  np.testing.assert_array_equal(restored.w, np.arange(256.0))
  assert "no trainkit_manifest.json" in ckpt.skipped[0] and ckpt.skipped[0].startswith("step 2")
  assert "step 2" in caplog.text and "cannot be verified" in caplog.text
  assert (tmp_path / "ckpt" / "corrupt" / "2").is_dir()  # Kept, and retrained past.

  # A workdir whose every step lacks a manifest (e.g. saved before checksums): one error naming
  # the steps and how to vouch for them; nothing is moved.
  (tmp_path / "ckpt" / "1" / "trainkit_manifest.json").unlink()
  with pytest.raises(UserError) as error:
    Checkpointer(str(tmp_path / "ckpt")).restore(state)
  message = str(error.value)
  assert "step 1: it has no trainkit_manifest.json" in message
  assert f"python -m trainkit.checkpoint --trust {tmp_path / 'ckpt' / '1'}" in message
  assert (tmp_path / "ckpt" / "1").is_dir()
  assert checkpoint_module.main(["--trust", str(tmp_path / "ckpt" / "1")]) == 0
  assert "manifest written" in capsys.readouterr().out
  _, iterator_state, step = Checkpointer(str(tmp_path / "ckpt")).restore(state)
  assert (step, iterator_state) == (1, {"pos": 1})
  # Vouching never overrides a manifest that the files do not match.
  _flip_a_byte(tmp_path / "ckpt" / "1")
  with pytest.raises(UserError, match="already has a manifest and .* does not match"):
    checkpoint_module.trust(str(tmp_path / "ckpt" / "1"))


def _fail_data_iterator_saves_of(step: int, monkeypatch) -> None:
  """Orbax's background write of step `step`'s data-iterator state meets a full disk."""
  original = ocp.JsonCheckpointHandler._save_fn

  async def save_fn(self, x, directory):
    if f"/{step}.orbax-checkpoint-tmp" in str(directory):
      raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))
    return await original(self, x, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)


def test_a_disk_that_fills_during_an_async_save_stops_the_run_at_once_with_one_error(
    tmp_path, monkeypatch, caplog
):
  # The disk fills while step 20 is written in Orbax's background threads. The run
  # stops at the next step boundary (not at the next save, after pages of writer tracebacks)
  # with one error naming the space problem and the step to resume from; no tmp step is left.
  _fail_data_iterator_saves_of(20, monkeypatch)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  wait_for_the_save = lambda position: _wait_until(
      lambda: not ckpt._manager.is_saving_in_progress(), "the end of the save of step 20"
  )
  iterator = _WaitingIterator({22}, wait_for_the_save)
  with caplog.at_level("WARNING"):
    with pytest.raises(OutOfSpace) as error:
      # Read synchronously, the iterator's position is the step the loop reached.
      _toy_loop(tmp_path, ckpt, iterator, device_prefetch=0)
  assert iterator.position <= 22  # Stopped at the first step boundary after the failure.
  assert re.search(
      r"no space left to save the checkpoint of step 20 .*resume from step 10", str(error.value)
  ), error.value
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["10"]
  # Orbax's threads logged nothing of it: the error above is the one report.
  assert not [r for r in caplog.records if "No space left" in r.getMessage()], caplog.text
  # The hundreds of 'Event loop is closed' errors of the writes still pending are dropped.
  seen = []
  hook = checkpoint_module._drop_closed_loop_callbacks(seen.append)
  for error in (RuntimeError("Event loop is closed"), RuntimeError("other")):
    hook(type("Args", (), {"exc_value": error})())
  assert [str(args.exc_value) for args in seen] == ["other"]


class _FullDiskFile:
  """A file whose next write stores half its data, then fails as on a full disk."""

  def __init__(self, file):
    self._file = file

  def write(self, data):
    self._file.write(data[: len(data) // 2])
    self._file.flush()
    raise OSError(errno.ENOSPC, "No space left on device")

  def __getattr__(self, name):
    return getattr(self._file, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return self._file.__exit__(*exc)


def test_a_full_disk_while_appending_metrics_leaves_no_partial_line_and_names_the_resume_step(
    tmp_path, monkeypatch, caplog
):
  # The metrics append of a live run meets a full disk. The line is all or nothing,
  # and the error is the out-of-space one naming the step to resume from.
  from trainkit import metric_writers

  def full_after_step_20(path, mode="r", *args, **kwargs):
    file = open(path, mode, *args, **kwargs)
    full = os.path.exists(path) and '"step": 20' in open(path).read()
    if str(path).endswith("metrics.jsonl") and mode.startswith("a") and full:
      return _FullDiskFile(file)
    return file

  monkeypatch.setattr(metric_writers, "open", full_after_step_20, raising=False)
  before = None
  ckpt = Checkpointer(str(tmp_path / "ckpt"))

  def remember(position):
    nonlocal before
    before = (tmp_path / "metrics.jsonl").read_text()

  with pytest.raises(OutOfSpace) as error:
    _toy_loop(tmp_path, ckpt, _WaitingIterator({26}, remember))
  assert re.search(
      r"no space left on the device writing '.*metrics.jsonl'.*resume from step 20",
      str(error.value),
  ), error.value
  monkeypatch.undo()
  assert (tmp_path / "metrics.jsonl").read_text() == before  # No partial line.
  with caplog.at_level("WARNING"):
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [5, 10, 15, 20]
  assert "torn" not in caplog.text
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["10", "20"]


def test_a_step_that_cannot_fit_is_refused_before_it_runs_naming_the_key(tmp_path, monkeypatch):
  from trainkit import fits

  big = jnp.ones((2048,))
  batch_heavy = jax.jit(lambda x: jnp.outer(x, x)).lower(big).compile()  # A 16 MiB output
  weight_heavy = jax.jit(lambda w: w[:4] * 2).lower(jnp.ones((1 << 22,))).compile()  # 16 MiB arg
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 1 << 20)  # A 1 MiB device.
  with pytest.raises(UserError, match=r"the train step needs .* but a device here has 0\.0 GiB: "
                                      r"lower batch_size \(now 2048\); --mode=compile"):
    fits.require_fits(batch_heavy, what="train step", batch_key="batch_size", batch_size=2048)
  with pytest.raises(UserError, match=r"make the model smaller \(its model\.\* keys, moe\.num_experts\)"):
    fits.require_fits(weight_heavy, what="train step", batch_key="batch_size", batch_size=8)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 1 << 30)
  fits.require_fits(batch_heavy, what="train step", batch_key="batch_size", batch_size=2048)


class _Rows:
  """Constant batches of `rows` examples of 64 KiB each (what the step's memory grows with)."""

  def __init__(self, rows: int):
    self.rows, self.position = rows, 0

  def __next__(self):
    self.position += 1
    return {"x": np.ones((self.rows, 1 << 14), np.float32)}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def test_the_loop_checks_the_executable_of_its_own_batch_before_the_first_step(
    tmp_path, monkeypatch
):
  # The loop's check used to be tested on a 16-byte device, where every executable fails,
  # so a loop that checked a 1-example batch's executable instead of the step's passed too.
  # Here the device's memory lies between the two executables' needs, and one thing changes
  # between the runs below: the batch (device_prefetch=0, so no prefetched batch counts).
  from trainkit import fits
  from trainkit.preflight.analysis import memory

  mesh = make_mesh({"data": 8, "expert": 1})

  def train_step(state, batch):
    activations = jnp.tanh(batch["x"]) * 2.0  # A temporary the size of the batch.
    params = {"w": state.params["w"] + jnp.mean(activations)}
    return state.replace(step=state.step + 1, params=params), {"loss": jnp.mean(activations)}

  step = jax.jit(train_step)
  full = shard_batch(next(_Rows(64)), mesh)
  one = jax.tree.map(lambda x: x[:1], full)
  need_full = memory(step.lower(_toy_train_state(), full).compile())["peak"]
  need_one = memory(step.lower(_toy_train_state(), one).compile())["peak"]
  assert need_one * 2 < need_full, (need_one, need_full)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: (need_one + need_full) // 2)

  def run(rows: int, workdir):
    return train_loop(
        state=_toy_train_state(), train_step=step, train_iterator=_Rows(rows), mesh=mesh,
        checkpointer=Checkpointer(str(workdir / "ckpt"), async_save=False),
        writer=MetricWriter(str(workdir), tensorboard=False), num_train_steps=2,
        log_every_steps=1, eval_every_steps=0, checkpoint_every_steps=2,
        examples_per_step=rows, show_progress=False, device_prefetch=0,
    )

  # 64 examples (8 a device) do not fit: refused before the first step, nothing trained.
  (tmp_path / "big").mkdir()
  with pytest.raises(UserError, match=r"the train step needs .* lower batch_size \(now 64\)"):
    run(64, tmp_path / "big")
  assert not (tmp_path / "big" / "metrics.jsonl").exists()
  assert not (tmp_path / "big" / "ckpt").exists() or not os.listdir(tmp_path / "big" / "ckpt")
  # 8 examples (1 a device) fit the same device: the check does not refuse every step.
  (tmp_path / "small").mkdir()
  run(8, tmp_path / "small")
  assert [r["step"] for r in read_metrics(str(tmp_path / "small"))] == [1, 2]


def test_the_fit_counts_the_batches_device_prefetch_keeps_beside_the_step(monkeypatch):
  # The step's own batch is an argument of its program; DevicePrefetch places
  # DEFAULT_PREFETCH more on the device ahead of it (trainkit.prefetch.resident_batches, which
  # the preflight counts too).
  from trainkit import fits
  from trainkit.prefetch import DEFAULT_PREFETCH, resident_batches
  from trainkit.preflight.analysis import memory

  batch = jnp.ones((1 << 18,))  # 1 MiB
  compiled = jax.jit(jnp.sum).lower(batch).compile()
  peak = memory(compiled)["peak"]
  ahead = resident_batches() - 1
  assert ahead == DEFAULT_PREFETCH and batch.nbytes * ahead > 0
  kwargs = {"what": "train step", "batch_key": "batch_size", "batch_size": 8, "batch": batch}
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: peak + ahead * batch.nbytes)
  fits.require_fits(compiled, **kwargs)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: peak + ahead * batch.nbytes - 1)
  with pytest.raises(
      UserError, match=rf"the train step needs .*; 0\.0 GiB of the {ahead} batches prefetched ahead"
  ):
    fits.require_fits(compiled, **kwargs)
  # A step whose batches are not prefetched (an evaluation's) counts its own only.
  fits.require_fits(compiled, **kwargs, prefetch=0)
  fits.require_fits(compiled, **{**kwargs, "batch": None})  # Without the batch: the program's.


def test_a_cpu_device_s_memory_is_its_share_of_the_host_s():
  from trainkit import fits
  from trainkit.config import host_memory_bytes

  # The 8 fake CPU devices share one host: together they may not claim more than it has.
  cpu = jax.local_devices(backend="cpu")
  assert len(cpu) == 8
  share = fits.device_memory_bytes(cpu[0])
  assert 0 < share and share * len(cpu) <= host_memory_bytes() < (share + 1) * len(cpu)


def test_the_persistent_cache_is_neither_read_nor_written_while_off(private_compilation_cache):
  from trainkit.preflight.compile import persistent_cache_off

  def entries():
    return sorted(path.name for path in private_compilation_cache.iterdir())

  events = []

  def listen(event, **kwargs):
    if event.startswith("/jax/compilation_cache/"):
      events.append(event)

  before = entries()
  assert before  # The fixture's compile was written: the cache is in use in this process.
  jax.monitoring.register_event_listener(listen)
  try:
    with persistent_cache_off():
      jax.jit(lambda x: 3 * x - 2).lower(jnp.ones(4)).compile()
      jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()  # The fixture's program.
    assert entries() == before
    assert "/jax/compilation_cache/cache_hits" not in events
    # On again after the block: the fixture's program is read back, a new one written.
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
    assert "/jax/compilation_cache/cache_hits" in events
    jax.jit(lambda x: 5 * x - 7).lower(jnp.ones(5)).compile()
    assert len(entries()) > len(before)
  finally:
    jax.monitoring.unregister_event_listener(listen)


@contextlib.contextmanager
def _a_folder_that_becomes_unwritable(tmp_path):
  """(folder, make_unwritable): a permission change, or for root (whom permissions do not stop)
  a small tmpfs remounted read-only (skipped where mounting is not allowed)."""
  if os.geteuid() != 0:
    folder = tmp_path / "disk"
    folder.mkdir()
    try:
      yield folder, lambda: os.chmod(folder / "ckpt", 0o555)
    finally:
      if (folder / "ckpt").exists():
        os.chmod(folder / "ckpt", 0o755)
    return
  with small_disk(tmp_path, 8) as disk:
    yield disk, lambda: subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def _orbax_threads():
  return [t for t in threading.enumerate() if "orbax" in type(t).__module__ and t.is_alive()]


def test_a_checkpoint_folder_made_unwritable_mid_run_is_one_error_at_the_next_save(
    tmp_path, caplog
):
  # The checkpoint folder becomes unwritable after step 10's save. The save of step 20
  # failed in Orbax's threads with pages of PermissionError tracebacks, and its later stages
  # waited forever for the failed one's signal: not daemon threads, so the process never exited
  # (rerunning the same command is what resumes it, so the run must end).
  with _a_folder_that_becomes_unwritable(tmp_path) as (disk, make_unwritable):
    ckpt = Checkpointer(str(disk / "ckpt"))

    def before(position):
      if position == 16:  # Step 10's save finished (its manifest completes at the next step).
        _wait_until(lambda: not ckpt._manager.is_saving_in_progress(), "the save of step 10")
      else:
        make_unwritable()

    with caplog.at_level("WARNING"):
      with pytest.raises(UserError) as error:
        _toy_loop(tmp_path, ckpt, _WaitingIterator({16, 18}, before), device_prefetch=0)
    assert re.search(
        r"cannot write the checkpoint of step 20 in '.*ckpt': (Permission denied|Read-only file "
        r"system).*the run can resume from step 10; make the folder writable and rerun",
        str(error.value),
    ), error.value
    # Nothing of Orbax's threads is left to hold up the exit, and none of them logged it.
    _wait_until(lambda: not _orbax_threads(), "the end of Orbax's threads", timeout=10)
    assert not [r for r in caplog.records if "orbax" in r.pathname], caplog.text
    assert sorted(os.listdir(disk / "ckpt")) == ["10"]
    assert checkpoint_module.verify_manifest(str(disk / "ckpt" / "10")) == ""
    # The stages that never ran leave their coroutines unawaited: collected here, quietly,
    # rather than warned about during a later test.
    del ckpt, before, error
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      gc.collect()


def test_keys_that_change_nothing_trained_do_not_make_a_finished_run_stale(tmp_path):
  """A finished run trained before `model.remat` existed, or with another preflight setting,
  trained what the config asks for now; a changed learning rate still makes it stale."""
  import json

  import ml_collections

  from trainkit.workdir import trained_config_differences

  saved = {"optimizer": {"learning_rate": 0.1}, "model": {}, "preflight": {"utilization": 0.4}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = ml_collections.ConfigDict(
      {"optimizer": {"learning_rate": 0.1}, "model": {"remat": "none"},
       "preflight": {"utilization": 0.0}, "distributed": {"startup_timeout_s": 600}}
  )
  assert trained_config_differences(str(tmp_path), config) == []
  config.model.remat = "block"
  config.optimizer.learning_rate = 0.2
  assert trained_config_differences(str(tmp_path), config) == [
      "model.remat: None -> 'block'", "optimizer.learning_rate: 0.1 -> 0.2"
  ]
