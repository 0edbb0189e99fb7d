"""`sort` dispatch: capacity-limited dispatch by sorting, without any [S, E, C] tensor.

Same capacity semantics and the same expert buffers as `einsum`. The (expert,
priority) pairs of each group are sorted; the position of a choice in its
expert's queue is its rank in sorted order minus the start of its expert's
segment (found by binary search). The [G, E, C, D] buffers are then filled by an
index gather (`gather_slots`) and the gated expert outputs are scatter-added
back to their tokens (`combine_slots`). O(G E C D + G S k) memory. The
expert-parallel dispatch reuses the same slot plan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights


def _batched_searchsorted(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
  """searchsorted (side="left") of queries [Q] in every row of sorted_values [G, N]."""
  return jax.vmap(lambda row: jnp.searchsorted(row, queries, side="left"))(sorted_values)


@struct.dataclass
class SlotPlan:
  """Where each (token, choice) of every group goes in the [E, C] capacity slots.

  Attributes:
    slot_token: [G, E * C] int32 token held by slot (e, c) (arbitrary where invalid).
    valid: [G, E * C] whether slot (e, c) holds a token.
    slot_gate: [G, E * C] gate of that choice, 0 where invalid.
    stats: the `DispatchStats` of these decisions.
  """

  slot_token: jax.Array
  valid: jax.Array
  slot_gate: jax.Array
  stats: DispatchStats


def sort_slot_plan(
    expert_index: jax.Array, gates: jax.Array, *, num_experts: int, capacity: int
) -> SlotPlan:
  """Capacity slots by sorting, with `moe_einsum`'s semantics and no [S, E, C] tensor.

  Per group, the k * S (token, choice) pairs are numbered priority-major
  (p = j * S + s, so every top-1 choice precedes every top-2 choice and earlier
  tokens come first) and sorted by the key (expert, p). Expert e's choices then
  form the segment [start_e, start_e + count_e) of the sorted order, in arrival
  order, so slot c of expert e is the sorted element start_e + c, served iff
  c < min(count_e, C).
  """
  num_groups, group_size, top_k = expert_index.shape
  num_choices = group_size * top_k
  groups = jnp.arange(num_groups)[:, None]

  # Priority-major flattening: [G, k * S], element p = j * S + s.
  expert_pm = jnp.swapaxes(expert_index, 1, 2).reshape(num_groups, num_choices).astype(jnp.int32)
  gates_pm = jnp.swapaxes(gates, 1, 2).reshape(num_groups, num_choices)
  priority = jnp.broadcast_to(jnp.arange(num_choices, dtype=jnp.int32), expert_pm.shape)
  # The (expert, priority) keys are unique, so the order is fully determined.
  sorted_expert, sorted_priority = jax.lax.sort(
      (expert_pm, priority), dimension=1, is_stable=True, num_keys=2
  )

  # Segment boundaries of every expert in the sorted order: [G, E + 1].
  bounds = _batched_searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  start, count = bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]

  # Served choices, for the stats: a sorted element is kept iff its position in
  # its expert's segment is below C; un-sort with the (unique) priorities.
  position = jnp.arange(num_choices, dtype=jnp.int32) - jnp.take_along_axis(
      start, sorted_expert, axis=1
  )
  kept_pm = jnp.zeros((num_groups, num_choices), bool)
  kept_pm = kept_pm.at[groups, sorted_priority].set(position < capacity, unique_indices=True)
  kept = jnp.swapaxes(kept_pm.reshape(num_groups, top_k, group_size), 1, 2)
  served = jnp.minimum(count, capacity)
  stats = DispatchStats.from_kept(kept, served.astype(jnp.float32) / num_choices)

  # Slot (e, c) holds the sorted element start_e + c when c < count_e: [G, E * C].
  slots = jnp.arange(capacity, dtype=jnp.int32)
  valid = (slots < served[:, :, None]).reshape(num_groups, -1)
  sorted_pos = jnp.minimum(start[:, :, None] + slots, num_choices - 1).reshape(num_groups, -1)
  slot_priority = jnp.take_along_axis(sorted_priority, sorted_pos, axis=1)
  slot_gate = jnp.where(valid, jnp.take_along_axis(gates_pm, slot_priority, axis=1), 0.0)
  return SlotPlan(
      slot_token=slot_priority % group_size, valid=valid, slot_gate=slot_gate, stats=stats
  )


def gather_slots(x: jax.Array, plan: SlotPlan, *, num_experts: int, capacity: int) -> jax.Array:
  """Expert buffers [G, E, C, D] gathered from x [G, S, D]; empty slots are zero."""
  buffers = jnp.take_along_axis(x, plan.slot_token[:, :, None], axis=1)
  buffers = jnp.where(plan.valid[:, :, None], buffers, jnp.zeros((), x.dtype))
  return buffers.reshape(x.shape[0], num_experts, capacity, x.shape[-1])


def combine_slots(outputs: jax.Array, plan: SlotPlan, x_shape: tuple[int, ...]) -> jax.Array:
  """Gate-weighted expert outputs [G, E, C, D] scatter-added back to tokens [G, S, D]."""
  num_groups, group_size, dim = x_shape
  weighted = outputs.reshape(num_groups, -1, dim) * plan.slot_gate.astype(outputs.dtype)[:, :, None]
  # Empty slots point past the end and are dropped.
  target = jnp.where(plan.valid, plan.slot_token, group_size)
  groups = jnp.arange(num_groups)[:, None]
  return jnp.zeros(x_shape, outputs.dtype).at[groups, target].add(weighted, mode="drop")


def moe_sort(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Capacity-limited dispatch by sorting (`sort_slot_plan`); the same results as `moe_einsum`."""
  check_inputs(x, expert_index, gates)
  capacity = resolve_capacity(capacity, x.shape[1])
  num_experts = experts.num_experts
  plan = sort_slot_plan(expert_index, gates, num_experts=num_experts, capacity=capacity)
  buffers = gather_slots(x, plan, num_experts=num_experts, capacity=capacity)
  return combine_slots(experts.apply(buffers), plan, x.shape), plan.stats
