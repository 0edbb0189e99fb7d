"""Expert choice routing (Zhou et al. 2022, "Mixture of experts with expert choice routing").

Every expert picks its C best tokens of a group, so nothing overflows. The expert-major
`ExpertChoiceAssignment` is not a `RouterOutput`: `apply_expert_choice` gathers the picks, runs
the experts and gathers their outputs back (`dispatch.slots`), instead of a dispatch
(`SparseMoE(router="expert_choice")`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe.dispatch.capacity import compute_capacity
from fairmoe_jax.moe.dispatch.slots import SlotPlan, combine_slots, gather_rows, gather_slots
from fairmoe_jax.moe.routers.base import float32_gate, router_z_loss


@struct.dataclass
class ExpertChoiceAssignment:
  """Expert-major routing decisions of expert choice routing.

  Attributes:
    token_index: [G, E, C] int32, each expert's tokens (positions in the group), best first.
    gates: [G, E, C] float32, their affinity softmax(x W_g)[token, expert] (not renormalised).
    logits: [G, S, E] float32 router logits.
    probs: [G, S, E] float32 softmax over experts (the affinities).
    experts_per_token: [G, S] int32, experts that picked each token (0: residual only).
    fraction_unrouted: scalar, fraction of tokens that no expert picked.
    z_loss: scalar ST-MoE router z-loss of the logits (unweighted).
  """

  token_index: jax.Array
  gates: jax.Array
  logits: jax.Array
  probs: jax.Array
  experts_per_token: jax.Array
  fraction_unrouted: jax.Array
  z_loss: jax.Array


def expert_choice_from_logits(logits: jax.Array, capacity: int) -> ExpertChoiceAssignment:
  """Each expert picks its `capacity` (1 <= C <= S) best tokens of each group; logits [G, S, E]."""
  if logits.ndim != 3:
    raise ValueError(f"logits must be [groups, tokens, experts], got {logits.shape}")
  _, group_size, num_experts = logits.shape
  if not 1 <= capacity <= group_size:
    raise ValueError(f"capacity={capacity} must be in [1, group_size={group_size}]")
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  # [G, E, S] -> top-C tokens per expert; ties go to the earlier token.
  gates, token_index = jax.lax.top_k(jnp.swapaxes(probs, 1, 2), capacity)
  token_index = token_index.astype(jnp.int32)
  picked = jax.nn.one_hot(token_index, group_size, dtype=jnp.int32)  # [G, E, C, S]
  experts_per_token = picked.sum(axis=(1, 2))
  return ExpertChoiceAssignment(
      token_index=token_index,
      gates=gates,
      logits=logits,
      probs=probs,
      experts_per_token=experts_per_token,
      fraction_unrouted=jnp.mean(experts_per_token == 0, dtype=jnp.float32),
      z_loss=router_z_loss(logits.reshape(-1, num_experts)),
  )


class ExpertChoiceRouter(nnx.Module):
  """Expert choice routing (Zhou et al. 2022): experts pick tokens.

  Affinities softmax(x W_g) over experts (`TopKRouter`'s gate); each expert takes its top-C
  tokens of a group, C = ceil(capacity_factor * S / E), so capacity_factor is the mean number of
  experts per token. Perfectly balanced (no auxiliary loss); a token may get several experts or
  none (zero MoE output). Not causal: a token's routing depends on its group's other tokens (here
  one group per example, so not on the rest of the batch).
  """

  def __init__(self, dim: int, num_experts: int, *, capacity_factor: float, rngs: nnx.Rngs):
    if capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    self.num_experts = num_experts
    self.capacity_factor = capacity_factor
    self.gate = float32_gate(dim, num_experts, rngs=rngs)

  def capacity(self, group_size: int) -> int:
    """C for groups of `group_size` tokens."""
    return compute_capacity(group_size, self.num_experts, 1, self.capacity_factor)

  def logits(self, x: jax.Array) -> jax.Array:
    """[..., D] tokens -> [..., E] float32 logits."""
    return self.gate(x.astype(jnp.float32))

  def __call__(self, x: jax.Array, *, capacity: int | None = None) -> ExpertChoiceAssignment:
    """x: [G, S, D] -> `ExpertChoiceAssignment`; capacity None uses `self.capacity(S)`."""
    if x.ndim != 3:
      raise ValueError(f"x must be [groups, tokens, dim], got {x.shape}")
    if capacity is None:
      capacity = self.capacity(x.shape[1])
    return expert_choice_from_logits(self.logits(x), capacity)


def apply_expert_choice(
    x: jax.Array, assignment: ExpertChoiceAssignment, expert_fn: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """Gather -> experts -> gate-weighted sum per token.

      y[g, s] = sum over (e, c) with token_index[g, e, c] = s of
                gates[g, e, c] * expert_fn(x[g, token_index])[g, e, c]

  x: [G, S, D]; expert_fn: [G, E, C, D] -> [G, E, C, D'] (e.g. `ExpertWeights.apply`). Returns
  y [G, S, D'], zero for tokens no expert picked.
  """
  return apply_expert_picks(x, assignment.token_index, assignment.gates, expert_fn)


def apply_expert_picks(
    x: jax.Array,
    token_index: jax.Array,
    gates: jax.Array,
    expert_fn: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """`apply_expert_choice` from token_index and gates [G, E, C] alone; groups are
  computed apart, so it runs as is on a device's own groups (`data_parallel.per_device`).

  Moved by gathers both ways (`slots`): slot (g, e, c) holds choice (token, e) of the flat
  [G * S] tokens, and each token's E choices know their slots, so no scatter-add runs.
  """
  num_groups, group_size, _ = x.shape
  _, num_experts, _ = token_index.shape
  groups = jnp.arange(num_groups, dtype=jnp.int32)[:, None, None]
  experts = jnp.arange(num_experts, dtype=jnp.int32)[None, :, None]
  slot_choice = ((groups * group_size + token_index) * num_experts + experts).reshape(-1)
  num_slots, num_choices = slot_choice.size, num_groups * group_size * num_experts
  choice_slot = jnp.full((num_choices,), num_slots, jnp.int32)
  choice_slot = choice_slot.at[slot_choice].set(jnp.arange(num_slots), unique_indices=True)
  plan = SlotPlan(slot_choice.reshape(token_index.shape), choice_slot.reshape(-1, num_experts))
  outputs = expert_fn(gather_slots(x.reshape(-1, x.shape[-1]), plan))
  # Choice (t, e)'s gate, 0 where e did not pick t; its gradient gathers back per slot.
  weights = gather_rows(gates.reshape(num_slots, 1), choice_slot, slot_choice[:, None])
  y = combine_slots(outputs, weights.reshape(-1, num_experts), plan)
  return y.reshape(num_groups, group_size, -1)
