"""Expert parallelism: capacity-limited MoE dispatch with `jax.shard_map` and all-to-all.

    y, stats = expert_parallel_moe(x, expert_index, gates, experts, capacity=C, mesh=mesh)

has the semantics of `algorithms.moe_sort` / `algorithms.moe_einsum` (groups =
examples, C slots per group and expert, all top-1 choices of a group before any
top-2 choice, earlier tokens first, dropped choices contribute 0) and returns the
same `DispatchStats`, but runs under `jax.shard_map` over the mesh:

* x, expert_index, gates ([G, S, ...]) are split on the group axis over all batch
  axes (by default every mesh axis, i.e. ("data", "expert") of `trainkit.mesh`),
  so each device holds G_l = G / num_devices groups;
* the stacked expert weights are split over the "expert" axis (P("expert", ...),
  as annotated by `SparseMoE`): each expert shard holds E_l = E / n_expert
  experts, replicated over the other axes.

Per device: the capacity buffers [G_l, E, C, D] of the local groups are built
with the sort construction of `moe_sort` (no [S, E, C] tensor); an all-to-all
over the expert axis sends the buffers of experts [j E_l, (j + 1) E_l) to expert
shard j, which thus receives [n_expert * G_l, E_l, C, D], the tokens of its own
experts from every shard of its expert axis; it applies its local experts, a
second all-to-all returns the outputs to the devices owning the groups, and
they are combined with the gates there. Routing never crosses devices: since a
group is one example and lives on one device, the capacity decisions (and so the
stats) are exactly those of the single-device algorithms.

Per-device memory: O(G_l E C D) for the buffers (before and after the
all-to-all), like `moe_sort` on G_l groups; expert FLOPs are split n_expert ways.

Dropless (capacity-free) expert parallelism would need variable-size exchanges
(`jax.lax.ragged_all_to_all`, GPU/TPU only); it is not implemented here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from fairmoe_jax.moe.algorithms import ExpertWeights
from fairmoe_jax.moe.dispatch import DispatchStats

__all__ = ["EP_ALGORITHMS", "expert_parallel_moe"]

# Algorithms with an expert-parallel implementation. "sort" and "einsum" share
# their semantics (and results), so both map to the capacity path below.
EP_ALGORITHMS = ("sort", "einsum")


def _check_inputs(x: jax.Array, expert_index: jax.Array, gates: jax.Array) -> None:
  if x.ndim != 3:
    raise ValueError(f"x must be [groups, tokens, dim], got {x.shape}")
  if expert_index.ndim != 3 or expert_index.shape[:2] != x.shape[:2]:
    raise ValueError(
        f"expert_index must be [groups, tokens, k] for x {x.shape}, got {expert_index.shape}"
    )
  if gates.shape != expert_index.shape:
    raise ValueError(f"gates {gates.shape} and expert_index {expert_index.shape} differ")


def _sort_plan(
    expert_index: jax.Array, gates: jax.Array, *, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Slot assignment of `moe_sort`, per group.

  Args:
    expert_index: [G, S, k] chosen experts.
    gates: [G, S, k] gates.
    num_experts: E.
    capacity: C.

  Returns:
    slot_token: [G, E * C] int32 token of slot (e, c) (arbitrary where invalid).
    valid: [G, E * C] whether slot (e, c) holds a token.
    slot_gate: [G, E * C] gate of that choice, 0 where invalid (gates.dtype).
    kept: [G, S, k] whether each choice was served.
    served: [G, E] int32 served choices per expert.
  """
  num_groups, group_size, top_k = expert_index.shape
  num_choices = group_size * top_k
  groups = jnp.arange(num_groups)[:, None]

  # Priority-major flattening: element p = j * S + s.
  expert_pm = jnp.swapaxes(expert_index, 1, 2).reshape(num_groups, num_choices).astype(jnp.int32)
  gates_pm = jnp.swapaxes(gates, 1, 2).reshape(num_groups, num_choices)
  priority = jnp.broadcast_to(jnp.arange(num_choices, dtype=jnp.int32), expert_pm.shape)
  sorted_expert, sorted_priority = jax.lax.sort(
      (expert_pm, priority), dimension=1, is_stable=True, num_keys=2
  )
  queries = jnp.arange(num_experts + 1, dtype=jnp.int32)
  bounds = jax.vmap(lambda row: jnp.searchsorted(row, queries, side="left"))(sorted_expert)
  start, count = bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]

  position = jnp.arange(num_choices, dtype=jnp.int32) - jnp.take_along_axis(
      start, sorted_expert, axis=1
  )
  kept_pm = jnp.zeros((num_groups, num_choices), bool)
  kept_pm = kept_pm.at[groups, sorted_priority].set(position < capacity, unique_indices=True)
  kept = jnp.swapaxes(kept_pm.reshape(num_groups, top_k, group_size), 1, 2)
  served = jnp.minimum(count, capacity)

  slots = jnp.arange(capacity, dtype=jnp.int32)
  valid = (slots < served[:, :, None]).reshape(num_groups, -1)
  sorted_pos = jnp.minimum(start[:, :, None] + slots, num_choices - 1).reshape(num_groups, -1)
  slot_priority = jnp.take_along_axis(sorted_priority, sorted_pos, axis=1)
  slot_token = slot_priority % group_size
  slot_gate = jnp.where(valid, jnp.take_along_axis(gates_pm, slot_priority, axis=1), 0.0)
  return slot_token, valid, slot_gate, kept, served


