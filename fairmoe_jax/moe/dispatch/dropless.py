"""`dropless` dispatch: grouped matmuls over all choices sorted by expert (MegaBlocks-style).

All G S k choices are sorted by expert and the experts are applied with
`jax.lax.ragged_dot` grouped matmuls; capacity is ignored and nothing is ever
dropped. O(G S k D) memory (O(G S k H) for the hidden activations), no padding;
compute is proportional to the real load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, add_bias, gelu_exact


def moe_dropless(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Sort all choices by expert and run grouped matmuls; nothing is dropped.

  `capacity` is ignored. Groups only matter for the stats: all G * S * k choices
  are sorted together and each expert processes exactly its own tokens with
  `jax.lax.ragged_dot`.
  """
  del capacity
  check_inputs(x, expert_index, gates)
  num_groups, group_size, top_k = expert_index.shape
  num_experts = experts.num_experts
  dim = x.shape[-1]
  num_choices = num_groups * group_size * top_k

  flat_expert = expert_index.reshape(num_choices).astype(jnp.int32)
  # Choice i = (t * k + j) belongs to token t = i // k of the flattened [G * S] tokens.
  choice = jnp.arange(num_choices, dtype=jnp.int32)
  sorted_expert, sorted_choice = jax.lax.sort(
      (flat_expert, choice), dimension=0, is_stable=True, num_keys=1
  )
  bounds = jnp.searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  group_sizes = (bounds[1:] - bounds[:-1]).astype(jnp.int32)
  token = sorted_choice // top_k

  w = experts.cast(x.dtype)
  x_sorted = x.reshape(num_groups * group_size, dim)[token]
  # The biases are gathered in float32 and the choices weighted and summed in float32, so that
  # the gradients of the biases and gates (scatter-adds over tokens, backwards) accumulate in
  # float32 in a bfloat16 compute dtype.
  h = add_bias(jax.lax.ragged_dot(x_sorted, w.w1, group_sizes), experts.b1[sorted_expert])
  h = gelu_exact(h)
  out = add_bias(jax.lax.ragged_dot(h, w.w2, group_sizes), experts.b2[sorted_expert])
  weighted = out.astype(jnp.float32) * gates.reshape(num_choices)[sorted_choice][:, None]
  y = jnp.zeros((num_groups * group_size, dim), jnp.float32).at[token].add(weighted)
  return y.astype(x.dtype).reshape(x.shape), dropless_stats(expert_index, num_experts)
