"""How concentrated attention is: what the Markov-blanket constraint is meant to change.

`effective_keys` is exp of a row's entropy: 1 for a one-hot row, k for a row uniform over k keys,
about 2-3 for a row inside the Markov-blanket band (one or two parents, plus a self-loop in the
encoder). `top1_mass` is the row's largest weight. Both are averaged over the real query tokens
(padded queries and rows with no admissible key have no attention to measure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_sparsity(
    probs: jax.Array, valid_q: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(effective_keys, top1_mass): means over heads and real query rows of [B, H, Nq, Nk] probs.

  Args:
    probs: attention probabilities; rows of masked queries are all zero.
    valid_q: [B, Nq] bool, the real query tokens (default: every row with any mass).
  """
  p = probs.astype(jnp.promote_types(probs.dtype, jnp.float32))
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  rows = p.sum(-1) > 0
  if valid_q is not None:
    rows = rows & jnp.asarray(valid_q, bool)[:, None, :]
  weights = rows.astype(p.dtype)
  count = jnp.maximum(weights.sum(), 1.0)
  return (jnp.exp(entropy) * weights).sum() / count, (p.max(-1) * weights).sum() / count
