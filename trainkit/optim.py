"""Optax optimiser from config: AdamW with linear warm-up and cosine decay, gradient clipping,
the peak learning rate optionally scaled with the batch size, and gradient accumulation.

With `accumulation_steps` k > 1 (optax.MultiSteps), a training step reads one batch of
`batch_size` examples, and every k-th step updates the parameters with the mean gradient of the
last k batches: an update of `batch_size * k` examples. The optimizer's keys are per update, as
a paper states them (`warmup_steps` counts updates, `lr_scaling` scales with batch_size * k); the
run's are per step (`num_train_steps`, a multiple of k, `num_epochs`' steps, the `*_every_steps`,
checkpoints, which may fall between updates, and the logged step and learning rate).

With `ema_decay` d > 0 the optimizer state also keeps an exponential moving average of the
parameters after each update, ema <- d * ema + (1 - d) * params, from the initial parameters;
evaluation reads it (`evaluation_state`), and checkpoints hold it with the rest of the state."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from trainkit import config as cfg
from trainkit.errors import ConfigError
from trainkit.train_state import TrainState

LR_SCALINGS = ("none", "linear", "sqrt")


def peak_learning_rate(config: ml_collections.ConfigDict, batch_size: int | None = None) -> float:
  """`learning_rate` (the rate at `base_batch_size`) times the update's batch (batch_size *
  accumulation_steps) / base_batch_size for `lr_scaling="linear"` (Goyal et al., 2017), or its
  square root for `sqrt`."""
  scaling = config.get("lr_scaling", "none")
  if scaling == "none":
    return config.learning_rate
  if batch_size is None:
    raise ValueError("optimizer.lr_scaling needs the batch size")
  ratio = batch_size * config.accumulation_steps / config.base_batch_size
  return config.learning_rate * (ratio if scaling == "linear" else math.sqrt(ratio))


def learning_rate_schedule(
    config: ml_collections.ConfigDict, num_train_steps: int, batch_size: int | None = None
) -> optax.Schedule:
  """Linear warm-up to the peak rate, then cosine decay to `peak * final_lr_fraction`, over the
  run's updates; a function of the step (step s's gradient goes into update s // k)."""
  peak = peak_learning_rate(config, batch_size)
  k = config.accumulation_steps
  updates = max(1, num_train_steps // k)
  warmup = min(config.warmup_steps, updates)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(updates, warmup + 1),
      end_value=peak * config.final_lr_fraction,
  )
  return schedule if k == 1 else lambda step: schedule(step // k)


class EmaParamsState(NamedTuple):
  ema_params: Any  # The parameters' tree (optax.Params, which the API docs cannot resolve).


def params_ema(decay: float) -> optax.GradientTransformation:
  """Passes the updates through and keeps the EMA of the parameters they lead to."""

  def update(updates, state, params):
    new_params = optax.apply_updates(params, updates)
    return updates, EmaParamsState(
        optax.incremental_update(new_params, state.ema_params, 1 - decay)
    )

  # A copy: the train step donates the parameters' buffers.
  return optax.GradientTransformation(lambda p: EmaParamsState(jax.tree.map(jnp.copy, p)), update)


def evaluation_state(state: TrainState) -> TrainState:
  """A train state with the parameter EMA as its params when its optimizer keeps one."""
  ema = optax.tree.get(getattr(state, "opt_state", None), "ema_params")  # None: not kept.
  return state if ema is None else state.replace(params=ema)


def make_optimizer(
    config: ml_collections.ConfigDict, num_train_steps: int, batch_size: int | None = None
) -> optax.GradientTransformation:
  """`config` is the `optimizer` section: name, learning_rate, lr_scaling, base_batch_size,
  warmup_steps, final_lr_fraction, weight_decay, b1, b2, grad_clip_norm (0 disables clipping),
  accumulation_steps (k: wrapped in optax.MultiSteps, whose state the checkpoints hold),
  ema_decay (0 disables the parameter EMA)."""
  k = config.accumulation_steps
  schedule = learning_rate_schedule(config, num_train_steps, batch_size)
  chain = []
  if config.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(config.grad_clip_norm))
  chain.append(
      optax.adamw(
          lambda updates: schedule(updates * k),  # optax counts updates, the schedule steps.
          b1=config.b1,
          b2=config.b2,
          weight_decay=config.weight_decay,
          # Biases, norm scales and 1-d embeddings are not decayed (DeiT / timm convention).
          mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
      )
  )
  if config.ema_decay > 0:  # Inside MultiSteps: once per update, as the parameters change.
    chain.append(params_ema(config.ema_decay))
  tx = optax.chain(*chain)
  # k = 1 keeps the optimizer state of the runs before accumulation (their checkpoints restore).
  return tx if k == 1 else optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation()


def default_optimizer_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      dict(
          name="adamw",
          learning_rate=5e-4,
          lr_scaling="none",
          base_batch_size=256,
          warmup_steps=100,
          final_lr_fraction=0.0,
          weight_decay=1e-4,
          b1=0.9,
          b2=0.999,
          grad_clip_norm=1.0,
          # > 1: each update averages the gradients of this many steps' batches (module doc).
          accumulation_steps=1,
          # > 0: evaluation uses an EMA of the parameters with this decay per update (e.g. 0.9999).
          ema_decay=0.0,
      )
  )


def validate_optimizer_config(config: ml_collections.ConfigDict) -> None:
  """Checks the run config's `optimizer` section; errors name the key."""
  cfg.require_choice(config, "optimizer.name", ("adamw",))
  cfg.require_float(config, "optimizer.learning_rate", minimum=0.0)
  cfg.require_choice(config, "optimizer.lr_scaling", LR_SCALINGS)
  cfg.require_int(config, "optimizer.base_batch_size", minimum=1)
  cfg.require_int(config, "optimizer.warmup_steps", minimum=0)
  cfg.require_float(config, "optimizer.final_lr_fraction", minimum=0.0, maximum=1.0)
  cfg.require_float(config, "optimizer.weight_decay", minimum=0.0)
  cfg.require_float(config, "optimizer.grad_clip_norm", minimum=0.0)
  k = cfg.require_int(config, "optimizer.accumulation_steps", minimum=1)
  if cfg.require_float(config, "optimizer.ema_decay", minimum=0.0, maximum=1.0) == 1.0:
    raise ConfigError("optimizer.ema_decay", "1.0 would keep the initial parameters; use < 1")
  if config.get("num_epochs", 0) <= 0 and config.num_train_steps % k:
    raise ConfigError(
        "num_train_steps",
        f"{config.num_train_steps} is not a multiple of optimizer.accumulation_steps={k}: the "
        "last steps' gradients would never be applied",
    )
