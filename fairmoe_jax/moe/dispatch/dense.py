"""`dense` dispatch: every expert on every token, weighted by the chosen gates; the test oracle.
O(G S E (D + H)) memory and E / k times the FLOPs: not for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, gelu_exact


def moe_dense(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """y[g, s] = sum_j gates[g, s, j] * E_{expert_index[g, s, j]}(x[g, s]); `capacity` ignored."""
  del capacity
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  # float32 matmuls on operands rounded to x.dtype, so the gradients (sums over tokens)
  # accumulate in float32 whatever a backend does with a bfloat16 dot.
  w = jax.tree.map(lambda a: a.astype(jnp.float32), experts.cast(x.dtype))
  x32 = x.astype(jnp.float32)
  h = jnp.einsum("gsd,edh->gesh", x32, w.w1) + experts.b1[:, None, :]
  h = gelu_exact(h.astype(x.dtype)).astype(jnp.float32)
  out = (jnp.einsum("gesh,ehd->gesd", h, w.w2) + experts.b2[:, None, :]).astype(x.dtype)
  # [G, S, E] gate of each expert, 0 where not chosen (a token's k experts differ).
  weights = jnp.einsum(
      "gske,gsk->gse", jax.nn.one_hot(expert_index, num_experts, dtype=gates.dtype), gates
  )
  weights = weights.astype(x.dtype).astype(jnp.float32)
  y = jnp.einsum("gse,gesd->gsd", weights, out.astype(jnp.float32)).astype(x.dtype)
  return y, dropless_stats(expert_index, num_experts)