def _local_moe(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    num_experts: int,
    capacity: int,
    expert_axis: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-device body: local groups [G_l, S, ...], local experts [E_l, ...]."""
  num_groups, group_size, top_k = expert_index.shape
  dim = x.shape[-1]
  slot_token, valid, slot_gate, kept, served = _sort_plan(
      expert_index, gates, num_experts=num_experts, capacity=capacity
  )
  buffers = jnp.take_along_axis(x, slot_token[:, :, None], axis=1)
  buffers = jnp.where(valid[:, :, None], buffers, jnp.zeros((), x.dtype))
  buffers = buffers.reshape(num_groups, num_experts, capacity, dim)

  # [G_l, E, C, D] -> [n_expert * G_l, E_l, C, D]: expert shard j gets the slots of
  # its experts [j E_l, (j + 1) E_l) from every shard of its expert axis.
  received = jax.lax.all_to_all(buffers, expert_axis, split_axis=1, concat_axis=0, tiled=True)
  outputs = experts.apply(received)
  # And back: [n_expert * G_l, E_l, C, D] -> [G_l, E, C, D].
  outputs = jax.lax.all_to_all(outputs, expert_axis, split_axis=0, concat_axis=1, tiled=True)

  weighted = (
      outputs.reshape(num_groups, num_experts * capacity, dim)
      * slot_gate.astype(x.dtype)[:, :, None]
  )
  target = jnp.where(valid, slot_token, group_size)
  groups = jnp.arange(num_groups)[:, None]
  y = jnp.zeros(x.shape, x.dtype).at[groups, target].add(weighted, mode="drop")
  group_expert_fraction = served.astype(jnp.float32) / (group_size * top_k)
  return y, kept, group_expert_fraction


def expert_parallel_moe(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None,
    mesh: Mesh,
    algorithm: str = "sort",
    expert_axis: str = "expert",
    batch_axes: Sequence[str] | None = None,
) -> tuple[jax.Array, DispatchStats]:
  """Capacity-limited expert-parallel MoE; the same results as `moe_sort`.

  Args:
    x: [G, S, D] tokens (G groups = examples).
    expert_index: [G, S, k] chosen experts, best first.
    gates: [G, S, k] gates of those choices.
    experts: `ExpertWeights` with E experts; E must be divisible by the size of
      the expert axis. Split over `expert_axis` on their leading axis.
    capacity: C, slots per group and expert (None: S, i.e. nothing dropped).
    mesh: the device mesh (e.g. `trainkit.mesh.make_mesh`).
    algorithm: "sort" or "einsum" (same semantics, both run the sort-based
      capacity path); "dropless" raises `NotImplementedError`.
    expert_axis: mesh axis the experts are split over.
    batch_axes: mesh axes the group axis is split over; default all mesh axes in
      mesh order (("data", "expert") for `trainkit.mesh`). Must include
      `expert_axis`. G must be divisible by the product of their sizes.

  Returns:
    y: [G, S, D] in x.dtype, sharded like x.
    stats: `DispatchStats` (kept [G, S, k] and group_expert_fraction [G, E]
      sharded on the group axis).
  """
  if algorithm == "dropless":
    raise NotImplementedError(
        "dropless expert parallelism needs variable-size exchanges "
        "(jax.lax.ragged_all_to_all, GPU/TPU only); it is not available on CPU or in this "
        "version. Use algorithm='sort' with a capacity, or the single-device 'dropless' "
        "dispatch without a mesh."
    )
  if algorithm not in EP_ALGORITHMS:
    raise ValueError(
        f"algorithm={algorithm!r} has no expert-parallel implementation; "
        f"known: {', '.join(EP_ALGORITHMS)}"
    )
  _check_inputs(x, expert_index, gates)
  num_groups, group_size, _ = expert_index.shape
  num_experts = experts.num_experts
  if capacity is None:
    capacity = group_size
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  capacity = int(capacity)

  if expert_axis not in mesh.shape:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack the expert axis {expert_axis!r}")
  batch_axes = tuple(mesh.axis_names if batch_axes is None else batch_axes)
  unknown = [a for a in batch_axes if a not in mesh.shape]
  if unknown:
    raise ValueError(f"batch_axes {unknown} are not axes of the mesh {tuple(mesh.axis_names)}")
  if expert_axis not in batch_axes:
    raise ValueError(f"batch_axes {batch_axes} must include the expert axis {expert_axis!r}")
  num_expert_shards = mesh.shape[expert_axis]
  if num_experts % num_expert_shards:
    raise ValueError(
        f"num_experts={num_experts} is not divisible by the size {num_expert_shards} of the "
        f"mesh axis {expert_axis!r}"
    )
  num_batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
  if num_groups % num_batch_shards:
    raise ValueError(
        f"the number of groups (batch size) {num_groups} is not divisible by the "
        f"{num_batch_shards} devices of the mesh axes {batch_axes}"
    )

  batch_spec = P(batch_axes)
  expert_specs = ExpertWeights(
      w1=P(expert_axis, None, None),
      b1=P(expert_axis, None),
      w2=P(expert_axis, None, None),
      b2=P(expert_axis, None),
  )

  def body(x, expert_index, gates, experts):
    return _local_moe(
        x,
        expert_index,
        gates,
        experts,
        num_experts=num_experts,
        capacity=capacity,
        expert_axis=expert_axis,
    )

  y, kept, group_expert_fraction = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(batch_spec, batch_spec, batch_spec, expert_specs),
      out_specs=(batch_spec, batch_spec, batch_spec),
  )(x, expert_index, gates, experts)
  stats = DispatchStats(
      kept=kept,
      fraction_dropped=jnp.mean(~kept, dtype=jnp.float32),
      group_expert_fraction=group_expert_fraction,
  )
  return y, stats
