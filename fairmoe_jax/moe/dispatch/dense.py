"""`dense` dispatch: every expert on every token, the test oracle.

Every expert runs on every token and the outputs are weighted by the gates of
the chosen experts; capacity is ignored and nothing is dropped. O(G S E (D + H))
memory and E / k times the FLOPs of a sparse layer, so it is not for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, add_bias


def moe_dense(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Every expert on every token; the oracle. `capacity` is ignored.

  y[g, s] = sum_j gates[g, s, j] * E_{expert_index[g, s, j]}(x[g, s]).
  """
  del capacity
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  w = experts.cast(x.dtype)
  h = add_bias(jnp.einsum("gsd,edh->gesh", x, w.w1), experts.b1[:, None, :])
  h = jax.nn.gelu(h, approximate=False)
  out = add_bias(jnp.einsum("gesh,ehd->gesd", h, w.w2), experts.b2[:, None, :])
  # [G, S, E] gate of each expert, 0 where not chosen (a token's k experts differ).
  weights = jnp.einsum(
      "gske,gsk->gse", jax.nn.one_hot(expert_index, num_experts, dtype=gates.dtype), gates
  )
  y = jnp.einsum("gse,gesd->gsd", weights.astype(x.dtype), out)
  return y, dropless_stats(expert_index, num_experts)
