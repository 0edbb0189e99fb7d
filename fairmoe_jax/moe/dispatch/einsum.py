"""`einsum` dispatch: capacity-limited one-hot dispatch and combine tensors (GShard / V-MoE).

The dispatch is expressed as two dense one-hot tensors of shape [G, S, E, C]:

  dispatch[g, s, e, c] = 1  iff token s of group g sits in slot c of expert e;
  combine[g, s, e, c]  = gate of that choice (0 where dispatch is 0).

Expert inputs are einsum("gsec,gsd->egcd", dispatch, x), expert-major like V-MoE's
[E, G * C, D] buffers (so the expert matmuls need no transpose), and the layer output
is einsum("gsec,egcd->gsd", combine, expert_outputs). `dispatch_and_combine_masks`
is the reference for the capacity semantics of all capacity algorithms. This
costs O(G S E C) memory, quadratic in the group size since C ~ S k / E; fine for
ViT-sized groups, while `sort` builds the same expert buffers without any
[S, E, C] tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights


def dispatch_and_combine_masks(
    expert_index: jax.Array,
    gates: jax.Array,
    *,
    num_experts: int,
    capacity: int,
) -> tuple[jax.Array, jax.Array, DispatchStats]:
  """Builds the [G, S, E, C] dispatch and combine tensors.

  Priority: all top-1 choices of a group are served before any top-2 choice
  (and so on); within one priority level, earlier tokens come first. This is the
  GShard / V-MoE order; it makes the first choice of a token much less likely to
  be dropped than its second one.

  Args:
    expert_index: [G, S, k] int chosen experts, best first.
    gates: [G, S, k] float weights of those choices.
    num_experts: E.
    capacity: C, slots per expert and group.

  Returns:
    dispatch: [G, S, E, C] float32 0/1 tensor.
    combine: [G, S, E, C] gates.dtype tensor.
    stats: `DispatchStats`.
  """
  num_groups, group_size, top_k = expert_index.shape
  # [G, S, k, E]
  choice_one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32)

  # Order the (token, choice) pairs priority-major: [G, k * S, E], where row
  # j * S + s is choice j of token s. A cumulative sum along that axis then
  # gives each pair its 1-based arrival position in its expert's queue.
  priority_major = jnp.swapaxes(choice_one_hot, 1, 2).reshape(
      num_groups, top_k * group_size, num_experts
  )
  arrival = jnp.cumsum(priority_major, axis=1) * priority_major
  # Back to [G, S, k]: the 0-based slot each choice would take.
  arrival = jnp.swapaxes(arrival.reshape(num_groups, top_k, group_size, num_experts), 1, 2)
  slot = arrival.sum(axis=-1) - 1
  kept = slot < capacity

  # A dropped choice gets an all-zero slot one-hot (one_hot of index C is 0).
  slot_one_hot = jax.nn.one_hot(jnp.where(kept, slot, capacity), capacity, dtype=jnp.float32)
  # [G, S, k, E, C]; summing over k is safe because a token's k experts differ.
  per_choice = choice_one_hot.astype(jnp.float32)[..., None] * slot_one_hot[..., None, :]
  dispatch = per_choice.sum(axis=2)
  combine = jnp.einsum("gskec,gsk->gsec", per_choice.astype(gates.dtype), gates)

  group_expert_fraction = (choice_one_hot * kept[..., None]).sum(axis=(1, 2)).astype(
      jnp.float32
  ) / (group_size * top_k)
  return dispatch, combine, DispatchStats.from_kept(kept, group_expert_fraction)


def einsum_dispatch(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    capacity: int,
    *,
    num_experts: int,
) -> tuple[jax.Array, jax.Array, DispatchStats]:
  """Gathers each expert's tokens into fixed-size buffers.

  Args:
    x: [G, S, D] tokens.
    expert_index: [G, S, k] chosen experts.
    gates: [G, S, k] weights of the choices.
    capacity: C, slots per expert and group (see `compute_capacity`).
    num_experts: E.

  Returns:
    dispatched: [E, G * C, D] expert inputs in x.dtype, expert-major; empty slots are zero.
    combine: [G, S, E, C] combine weights, to be passed to `einsum_combine`.
    stats: `DispatchStats`.
  """
  dispatch, combine, stats = dispatch_and_combine_masks(
      expert_index, gates, num_experts=num_experts, capacity=capacity
  )
  # 0/1 entries are exact in any float dtype, so the gather is lossless.
  dispatched = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x)
  num_groups, dim = x.shape[0], x.shape[-1]
  return dispatched.reshape(num_experts, num_groups * capacity, dim), combine, stats


def einsum_combine(combine: jax.Array, expert_outputs: jax.Array) -> jax.Array:
  """[G, S, E, C] weights x [E, G * C, D] expert outputs -> [G, S, D].

  Dropped choices have zero weight, so a token whose every choice was dropped
  gets 0 here and is carried only by the residual connection of its block.
  """
  num_groups, _, num_experts, capacity = combine.shape
  outputs = expert_outputs.reshape(num_experts, num_groups, capacity, -1)
  return jnp.einsum("gsec,egcd->gsd", combine.astype(expert_outputs.dtype), outputs)


def moe_einsum(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """One-hot [G, S, E, C] dispatch / combine (`einsum_dispatch`)."""
  check_inputs(x, expert_index, gates)
  capacity = resolve_capacity(capacity, x.shape[1])
  dispatched, combine, stats = einsum_dispatch(
      x, expert_index, gates, capacity, num_experts=experts.num_experts
  )
  y = einsum_combine(combine, experts.apply(dispatched))
  return y, stats
