"""The training loop (`trainkit.loop`): preemption, divergence, profiling, resume, reviews and
the memory check of its own batch."""

import glob
import gzip
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from toy_training import toy_train_state
from trainkit.checkpoint import Checkpointer
from trainkit.errors import UserError
from trainkit.loop import TrainingDiverged, train_loop
from trainkit.mesh import make_mesh, shard_batch
from trainkit.metric_writers import MetricWriter, read_metrics
from trainkit.preemption import PreemptionGuard


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


def _train_ten_steps(
    tmp_path, train_step, ckpt, *, log_every_steps: int, w: float = 0.0, **loop_kwargs
):
  """train_loop over 10 steps of the toy state, checkpointing every 2 steps."""
  return train_loop(
      state=toy_train_state(w),
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


@pytest.mark.parametrize("device_prefetch", [0, 2])
def test_sigterm_checkpoints_the_current_step_and_stops(tmp_path, device_prefetch):
  mesh, state = make_mesh({"data": 8, "expert": 1}), toy_train_state()
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


def test_a_deferring_guard_hands_sigterm_to_the_handler_it_replaced():
  """During the first compile SIGTERM goes to the entry point's handler (which ends the run at
  once, `sigterm_ends_cleanly`); a SIG_DFL it replaced is not restored (that would kill)."""
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  try:
    with PreemptionGuard() as guard:
      with guard.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
      assert received == [signal.SIGTERM] and not guard.requested
      os.kill(os.getpid(), signal.SIGTERM)
      assert guard.requested and received == [signal.SIGTERM]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with PreemptionGuard() as guard, guard.deferred():
      os.kill(os.getpid(), signal.SIGTERM)
      assert guard.requested
  finally:
    signal.signal(signal.SIGTERM, previous)


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
  restored, _, _ = ckpt.restore(toy_train_state())
  assert float(restored.params["w"]) == pytest.approx(3.0 * 1.01**2)


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


def test_the_progress_line_shows_the_task_loss_and_learning_rate_beside_the_total():
  from trainkit.loop import evaluation_summary, progress_scalars

  logged = {
      "loss": 9.6,
      "loss/cross_entropy": 0.59,
      "loss/specialization": 9.0,
      "learning_rate": 1e-3,
      "grad_norm": 2.0,
  }
  assert progress_scalars(logged) == {"total loss": 9.6, "task loss": 0.59, "lr": 1e-3}
  assert progress_scalars({"loss": 1.0, "task_loss": 0.7}) == {"total loss": 1.0, "task loss": 0.7}
  line = evaluation_summary(
      40, {"val/accuracy": 0.5, "val/mf_pqd": 0.8, "val/sex/pqd": 0.7, "val/loss": 1.25}
  )
  assert line == "step 40 val: accuracy 0.5, mf_pqd 0.8, loss 1.25"


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
      toy_train_state(0.0),
      ckpt,
      _SignallingIterator(-1),
      MetricWriter(str(tmp_path), tensorboard=False),
  )
  assert int(state.step) == 0
  assert read_metrics(str(tmp_path)) == []


def test_a_review_that_changes_something_prints_one_line_per_change(tmp_path, capsys):
  def train_step(state, batch):
    return state.replace(step=state.step + 1), {"loss": jnp.asarray(1.0)}

  def review(state):
    return state, {"review/n": 1.0}, [f"grew at {int(state.step)}"]

  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  train_loop(
      state=toy_train_state(0.0),
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
  need_full = memory(step.lower(toy_train_state(), full).compile())["peak"]
  need_one = memory(step.lower(toy_train_state(), one).compile())["peak"]
  assert need_one * 2 < need_full, (need_one, need_full)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: (need_one + need_full) // 2)

  def run(rows: int, workdir):
    return train_loop(
        state=toy_train_state(),
        train_step=step,
        train_iterator=_Rows(rows),
        mesh=mesh,
        checkpointer=Checkpointer(str(workdir / "ckpt"), async_save=False),
        writer=MetricWriter(str(workdir), tensorboard=False),
        num_train_steps=2,
        log_every_steps=1,
        eval_every_steps=0,
        checkpoint_every_steps=2,
        examples_per_step=rows,
        show_progress=False,
        device_prefetch=0,
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
