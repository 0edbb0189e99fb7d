"""Interchangeable MoE dispatch algorithms with one interface.

Every algorithm maps routing decisions and the stacked expert weights straight
to the layer output:

    y, stats = algorithm(x, expert_index, gates, experts, capacity=C)

with x: [G, S, D] tokens (G groups = examples, S tokens per group),
expert_index / gates: [G, S, k] routing decisions (best choice first) and
`experts` an `ExpertWeights`. `stats` is the `DispatchStats` of
`fairmoe_jax.moe.dispatch`, so logging is identical whichever algorithm runs.

Capacity semantics (shared by `einsum` and `sort`, the reference is
`dispatch.dispatch_and_combine_masks`): each expert accepts at most C choices per
group; all top-1 choices of a group are served before any top-2 choice, and
within one priority level earlier tokens come first; a dropped choice
contributes 0 to the output.

Algorithms and their dispatch memory (besides the O(G S D) input and output and
the expert activations):

* `dense`: every expert on every token, weighted by the gates of the chosen
  experts; capacity is ignored and nothing is dropped. O(G S E (D + H)) memory and
  E / k times the FLOPs of a sparse layer: the test oracle, not for training.
* `einsum`: GShard / V-MoE one-hot dispatch and combine tensors (wraps
  `dispatch.einsum_dispatch` / `dispatch.einsum_combine`). O(G S E C) memory,
  quadratic in the group size since C ~ S k / E.
* `sort`: same capacity semantics and the same expert buffers as `einsum`, built
  without any [S, E, C] tensor. The (expert, priority) pairs of each group are
  sorted; the position of a choice in its expert's queue is its rank in sorted
  order minus the start of its expert's segment (found by binary search). The
  [G, E, C, D] buffers are then filled by an index gather and the gated expert
  outputs are scatter-added back to their tokens. O(G E C D + G S k) memory.
* `dropless`: all G S k choices sorted by expert, experts applied with
  `jax.lax.ragged_dot` grouped matmuls (MegaBlocks-style); capacity is ignored
  and nothing is ever dropped. O(G S k D) memory (O(G S k H) for the hidden
  activations), no padding; compute is proportional to the real load.

All algorithms compute the expert matmuls in x.dtype (the weights are cast to it)
and keep gates in float32 until they weight the expert outputs, which are
returned in x.dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from fairmoe_jax.moe import dispatch as dispatch_lib
from fairmoe_jax.moe.dispatch import DispatchStats

__all__ = [
    "DISPATCH_ALGORITHMS",
    "DispatchAlgorithm",
    "ExpertWeights",
    "moe_dense",
    "moe_dropless",
    "moe_einsum",
    "moe_sort",
]


@struct.dataclass
class ExpertWeights:
  """Stacked weights of E GELU-MLP experts.

  Attributes:
    w1: [E, D, H] first-layer kernels.
    b1: [E, H] first-layer biases.
    w2: [E, H, D] second-layer kernels.
    b2: [E, D] second-layer biases.
  """

  w1: jax.Array
  b1: jax.Array
  w2: jax.Array
  b2: jax.Array

  @classmethod
  def from_module(cls, module: Any) -> "ExpertWeights":
    """Reads `w1, b1, w2, b2` from a module with those attributes (e.g. `SparseMoE`)."""
    return cls(*(getattr(module, name)[...] for name in ("w1", "b1", "w2", "b2")))

  @property
  def num_experts(self) -> int:
    return self.w1.shape[0]

  def cast(self, dtype: Any) -> "ExpertWeights":
    """The weights in the compute dtype."""
    return jax.tree.map(lambda w: w.astype(dtype), self)

  def apply(self, x: jax.Array) -> jax.Array:
    """Applies expert e to row e of x: [..., E, N, D] -> [..., E, N, D].

    Computed in x.dtype, with the exact (erf) GELU of timm's ViT MLP.
    """
    w = self.cast(x.dtype)
    h = jnp.einsum("...end,edh->...enh", x, w.w1) + w.b1[:, None, :]
    h = jax.nn.gelu(h, approximate=False)
    return jnp.einsum("...enh,ehd->...end", h, w.w2) + w.b2[:, None, :]


DispatchAlgorithm = Callable[..., tuple[jax.Array, DispatchStats]]


def check_inputs(x: jax.Array, expert_index: jax.Array, gates: jax.Array) -> None:
  if x.ndim != 3:
    raise ValueError(f"x must be [groups, tokens, dim], got {x.shape}")
  if expert_index.ndim != 3 or expert_index.shape[:2] != x.shape[:2]:
    raise ValueError(
        f"expert_index must be [groups, tokens, k] for x {x.shape}, got {expert_index.shape}"
    )
  if gates.shape != expert_index.shape:
    raise ValueError(f"gates {gates.shape} and expert_index {expert_index.shape} differ")


def resolve_capacity(capacity: int | None, group_size: int) -> int:
  """None means "enough": an expert never gets more than S choices of a group."""
  if capacity is None:
    return group_size
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  return int(capacity)


def _dropless_stats(expert_index: jax.Array, num_experts: int) -> DispatchStats:
  """Stats of an algorithm that serves every choice."""
  num_groups, group_size, top_k = expert_index.shape
  groups = jnp.arange(num_groups)[:, None]
  counts = jnp.zeros((num_groups, num_experts), jnp.float32)
  counts = counts.at[groups, expert_index.reshape(num_groups, -1)].add(1.0)
  return DispatchStats(
      kept=jnp.ones(expert_index.shape, bool),
      fraction_dropped=jnp.zeros((), jnp.float32),
      group_expert_fraction=counts / (group_size * top_k),
  )


def moe_dense(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Every expert on every token; the oracle. `capacity` is ignored.

  y[g, s] = sum_j gates[g, s, j] * E_{expert_index[g, s, j]}(x[g, s]).
  """
  del capacity
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  w = experts.cast(x.dtype)
  h = jnp.einsum("gsd,edh->gesh", x, w.w1) + w.b1[:, None, :]
  h = jax.nn.gelu(h, approximate=False)
  out = jnp.einsum("gesh,ehd->gesd", h, w.w2) + w.b2[:, None, :]
  # [G, S, E] gate of each expert, 0 where not chosen (a token's k experts differ).
  weights = jnp.einsum(
      "gske,gsk->gse", jax.nn.one_hot(expert_index, num_experts, dtype=gates.dtype), gates
  )
  y = jnp.einsum("gse,gesd->gsd", weights.astype(x.dtype), out)
  return y, _dropless_stats(expert_index, num_experts)


