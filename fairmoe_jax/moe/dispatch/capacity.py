"""Expert capacity (one group per example) and `DispatchStats`, the record of which choices
were served, the same for every algorithm (semantics: `fairmoe_jax.moe.dispatch.base`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DispatchStats:
  """Which routing decisions survived the capacity limit.

  Attributes:
    kept: [G, S, k] bool, whether choice j of token s was served.
    fraction_dropped: scalar, fraction of all (token, choice) pairs dropped.
    group_expert_fraction: [G, E], the fraction of each group's S * k pairs each expert served.
  """

  kept: jax.Array
  fraction_dropped: jax.Array
  group_expert_fraction: jax.Array

  @classmethod
  def from_kept(cls, kept: jax.Array, group_expert_fraction: jax.Array) -> "DispatchStats":
    """Stats with `fraction_dropped` computed from the `kept` mask."""
    return cls(
        kept=kept,
        fraction_dropped=jnp.mean(~kept, dtype=jnp.float32),
        group_expert_fraction=group_expert_fraction,
    )


def compute_capacity(
    tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float
) -> int:
  """C = ceil(capacity_factor * S * k / E), clipped to [1, S] (an expert gets at most S)."""
  # The small epsilon keeps e.g. 1.1 * 10 = 11.000000000000002 from rounding up.
  capacity = math.ceil(capacity_factor * tokens_per_group * top_k / num_experts - 1e-9)
  return int(min(max(capacity, 1), tokens_per_group))


def resolve_capacity(capacity: int | None, group_size: int) -> int:
  """None means "enough": an expert never gets more than S choices of a group."""
  if capacity is None:
    return group_size
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  return int(capacity)


def dropless_stats(expert_index: jax.Array, num_experts: int) -> DispatchStats:
  """Stats of an algorithm that serves every choice."""
  num_groups, group_size, top_k = expert_index.shape
  # A one-hot sum rather than a scatter-add (a serial loop on CPU): [G, S k, E] is small.
  choices = expert_index.reshape(num_groups, group_size * top_k)
  counts = jax.nn.one_hot(choices, num_experts, dtype=jnp.float32).sum(axis=1)
  return DispatchStats(
      kept=jnp.ones(expert_index.shape, bool),
      fraction_dropped=jnp.zeros((), jnp.float32),
      group_expert_fraction=counts / (group_size * top_k),
  )
