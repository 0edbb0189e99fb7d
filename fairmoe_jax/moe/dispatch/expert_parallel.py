"""Expert parallelism: capacity-limited MoE dispatch with `jax.shard_map` and all-to-all.

    y, stats = expert_parallel_moe(x, expert_index, gates, experts, capacity=C, mesh=mesh)

has `moe_sort`'s semantics and `DispatchStats`, run under `jax.shard_map`: the groups
(examples) [G, S, ...] are split over the batch axes (default every mesh axis), G_l per device;
the expert weights over the "expert" axis, E_l = E / n_expert per shard.

Per device, the local groups' expert-major buffers are built as the single-device dispatch
builds them: `moe_sort`'s row gathers [E, G_l * C, D], or `moe_einsum`'s one-hot einsum
[E, G_l, C, D] (GShard / V-MoE; no row gather: on a v5e-8 `sort`'s step accesses 1.74x its
bytes, docs/benchmarks.md). An all-to-all sends experts [j E_l, (j + 1) E_l) to expert shard
j, which applies its experts to [E_l, n_expert * G_l, ...], and a second all-to-all brings the
outputs back to be combined. A group lives on one device, so capacity decisions and stats are exactly
the single-device ones. Memory O(G_l E C D) per device; expert FLOPs split n_expert ways.

Dropless expert parallelism would need `jax.lax.ragged_all_to_all` (GPU/TPU only); not here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.einsum import moe_einsum
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.sort import combine_slots, gather_slots, sort_slot_plan
from fairmoe_jax.moe.dispatch.spmd import ExpertFeatures

__all__ = ["EP_ALGORITHMS", "expert_parallel_moe"]

# Algorithms with an expert-parallel implementation.
EP_ALGORITHMS = ("sort", "einsum")


def _exchange(buffers: jax.Array, experts: ExpertWeights, expert_axis: str) -> jax.Array:
  """The local experts applied to every expert shard's buffers for them: [E, G_l, ...] ->
  [E_l, n_expert G_l, ...] (expert shard j gets experts [j E_l, (j + 1) E_l) of every shard of
  its axis, already expert-major) -> the MLP -> back to [E, G_l, ...].
  """
  received = jax.lax.all_to_all(buffers, expert_axis, split_axis=0, concat_axis=1, tiled=True)
  outputs = experts.apply_expert_major(received)
  return jax.lax.all_to_all(outputs, expert_axis, split_axis=1, concat_axis=0, tiled=True)


def _local_moe(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    algorithm: str,
    num_experts: int,
    capacity: int,
    expert_axis: str,
    expert_features: ExpertFeatures | None = None,
) -> tuple[jax.Array, ...]:
  """Per-device body: local groups [G_l, S, ...], local experts [E_l, ...]."""
  exchange = functools.partial(_exchange, expert_axis=expert_axis)
  if algorithm == "einsum":
    y, stats = moe_einsum(
        x,
        expert_index,
        gates,
        experts,
        capacity=capacity,
        expert_mlp=exchange,
        num_experts=num_experts,
    )
  else:
    num_groups, group_size, dim = x.shape
    plan = sort_slot_plan(expert_index, num_experts=num_experts, capacity=capacity)
    outputs = exchange(gather_slots(x.reshape(num_groups * group_size, dim), plan), experts)
    y = combine_slots(outputs, gates.reshape(num_groups * group_size, -1), plan)
    y, stats = y.reshape(x.shape), plan.stats
  results = (y, stats.kept, stats.group_expert_fraction)
  if expert_features is not None:
    results += (_features_of_every_expert(x, experts, expert_features, expert_axis),)
  return results


def _features_of_every_expert(
    x: jax.Array, experts: ExpertWeights, expert_features: ExpertFeatures, expert_axis: str
) -> jax.Array:
  """[G_l, E, ...] features of the local groups from every expert: the expert axis' groups are
  gathered (in float32, so the gradients' reduce-scatter sums in float32), each shard computes
  its E_l experts' features, and an all-to-all returns them: tokens travel, not weights.
  """
  gathered = jax.lax.all_gather(x.astype(jnp.float32), expert_axis, axis=0, tiled=True)
  local = expert_features(gathered.astype(x.dtype), experts)  # [n_expert G_l, E_l, ...]
  return jax.lax.all_to_all(local, expert_axis, split_axis=0, concat_axis=1, tiled=True)


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
    expert_features: ExpertFeatures | None = None,
) -> tuple[jax.Array, DispatchStats] | tuple[jax.Array, DispatchStats, jax.Array]:
  """Capacity-limited expert-parallel MoE; the same results as `moe_sort`.

  Arguments and results as `data_parallel_moe`'s, except: `experts` are split on their leading
  axis over `expert_axis` (E divisible by its size); `algorithm` is "sort" or "einsum" (the same
  results; "einsum" builds its buffers by one-hot einsums, no row gathers; "dropless" raises);
  `batch_axes` include `expert_axis`.
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
  check_inputs(x, expert_index, gates)
  num_groups, group_size, _ = expert_index.shape
  num_experts = experts.num_experts
  capacity = resolve_capacity(capacity, group_size)

  if expert_axis not in mesh.shape:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack the expert axis {expert_axis!r}")
  batch_axes = spmd.batch_axes_of(mesh, batch_axes)
  if expert_axis not in batch_axes:
    raise ValueError(f"batch_axes {batch_axes} must include the expert axis {expert_axis!r}")
  num_expert_shards = mesh.shape[expert_axis]
  if num_experts % num_expert_shards:
    raise ValueError(
        f"num_experts={num_experts} is not divisible by the size {num_expert_shards} of the "
        f"mesh axis {expert_axis!r}"
    )
  spmd.check_groups(num_groups, mesh, batch_axes)

  expert_specs = ExpertWeights(
      w1=P(expert_axis, None, None),
      b1=P(expert_axis, None),
      w2=P(expert_axis, None, None),
      b2=P(expert_axis, None),
  )

  # The expert weights are split over the expert axis and replicated over the other batch axes
  # ("data"): their gradients are summed over those, once, in float32 (`spmd.vary_over`).
  replica_axes = tuple(a for a in batch_axes if a != expert_axis)

  def body(x, expert_index, gates, experts):
    return _local_moe(
        x,
        expert_index,
        gates,
        spmd.vary_over(experts, replica_axes),
        algorithm=algorithm,
        num_experts=num_experts,
        capacity=capacity,
        expert_axis=expert_axis,
        expert_features=expert_features,
    )

  inputs = (x, expert_index, gates, experts)
  return spmd.run_dispatch(
      body, mesh, inputs, expert_specs, batch_axes, with_features=expert_features is not None
  )