def moe_einsum(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """One-hot [G, S, E, C] dispatch / combine (`dispatch.einsum_dispatch`)."""
  check_inputs(x, expert_index, gates)
  capacity = resolve_capacity(capacity, x.shape[1])
  dispatched, combine, stats = dispatch_lib.einsum_dispatch(
      x, expert_index, gates, capacity, num_experts=experts.num_experts
  )
  y = dispatch_lib.einsum_combine(combine, experts.apply(dispatched))
  return y, stats


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
  stats = DispatchStats(
      kept=kept,
      fraction_dropped=jnp.mean(~kept, dtype=jnp.float32),
      group_expert_fraction=served.astype(jnp.float32) / num_choices,
  )

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


def moe_dropless(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Sort all choices by expert and run grouped matmuls; nothing is dropped.

  `capacity` is ignored. Groups only matter for the stats: all G * S * k choices
  are sorted together and each expert processes exactly its own tokens with
  `jax.lax.ragged_dot`.
  """
  del capacity
  check_inputs(x, expert_index, gates)
  num_groups, group_size, top_k = expert_index.shape
  num_experts = experts.num_experts
  dim = x.shape[-1]
  num_choices = num_groups * group_size * top_k

  flat_expert = expert_index.reshape(num_choices).astype(jnp.int32)
  # Choice i = (t * k + j) belongs to token t = i // k of the flattened [G * S] tokens.
  choice = jnp.arange(num_choices, dtype=jnp.int32)
  sorted_expert, sorted_choice = jax.lax.sort(
      (flat_expert, choice), dimension=0, is_stable=True, num_keys=1
  )
  bounds = jnp.searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  group_sizes = (bounds[1:] - bounds[:-1]).astype(jnp.int32)
  token = sorted_choice // top_k

  w = experts.cast(x.dtype)
  x_sorted = x.reshape(num_groups * group_size, dim)[token]
  h = jax.lax.ragged_dot(x_sorted, w.w1, group_sizes) + w.b1[sorted_expert]
  h = jax.nn.gelu(h, approximate=False)
  out = jax.lax.ragged_dot(h, w.w2, group_sizes) + w.b2[sorted_expert]
  weighted = out * gates.reshape(num_choices)[sorted_choice].astype(x.dtype)[:, None]
  y = jnp.zeros((num_groups * group_size, dim), x.dtype).at[token].add(weighted)
  return y.reshape(x.shape), _dropless_stats(expert_index, num_experts)


DISPATCH_ALGORITHMS: dict[str, DispatchAlgorithm] = {
    "dense": moe_dense,
    "einsum": moe_einsum,
    "sort": moe_sort,
    "dropless": moe_dropless,
}
