"""Capacity-limited einsum dispatch (GShard / V-MoE).

Tokens are processed in groups (here: one group per example, so G = batch and
S = tokens per example). Every expert accepts at most `capacity` tokens per
group; routing decisions beyond that are dropped. The dispatch is expressed as
two dense one-hot tensors of shape [G, S, E, C]:

  dispatch[g, s, e, c] = 1  iff token s of group g sits in slot c of expert e;
  combine[g, s, e, c]  = gate of that choice (0 where dispatch is 0).

Expert inputs are einsum("gsec,gsd->gecd", dispatch, x) and the layer output is
einsum("gsec,gecd->gsd", combine, expert_outputs). This costs O(G S E C) memory,
which is fine for ViT-sized groups; the production layer swaps this module for
sorting-based dispatch without touching the router.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DispatchStats:
  """Bookkeeping of which routing decisions survived the capacity limit.

  Attributes:
    kept: [G, S, k] bool, whether choice j of token s was served.
    fraction_dropped: scalar, fraction of all (token, choice) pairs dropped.
    group_expert_fraction: [G, E], per group, the fraction of its S * k
      (token, choice) pairs that were served by each expert. Rows sum to
      1 - (fraction of that group's choices dropped).
  """

  kept: jax.Array
  fraction_dropped: jax.Array
  group_expert_fraction: jax.Array


def compute_capacity(
    tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float
) -> int:
  """C = ceil(capacity_factor * S * k / E), clipped to [1, S].

  No expert can receive more than S tokens from a group (a token's k choices are
  distinct experts), so a larger C would only add empty slots.
  """
  # The small epsilon keeps e.g. 1.1 * 10 = 11.000000000000002 from rounding up.
  capacity = math.ceil(capacity_factor * tokens_per_group * top_k / num_experts - 1e-9)
  return int(min(max(capacity, 1), tokens_per_group))


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
  stats = DispatchStats(
      kept=kept,
      fraction_dropped=jnp.mean(~kept, dtype=jnp.float32),
      group_expert_fraction=group_expert_fraction,
  )
  return dispatch, combine, stats


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
    dispatched: [G, E, C, D] expert inputs in x.dtype; empty slots are zero.
    combine: [G, S, E, C] combine weights, to be passed to `einsum_combine`.
    stats: `DispatchStats`.
  """
  dispatch, combine, stats = dispatch_and_combine_masks(
      expert_index, gates, num_experts=num_experts, capacity=capacity
  )
  # 0/1 entries are exact in any float dtype, so the gather is lossless.
  dispatched = jnp.einsum("gsec,gsd->gecd", dispatch.astype(x.dtype), x)
  return dispatched, combine, stats


def einsum_combine(combine: jax.Array, expert_outputs: jax.Array) -> jax.Array:
  """[G, S, E, C] weights x [G, E, C, D] expert outputs -> [G, S, D].

  Dropped choices have zero weight, so a token whose every choice was dropped
  gets 0 here and is carried only by the residual connection of its block.
  """
  return jnp.einsum("gsec,gecd->gsd", combine.astype(expert_outputs.dtype), expert_outputs)
