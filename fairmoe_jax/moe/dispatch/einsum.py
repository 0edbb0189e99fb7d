"""`einsum` dispatch: capacity-limited one-hot dispatch and combine tensors (GShard / V-MoE).

  dispatch[g, s, e, c] = 1  iff token s of group g sits in slot c of expert e;
  combine[g, s, e, c]  = gate of that choice (0 where dispatch is 0).

Expert inputs are einsum("gsec,gsd->egcd", dispatch, x), the output
einsum("gsec,egcd->gsd", combine, expert_outputs). `dispatch_and_combine_masks` is the reference
for the capacity semantics of all capacity algorithms. O(G S E C) memory, quadratic in the group
size (C ~ S k / E); `sort` builds the same buffers without any [S, E, C] tensor.

How `moe_einsum` keeps the bytes it moves low on XLA's TPU compiler (docs/benchmarks.md):

* The plan is one slot index per (token, expert), [G, S, E] (`_slot_plan`); the [G, S, E, C]
  one-hots are built by the compiler inside the einsums that read them, never written to memory.
* The expert MLP runs on [E, G, C, D] buffers (`ExpertWeights.apply_expert_major`): merging G
  and C, with C no multiple of the 8/16-row tile, would be a physical relayout.
* A choice's queue position is an exclusive prefix count computed as a matmul with a strictly
  lower-triangular 0/1 matrix (exact in float32), not a cumsum (a multi-pass scan on TPU).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights


def _slot_plan(
    expert_index: jax.Array, gates: jax.Array, *, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, DispatchStats]:
  """Each (token, expert) pair's capacity slot and gate, in `dispatch_and_combine_masks`' order.

  Returns:
    slot: [G, S, E] int32, the slot of expert e that token s takes; C where the token did not
      choose e or its choice was dropped.
    gate: [G, S, E] gates.dtype, the gate of the choice of e, 0 where e was not chosen.
    stats: `DispatchStats`.
  """
  _, group_size, top_k = expert_index.shape
  choice = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)  # [G, S, k, E]
  # Choices of expert e made earlier in the same priority level j: an exclusive prefix count
  # over the tokens, as a matmul with earlier[t, s] = 1 iff s < t.
  tokens = jnp.arange(group_size)
  earlier = (tokens[:, None] > tokens[None, :]).astype(jnp.float32)
  before = jnp.einsum("ts,gske->gtke", earlier, choice)
  # ... plus every choice of e at the levels j' < j.
  per_level = choice.sum(axis=1)  # [G, k, E]
  before = before + (jnp.cumsum(per_level, axis=1) - per_level)[:, None]
  # A token's k experts differ, so each (s, j) has one nonzero term over e.
  slot = jnp.einsum("gske,gske->gsk", before, choice).astype(jnp.int32)  # [G, S, k]
  kept = slot < capacity

  served = choice * kept[..., None]  # [G, S, k, E]
  served_slot = jnp.where(kept, slot, 0).astype(jnp.float32)
  slot_of_expert = jnp.einsum("gske,gsk->gse", served, served_slot).astype(jnp.int32)
  slot_of_expert = jnp.where(served.sum(axis=2) > 0, slot_of_expert, capacity)
  gate = jnp.einsum("gske,gsk->gse", choice.astype(gates.dtype), gates)
  group_expert_fraction = served.sum(axis=(1, 2)) / (group_size * top_k)
  return slot_of_expert, gate, DispatchStats.from_kept(kept, group_expert_fraction)


def dispatch_and_combine_masks(
    expert_index: jax.Array, gates: jax.Array, *, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, DispatchStats]:
  """Builds the [G, S, E, C] dispatch (float32 0/1) and combine (gates.dtype) tensors.

  Priority: all top-1 choices of a group are served before any top-2 choice (and so on); within
  a level, earlier tokens first (GShard / V-MoE), so a first choice is rarely dropped.

  Args:
    expert_index: [G, S, k] int chosen experts, best first.
    gates: [G, S, k] float weights of those choices.
    num_experts: E.
    capacity: C, slots per expert and group.
  """
  slot, gate, stats = _slot_plan(expert_index, gates, num_experts=num_experts, capacity=capacity)
  # A slot index of C (no slot) gives an all-zero one-hot.
  dispatch = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)
  combine = dispatch.astype(gates.dtype) * gate[..., None]
  return dispatch, combine, stats


def moe_einsum(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
    expert_mlp: Callable[[jax.Array, ExpertWeights], jax.Array] | None = None,
    num_experts: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """The einsums of the module doc, without a float [G, S, E, C] tensor in memory.

  `expert_mlp(buffers, experts)` runs the MLP on the [E, G, C, D] buffers; None:
  `ExpertWeights.apply_expert_major` (the experimental `einsum_fused` passes Pallas kernels,
  expert parallelism its all-to-all exchange). `num_experts`: E, default `experts.num_experts`
  (expert parallelism holds a shard of the experts).
  """
  check_inputs(x, expert_index, gates)
  capacity = resolve_capacity(capacity, x.shape[1])
  slot, gate, stats = _slot_plan(
      expert_index, gates, num_experts=num_experts or experts.num_experts, capacity=capacity
  )
  mask = jax.nn.one_hot(slot, capacity, dtype=jnp.bool_)  # [G, S, E, C]
  # 0/1 entries are exact in any float dtype, so the gather is lossless.
  buffers = jnp.einsum("gsec,gsd->egcd", mask.astype(x.dtype), x)  # [E, G, C, D]
  if expert_mlp is None:
    outputs = experts.apply_expert_major(buffers)
  else:
    outputs = expert_mlp(buffers, experts)
  # The gates in float32 until they weight the outputs.
  combine = jnp.where(mask, gate[..., None], 0).astype(outputs.dtype)
  return jnp.einsum("gsec,egcd->gsd", combine, outputs), stats
