"""Cross-group mixup of MultiFair (the baseline of paper Tables 1-2).

Each example is mixed with a partner from a *different* group of one sensitive
attribute; the attribute changes from step to step (attribute = step mod m), so
over training every attribute's groups are interpolated in turn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_group_partners(key: jax.Array, groups: jax.Array) -> jax.Array:
  """[B] index of a random partner from another group (any example if none exists).

  Examples with a missing group (-1) may pair with anyone, and be anyone's partner.
  """
  batch = groups.shape[0]
  scores = jax.random.uniform(key, (batch, batch))
  known = groups >= 0
  same = (groups[:, None] == groups[None, :]) & known[:, None] & known[None, :]
  allowed = ~same & ~jnp.eye(batch, dtype=bool)
  has_other = jnp.any(allowed, axis=1)
  # Without a partner from another group, fall back to any other example.
  allowed = jnp.where(has_other[:, None], allowed, ~jnp.eye(batch, dtype=bool))
  return jnp.argmax(jnp.where(allowed, scores, -1.0), axis=1)


def mix(
    key: jax.Array, images: jax.Array, groups: jax.Array, alpha: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(mixed images, partner index [B], lambda [B]) with lambda ~ Beta(alpha, alpha)."""
  partner_key, lam_key = jax.random.split(key)
  partners = cross_group_partners(partner_key, groups)
  lam = jax.random.beta(lam_key, alpha, alpha, (images.shape[0],))
  shape = (-1,) + (1,) * (images.ndim - 1)
  mixed = lam.reshape(shape) * images + (1.0 - lam.reshape(shape)) * images[partners]
  return mixed.astype(images.dtype), partners, lam
