"""`sort` dispatch: capacity-limited dispatch by sorting, in expert-major buffers, by gathers only.

Same capacity semantics as `einsum`. Per group, the (expert, priority) pairs of the k * S
choices are sorted; a choice's position in its expert's queue is its rank in sorted order minus
the start of its expert's segment (found by binary search). The result is a `SlotPlan`: two
index maps between the choices and the expert-major slots [E, G * C] (expert e's buffer holds
C slots of every group, one after the other), each the inverse of the other on the served
choices.

With both maps, every data movement is a row gather, in the forward pass and in the backward
pass (a custom VJP):

  dispatch  buffers[slot] = x[token(slot)]        its VJP  dx[t] = sum_j dbuffers[slot(t, j)]
  combine   y[t] = sum_j w[t, j] out[slot(t, j)]   its VJP  dout[slot] = w dy[token(slot)]

so no scatter-add (a serial loop on CPU, atomics on GPU) and no transpose of [G, E, C, D]
buffers is ever run, and the plan is computed once for both passes. The expert matmuls see
[E, G * C, D], the layout of an expert-parallel all-to-all. O(E G C D + G S k D) memory; no
[S, E, C] tensor.
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
  """Which choice sits in which expert-major capacity slot, both ways.

  With T = G * S tokens (group-major), choice (t, j) is numbered t * k + j, and slot (e, g, c)
  is row e * G * C + g * C + c of the [E * G * C, D] buffers.

  Attributes:
    slot_choice: [E, G * C] int32 choice held by each slot; T * k where the slot is empty.
    choice_slot: [T, k] int32 slot of each choice; E * G * C where the choice was dropped.
    stats: the `DispatchStats` of these decisions.
  """

  slot_choice: jax.Array
  choice_slot: jax.Array
  stats: DispatchStats

  @property
  def top_k(self) -> int:
    return self.choice_slot.shape[1]

  @property
  def num_slots(self) -> int:
    return self.slot_choice.size

  def slot_token(self) -> jax.Array:
    """[E * G * C] token of each slot; T (out of range) where the slot is empty."""
    return self.slot_choice.reshape(-1) // self.top_k


def sort_slot_plan(expert_index: jax.Array, *, num_experts: int, capacity: int) -> SlotPlan:
  """Capacity slots by sorting, with `moe_einsum`'s semantics and no [S, E, C] tensor.

  Per group, the k * S (token, choice) pairs are numbered priority-major
  (p = j * S + s, so every top-1 choice precedes every top-2 choice and earlier
  tokens come first) and sorted by the key (expert, p). Expert e's choices then
  form the segment [start_e, start_e + count_e) of the sorted order, in arrival
  order, so slot c of expert e is the sorted element start_e + c, served iff
  c < min(count_e, C).
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


def _take_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
  """rows[index] along the first axis; out-of-range indices give zero rows."""
  return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def _dispatch(tokens: jax.Array, slot_token: jax.Array, choice_slot: jax.Array) -> jax.Array:
  """[T, D] tokens -> [N, D] slot rows; empty slots are zero."""
  return _take_rows(tokens, slot_token)


def _dispatch_fwd(tokens, slot_token, choice_slot):
  return _dispatch(tokens, slot_token, choice_slot), (slot_token, choice_slot)


def _dispatch_bwd(residuals, d_buffers):
  slot_token, choice_slot = residuals
  # Each token's gradient is the sum over its served choices of their slots' gradients.
  d_tokens = _take_rows(d_buffers, choice_slot).sum(axis=1)
  return d_tokens, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(
    outputs: jax.Array, weights: jax.Array, slot_choice: jax.Array, choice_slot: jax.Array
) -> jax.Array:
  """[N, D] slot outputs, [T, k] float32 choice weights -> [T, D] in the outputs' dtype."""
  gathered = _take_rows(outputs, choice_slot)  # [T, k, D]
  return jnp.einsum("tkd,tk->td", gathered, weights.astype(outputs.dtype))


def _combine_fwd(outputs, weights, slot_choice, choice_slot):
  y = _combine(outputs, weights, slot_choice, choice_slot)
  return y, (outputs, weights, slot_choice, choice_slot)


def _combine_bwd(residuals, d_y):
  outputs, weights, slot_choice, choice_slot = residuals
  top_k = choice_slot.shape[1]
  slot_weight = _take_rows(weights.reshape(-1), slot_choice)  # 0 for empty slots.
  d_outputs = _take_rows(d_y, slot_choice // top_k) * slot_weight[:, None].astype(d_y.dtype)
  # The gates' gradient in float32, like the routing that produced them.
  d_weights = jnp.einsum(
      "tkd,td->tk", _take_rows(outputs, choice_slot), d_y, preferred_element_type=jnp.float32
  )
  return d_outputs, d_weights.astype(weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def gather_slots(tokens: jax.Array, plan: SlotPlan) -> jax.Array:
  """Expert-major buffers [E, G * C, D] of tokens [T, D] (T = G * S, group-major)."""
  buffers = _dispatch(tokens, plan.slot_token(), plan.choice_slot)
  return buffers.reshape(*plan.slot_choice.shape, tokens.shape[-1])


def combine_slots(outputs: jax.Array, gates: jax.Array, plan: SlotPlan) -> jax.Array:
  """Expert outputs [E, G * C, D] weighted by the gates [T, k] of their choices -> [T, D].

  A dropped choice contributes 0, so a token whose every choice was dropped gets 0 here and
  is carried only by the residual connection of its block.
  """
  flat = outputs.reshape(-1, outputs.shape[-1])
  return _combine(flat, gates, plan.slot_choice.reshape(-1), plan.choice_slot)


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
  num_groups, group_size, dim = x.shape
  capacity = resolve_capacity(capacity, group_size)
  plan = sort_slot_plan(expert_index, num_experts=experts.num_experts, capacity=capacity)
  tokens = x.reshape(num_groups * group_size, dim)
  outputs = experts.apply(gather_slots(tokens, plan))
  y = combine_slots(outputs, gates.reshape(num_groups * group_size, -1), plan)
  return y.reshape(x.shape), plan.stats
