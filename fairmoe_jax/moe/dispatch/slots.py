"""Expert-major slots and the row gathers that move tokens into and out of them.

A `SlotPlan` maps the T * k routing choices to rows ("slots") of an expert-major buffer and
back. With both maps, every data movement is a row gather, in the forward pass and in the
backward pass (a custom VJP):

  dispatch  buffers[slot] = x[token(slot)]        its VJP  dx[t] = sum_j dbuffers[slot(t, j)]
  combine   y[t] = sum_j w[t, j] out[slot(t, j)]   its VJP  dout[slot] = w dy[token(slot)]

so no scatter-add (a serial loop on CPU, atomics on GPU: reruns differ) and no transpose of
[G, E, C, D] buffers is ever run. `sort` fills the slots under a capacity (`sort_slot_plan`), the
experimental `blocksparse` with expert-sorted blocks (`experimental.blocksparse.block_plan`),
`dropless` with every choice sorted by expert, expert choice with each expert's picks;
batch priority permutes tokens with `gather_rows` alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from fairmoe_jax.moe.dispatch.capacity import DispatchStats


@struct.dataclass
class SlotPlan:
  """Which choice sits in which expert-major capacity slot, both ways.

  Choice (t, j) of T = G * S group-major tokens is t * k + j; slot (e, g, c) is row
  e * G * C + g * C + c of the [E * G * C, D] buffers (`sort`; the buffers take the shape of
  `slot_choice`, whatever it is: dropless' [N] sorted choices, expert choice's [G, E, C]).

  Attributes:
    slot_choice: [E, G * C] int32 choice held by each slot; T * k where the slot is empty.
    choice_slot: [T, k] int32 slot of each choice; E * G * C where the choice was dropped.
    stats: the `DispatchStats` of these decisions (None for expert choice's).
  """

  slot_choice: jax.Array
  choice_slot: jax.Array
  stats: DispatchStats | None = None

  @property
  def top_k(self) -> int:
    return self.choice_slot.shape[1]

  @property
  def num_slots(self) -> int:
    return self.slot_choice.size

  def slot_token(self) -> jax.Array:
    """[E * G * C] token of each slot; T (out of range) where the slot is empty."""
    return self.slot_choice.reshape(-1) // self.top_k


def _take_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
  """rows[index] along the first axis; out-of-range indices give zero rows."""
  return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def gather_rows(rows: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """rows[index] along the first axis (out-of-range indices give zero rows), with a gather for
  its VJP: `inverse` [R, m] lists, for each of the R rows, the m positions i with index[i] = row
  (out of range where fewer), so d_rows[r] = sum_j d_out[inverse[r, j]].
  """
  return _take_rows(rows, index)


def _gather_rows_fwd(rows, index, inverse):
  return gather_rows(rows, index, inverse), inverse


def _gather_rows_bwd(inverse, d_out):
  return _take_rows(d_out, inverse).sum(axis=1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


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
  buffers = gather_rows(tokens, plan.slot_token(), plan.choice_slot)
  return buffers.reshape(*plan.slot_choice.shape, tokens.shape[-1])


def combine_slots(outputs: jax.Array, gates: jax.Array, plan: SlotPlan) -> jax.Array:
  """Expert outputs [E, G * C, D] weighted by the gates [T, k] -> [T, D]; dropped choices add 0."""
  flat = outputs.reshape(-1, outputs.shape[-1])
  return _combine(flat, gates, plan.slot_choice.reshape(-1), plan.choice_slot)
