"""Optax optimiser from config: AdamW with linear warm-up and cosine decay, gradient clipping."""

from __future__ import annotations

import jax
import ml_collections
import optax


def learning_rate_schedule(
    config: ml_collections.ConfigDict, num_train_steps: int
) -> optax.Schedule:
  """Linear warm-up to `learning_rate`, then cosine decay to `learning_rate * final_lr_fraction`."""
  warmup = min(config.warmup_steps, num_train_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(num_train_steps, warmup + 1),
      end_value=config.learning_rate * config.final_lr_fraction,
  )


def _decay_mask(params):
  # Biases, norm scales and 1-d embeddings are not decayed (DeiT / timm convention).
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    config: ml_collections.ConfigDict, num_train_steps: int
) -> optax.GradientTransformation:
  """`config` is the `optimizer` section: name, learning_rate, warmup_steps, final_lr_fraction,
  weight_decay, b1, b2, grad_clip_norm (0 disables clipping)."""
  schedule = learning_rate_schedule(config, num_train_steps)
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
          warmup_steps=100,
          final_lr_fraction=0.0,
          weight_decay=1e-4,
          b1=0.9,
          b2=0.999,
          grad_clip_norm=1.0,
      )
  )
