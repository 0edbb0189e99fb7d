"""`sort` dispatch: capacity-limited dispatch by sorting, in expert-major buffers, by gathers only.

`einsum`'s semantics. Per group, the (expert, priority) pairs of the k * S choices are sorted; a
choice's queue position is its rank minus its expert's segment start (binary search). The
resulting `SlotPlan` moves data by row gathers only (`slots`), computed once for both passes;
the experts see [E, G * C, D], an expert-parallel all-to-all's layout. O(E G C D + G S k D)
memory, no [S, E, C] tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.slots import SlotPlan, combine_slots, gather_slots


def _batched_searchsorted(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
  """searchsorted (side="left") of queries [Q] in every row of sorted_values [G, N]."""
  return jax.vmap(lambda row: jnp.searchsorted(row, queries, side="left"))(sorted_values)


def sort_slot_plan(expert_index: jax.Array, *, num_experts: int, capacity: int) -> SlotPlan:
  """Capacity slots by sorting, with `moe_einsum`'s semantics.

  Choices are numbered priority-major (p = j * S + s) and sorted by (expert, p); expert e's
  choices are then the segment [start_e, start_e + count_e), so slot c of expert e is sorted
  element start_e + c, served iff c < min(count_e, C).
  """
  num_groups, group_size, top_k = expert_index.shape
  num_choices = group_size * top_k  # Per group.
  total_choices = num_groups * num_choices
  num_slots = num_experts * num_groups * capacity
  groups = jnp.arange(num_groups, dtype=jnp.int32)[:, None]

  # Priority-major flattening: [G, k * S], element p = j * S + s.
  expert_pm = jnp.swapaxes(expert_index, 1, 2).reshape(num_groups, num_choices).astype(jnp.int32)
  priority = jnp.broadcast_to(jnp.arange(num_choices, dtype=jnp.int32), expert_pm.shape)
  # The (expert, priority) keys are unique, so the order is fully determined.
  sorted_expert, sorted_priority = jax.lax.sort(
      (expert_pm, priority), dimension=1, is_stable=True, num_keys=2
  )
  # Segment boundaries of every expert in the sorted order: [G, E + 1].
  bounds = _batched_searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  start, count = bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]
  served = jnp.minimum(count, capacity)

  # Every sorted element: its choice number and, if served, its slot row.
  position = jnp.arange(num_choices, dtype=jnp.int32) - jnp.take_along_axis(
      start, sorted_expert, axis=1
  )
  token = groups * group_size + sorted_priority % group_size
  sorted_choice = token * top_k + sorted_priority // group_size
  sorted_slot = jnp.where(
      position < capacity,
      sorted_expert * (num_groups * capacity) + groups * capacity + position,
      num_slots,
  )
  choice_slot = (
      jnp.full((total_choices,), num_slots, jnp.int32)
      .at[sorted_choice.reshape(-1)]
      .set(sorted_slot.reshape(-1), unique_indices=True)
  )

  # Slot (e, g, c) holds the sorted element start[g, e] + c when c < served[g, e].
  slots = jnp.arange(capacity, dtype=jnp.int32)
  valid = slots < served[:, :, None]  # [G, E, C]
  sorted_pos = jnp.minimum(start[:, :, None] + slots, num_choices - 1).reshape(num_groups, -1)
  slot_choice = jnp.take_along_axis(sorted_choice, sorted_pos, axis=1).reshape(valid.shape)
  slot_choice = jnp.where(valid, slot_choice, total_choices)
  # Expert-major: [G, E, C] -> [E, G * C]; only this small index array is transposed.
  slot_choice = jnp.swapaxes(slot_choice, 0, 1).reshape(num_experts, num_groups * capacity)

  kept = (choice_slot < num_slots).reshape(num_groups, group_size, top_k)
  stats = DispatchStats.from_kept(kept, served.astype(jnp.float32) / num_choices)
  return SlotPlan(
      slot_choice=slot_choice,
      choice_slot=choice_slot.reshape(num_groups * group_size, top_k),
      stats=stats,
  )


def moe_sort(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """`sort_slot_plan`, the expert MLP on [E, G * C, D] buffers; `moe_einsum`'s results."""
  check_inputs(x, expert_index, gates)
  capacity = resolve_capacity(capacity, x.shape[1])
  # Each group's plan and gathers apart (vmap): gathers with a group batch axis, which the SPMD
  # partitioner splits over a sharded batch where no mesh is known; the MLP outside the vmap, so
  # the weights' gradient sums over every group at once.
  plan = jax.vmap(
      lambda index: sort_slot_plan(index[None], num_experts=experts.num_experts, capacity=capacity)
  )(expert_index)
  buffers = jax.vmap(gather_slots, out_axes=1)(x, plan)  # [E, G, C, D]
  outputs = experts.apply(buffers.reshape(experts.num_experts, -1, x.shape[-1]))
  y = jax.vmap(combine_slots, in_axes=(1, 0, 0))(outputs.reshape(buffers.shape), gates, plan)
  stats = DispatchStats.from_kept(
      plan.stats.kept.reshape(expert_index.shape), plan.stats.group_expert_fraction[:, 0]
  )
  return y, stats
