"""Optax optimiser from config: AdamW with linear warm-up and cosine decay, gradient clipping,
and the peak learning rate optionally scaled with the batch size."""

from __future__ import annotations

import math

import jax
import ml_collections
import optax

from trainkit import config as cfg

LR_SCALINGS = ("none", "linear", "sqrt")


def peak_learning_rate(config: ml_collections.ConfigDict, batch_size: int | None = None) -> float:
  """`learning_rate` (the rate at `base_batch_size`) times batch_size / base_batch_size for
  `lr_scaling="linear"` (Goyal et al., 2017), or its square root for `sqrt`."""
  scaling = config.get("lr_scaling", "none")
  if scaling == "none":
    return config.learning_rate
  if batch_size is None:
    raise ValueError("optimizer.lr_scaling needs the batch size")
  ratio = batch_size / config.base_batch_size
  return config.learning_rate * (ratio if scaling == "linear" else math.sqrt(ratio))


def learning_rate_schedule(
    config: ml_collections.ConfigDict, num_train_steps: int, batch_size: int | None = None
) -> optax.Schedule:
  """Linear warm-up to the peak rate, then cosine decay to `peak * final_lr_fraction`."""
  peak = peak_learning_rate(config, batch_size)
  warmup = min(config.warmup_steps, num_train_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(num_train_steps, warmup + 1),
      end_value=peak * config.final_lr_fraction,
  )


def _decay_mask(params):
  # Biases, norm scales and 1-d embeddings are not decayed (DeiT / timm convention).
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    config: ml_collections.ConfigDict, num_train_steps: int, batch_size: int | None = None
) -> optax.GradientTransformation:
  """`config` is the `optimizer` section: name, learning_rate, lr_scaling, base_batch_size,
  warmup_steps, final_lr_fraction, weight_decay, b1, b2, grad_clip_norm (0 disables clipping)."""
  schedule = learning_rate_schedule(config, num_train_steps, batch_size)
  chain = []
  if config.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(config.grad_clip_norm))
  chain.append(
      optax.adamw(
          schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay, mask=_decay_mask
      )
  )
  return optax.chain(*chain)


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
