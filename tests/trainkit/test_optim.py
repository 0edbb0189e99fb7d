"""The optimiser and learning-rate schedule (`trainkit.optim`)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from toy_training import WaitingIterator
from trainkit.checkpoint import Checkpointer, restore_trained
from trainkit.errors import ConfigError
from trainkit.loop import train_loop
from trainkit.mesh import make_mesh
from trainkit.metric_writers import MetricWriter, read_metrics
from trainkit.optim import default_optimizer_config, learning_rate_schedule, make_optimizer
from trainkit.train_state import TrainState, create_train_state, jit_train_step, make_train_step


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


def _accumulating(k: int, warmup_steps: int = 0, learning_rate: float = 0.1):
  config = default_optimizer_config()
  config.update(accumulation_steps=k, warmup_steps=warmup_steps, learning_rate=learning_rate)
  # The update's batch, batch_size * k, scales the rate.
  config.update(lr_scaling="linear", base_batch_size=8)
  return config


def test_accumulating_k_batches_of_b_is_one_update_of_a_batch_of_k_times_b():
  """Three updates of a linear model (no batch-dependent layer) from 4 micro-batches of 2 match
  three of the batches of 8 joined, with the same learning rate for each update."""
  x, y = jax.random.normal(jax.random.PRNGKey(0), (2, 24, 5))
  params = {"w": jnp.full((5, 5), 0.1), "b": jnp.zeros((5,))}

  def train(tx, batch_size):
    loss = lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    step = jax.jit(lambda p, s, x, y: tx.update(jax.grad(loss)(p, x, y), s, p))
    p, s = params, tx.init(params)
    for start in range(0, 24, batch_size):
      updates, s = step(p, s, x[start : start + batch_size], y[start : start + batch_size])
      p = optax.apply_updates(p, updates)
    return p

  # Warm-up over the first update (warmup_steps counts updates), then a cosine over two.
  lr = 0.1
  accumulated = train(make_optimizer(_accumulating(4, 1, lr), 12, batch_size=2), 2)
  joined = train(make_optimizer(_accumulating(1, 1, lr), 3, batch_size=8), 8)
  # The logged rate of step s is that of the update it goes into, s // 4.
  np.testing.assert_array_equal(
      [learning_rate_schedule(_accumulating(4, 1, lr), 12, 2)(s) for s in range(12)],
      [learning_rate_schedule(_accumulating(1, 1, lr), 3, 8)(s // 4) for s in range(12)],
  )
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), joined, params)
  assert min(jax.tree.leaves(moved)) > lr / 2  # The two updates after warm-up moved both.
  # The mean of 4 means of 2 differs from the mean of 8 by a few float32 roundings (eps each,
  # relative to the gradient); Adam's m / sqrt(v) carries that relative error into each update
  # of size <= learning_rate, so three updates differ by at most ~3 * lr * 16 eps.
  tolerance = 3 * lr * 16 * np.finfo(np.float32).eps
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=tolerance), accumulated, joined
  )


def test_accumulation_steps_is_a_validated_config_key():
  from trainkit.optim import validate_optimizer_config

  config = ml_collections.ConfigDict({"optimizer": _accumulating(0), "num_train_steps": 10})
  with pytest.raises(ConfigError, match="optimizer.accumulation_steps"):
    validate_optimizer_config(config)
  config.optimizer.accumulation_steps = 4  # The last 2 steps would accumulate for nothing.
  with pytest.raises(ConfigError, match="num_train_steps.*accumulation_steps=4"):
    validate_optimizer_config(config)
  config.num_epochs = 1.0  # Then num_train_steps is set from the data, in whole updates.
  validate_optimizer_config(config)


@pytest.mark.parametrize("ema_decay", [0.0, 0.5])
def test_a_run_checkpointed_between_micro_steps_resumes_exactly(tmp_path, ema_decay):
  """With accumulation_steps=2, a run stopped after step 3 (one gradient accumulated, not yet
  applied) and resumed from its checkpoint ends at step 6 with the parameters, optimizer state
  (the parameter EMA's too, with ema_decay) and losses of a run that never stopped; a trained
  run's restore (eval, predict, export) then reads the EMA's parameters."""
  mesh = make_mesh({"data": 8, "expert": 1})
  config = _accumulating(2, 1)
  config.ema_decay = ema_decay
  tx = make_optimizer(config, 6, batch_size=4)
  graphdef, initial = create_train_state(lambda: nnx.Linear(1, 1, rngs=nnx.Rngs(0)), tx, mesh, 0)

  def loss_fn(model, batch, rng, step, extra):
    x = batch["x"] * (step + 1)  # Each step's batch differs (a resumed run meets the same).
    return jnp.mean((model(x) - 2 * x) ** 2), {}

  def run(name, state, iterator, steps):
    state = jax.tree.map(jnp.copy, state)  # The step donates its input.
    checkpointer = Checkpointer(str(tmp_path / name), async_save=False)
    state, _ = train_loop(
        state=state,
        train_step=jit_train_step(make_train_step(graphdef, loss_fn, tx), state, mesh),
        train_iterator=iterator,
        mesh=mesh,
        checkpointer=checkpointer,
        writer=MetricWriter(str(tmp_path / name), tensorboard=False),
        num_train_steps=steps,
        log_every_steps=1,
        eval_every_steps=0,
        checkpoint_every_steps=3,
        examples_per_step=8,
        show_progress=False,
    )
    losses = [m["loss"] for m in read_metrics(str(tmp_path / name)) if "loss" in m]
    return state, checkpointer, losses

  batches = lambda: WaitingIterator(set(), None)  # Constant batches, the position checkpointed.
  unbroken, _, unbroken_losses = run("unbroken", initial, batches(), 6)
  _, checkpointer, first_losses = run("resumed", initial, batches(), 3)
  iterator = batches()
  restored, iterator_state, step = checkpointer.restore(initial)
  iterator.set_state(iterator_state)
  assert step == 3 and int(restored.opt_state.mini_step) == 1  # Mid-accumulation.
  resumed, _, resumed_losses = run("resumed", restored, iterator, 6)
  assert resumed_losses == unbroken_losses and first_losses == unbroken_losses[:3]
  jax.tree.map(np.testing.assert_array_equal, resumed, unbroken)
  assert not np.array_equal(unbroken.params["kernel"][...], initial.params["kernel"][...])
  evaluated, _ = restore_trained(Checkpointer(str(tmp_path / "unbroken")), initial)
  ema = optax.tree.get(unbroken.opt_state, "ema_params")
  expected = unbroken.params if ema is None else ema
  jax.tree.map(np.testing.assert_array_equal, evaluated.params, expected)
  if ema_decay:  # Two updates, each halfway from the EMA to the new parameters.
    assert not np.array_equal(ema["kernel"][...], unbroken.params["kernel"][...])


def test_the_parameter_ema_follows_each_update_and_evaluation_reads_it():
  from trainkit.optim import evaluation_state, validate_optimizer_config

  config = default_optimizer_config()
  config.update(ema_decay=0.75, warmup_steps=0, learning_rate=0.1)
  tx = make_optimizer(config, 3)
  params = {"w": jnp.ones((2, 2))}
  opt_state, expected = tx.init(params), params["w"]
  for _ in range(3):
    updates, opt_state = tx.update({"w": jnp.ones((2, 2))}, opt_state, params)
    params = optax.apply_updates(params, updates)
    expected = 0.75 * expected + 0.25 * params["w"]
  state = TrainState(step=3, params=params, model_state={}, opt_state=opt_state, rng=None)
  # A few float32 roundings of values near 1: eps each.
  np.testing.assert_allclose(
      evaluation_state(state).params["w"], expected, atol=8 * np.finfo(np.float32).eps
  )
  assert not np.allclose(expected, params["w"])
  config.ema_decay = 0.0
  state = state.replace(opt_state=make_optimizer(config, 3).init(params))
  assert evaluation_state(state) is state  # Off: the trained parameters.
  config.ema_decay = 1.0  # The EMA would never leave the initial parameters.
  with pytest.raises(ConfigError, match="optimizer.ema_decay"):
    validate_optimizer_config(
        ml_collections.ConfigDict({"optimizer": config, "num_train_steps": 3})
    )


def test_an_epochs_run_is_whole_updates():
  from trainkit.config import resolve_train_steps

  config = ml_collections.ConfigDict(dict(num_epochs=1.0, batch_size=8, num_train_steps=1))
  config.optimizer = _accumulating(4)
  resolve_train_steps(config, 100, training=True)
  assert config.num_train_steps == 16  # 100 examples are 3.1 updates of 32: 4 updates of 4 steps.
