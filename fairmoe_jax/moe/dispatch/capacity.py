"""Expert capacity, routing groups (`group_size` examples whose tokens compete for the same
slots) and `DispatchStats`, the record of which choices were served, the same for every
algorithm (semantics: `fairmoe_jax.moe.dispatch.base`).
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
    tokens_per_group: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    multiple_of: int = 1,
) -> int:
  """C = ceil(capacity_factor * S * k / E), clipped to [1, S] (an expert gets at most S), then
  rounded up to a multiple of `multiple_of` (V-MoE rounds to 4; a TPU tile has 8 float32 rows,
  so [E, G, C, D] buffers merge to [E, G C, D] rows without a relayout copy)."""
  if multiple_of < 1:
    raise ValueError(f"capacity multiple_of must be >= 1, got {multiple_of}")
  # The small epsilon keeps e.g. 1.1 * 10 = 11.000000000000002 from rounding up.
  capacity = math.ceil(capacity_factor * tokens_per_group * top_k / num_experts - 1e-9)
  capacity = min(max(capacity, 1), tokens_per_group)
  return int(-(-capacity // multiple_of) * multiple_of)


def to_groups(arrays: tuple[jax.Array, ...], group_size: int) -> tuple[jax.Array, ...]:
  """Per-example [B, S, ...] arrays as routing groups [B / g, g S, ...] of g examples each."""
  batch = arrays[0].shape[0]
  if group_size < 1 or batch % group_size:
    raise ValueError(f"group_size={group_size} does not divide the batch of {batch} examples")
  return tuple(a.reshape(batch // group_size, -1, *a.shape[2:]) for a in arrays)


def stats_per_example(
    stats: DispatchStats, expert_index: jax.Array, num_experts: int
) -> DispatchStats:
  """Stats of routing groups of several examples, per example again: `expert_index` [B, S, k]
  in token order, `stats.kept` [B / g, g S, k] -> [B, S, k] and each example's own expert
  fraction [B, E]."""
  kept = stats.kept.reshape(expert_index.shape)
  served = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32) * kept[..., None]
  _, seq_len, top_k = expert_index.shape
  return stats.replace(kept=kept, group_expert_fraction=served.sum(axis=(1, 2)) / (seq_len * top_k))


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
