"""Expert parallelism: capacity-limited MoE dispatch with `jax.shard_map` and all-to-all.

    y, stats = expert_parallel_moe(x, expert_index, gates, experts, capacity=C, mesh=mesh)

has the semantics of `moe_sort` / `moe_einsum` (groups =
examples, C slots per group and expert, all top-1 choices of a group before any
top-2 choice, earlier tokens first, dropped choices contribute 0) and returns the
same `DispatchStats`, but runs under `jax.shard_map` over the mesh:

* x, expert_index, gates ([G, S, ...]) are split on the group axis over all batch
  axes (by default every mesh axis, i.e. ("data", "expert") of `trainkit.mesh`),
  so each device holds G_l = G / num_devices groups;
* the stacked expert weights are split over the "expert" axis (P("expert", ...),
  as annotated by `SparseMoE`): each expert shard holds E_l = E / n_expert
  experts, replicated over the other axes.

Per device: the expert-major capacity buffers [E, G_l * C, D] of the local groups
are built with the sort construction of `moe_sort` (no [S, E, C] tensor); an
all-to-all over the expert axis sends the buffers of experts [j E_l, (j + 1) E_l)
to expert shard j, which thus receives [E_l, n_expert * G_l * C, D], the tokens of
its own experts from every shard of its expert axis, in the layout its expert
matmuls take; it applies its local experts, a second all-to-all returns the
outputs to the devices owning the groups, and they are combined with the gates
there. Routing never crosses devices: since a
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
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.sort import combine_slots, gather_slots, sort_slot_plan

__all__ = ["EP_ALGORITHMS", "expert_parallel_moe"]

# Algorithms with an expert-parallel implementation. "sort" and "einsum" share
# their semantics (and results), so both map to the capacity path below.
EP_ALGORITHMS = ("sort", "einsum")


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
  num_groups, group_size, dim = x.shape
  plan = sort_slot_plan(expert_index, num_experts=num_experts, capacity=capacity)
  buffers = gather_slots(x.reshape(num_groups * group_size, dim), plan)
  # [E, G_l C, D] -> [E_l, n_expert G_l C, D]: expert shard j gets the slots of its experts
  # [j E_l, (j + 1) E_l) from every shard of its expert axis, already expert-major.
  received = jax.lax.all_to_all(buffers, expert_axis, split_axis=0, concat_axis=1, tiled=True)
  outputs = experts.apply(received)
  # And back: [E_l, n_expert G_l C, D] -> [E, G_l C, D].
  outputs = jax.lax.all_to_all(outputs, expert_axis, split_axis=1, concat_axis=0, tiled=True)
  y = combine_slots(outputs, gates.reshape(num_groups * group_size, -1), plan)
  return y.reshape(x.shape), plan.stats.kept, plan.stats.group_expert_fraction


def _typed_by(mesh: Mesh) -> bool:
  """Whether arrays here carry their layout on `mesh` in their type: the mesh has Explicit
  axes and is the one set by `jax.set_mesh` (outside it, arrays are not typed by any mesh)."""
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return False
  context = jax.sharding.get_abstract_mesh()
  return not context.empty and context == mesh.abstract_mesh


def _auto(mesh: Mesh) -> Mesh:
  """The same devices and axis names, with every axis Auto."""
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _place(value: jax.Array, mesh: Mesh, spec: P, typed: bool) -> jax.Array:
  """`value` laid out as `spec` on `mesh`: moved if it is not already (eagerly or under jit).

  Where the layout is part of the array's type, shard_map requires it to match `in_specs`
  exactly, so the array is resharded; elsewhere a sharding constraint lets the compiler move
  it (a no-op for inputs already laid out so, as in the training kit).
  """
  sharding = NamedSharding(mesh, spec)
  if typed:
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


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
  check_inputs(x, expert_index, gates)
  num_groups, group_size, _ = expert_index.shape
  num_experts = experts.num_experts
  capacity = resolve_capacity(capacity, group_size)

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

  # A mesh with Explicit axes (`jax.make_mesh`'s default) types every array with its layout
  # inside `jax.set_mesh`; outside it the inputs carry no mesh, and the same devices are used
  # as Auto axes so that the outputs come back untyped, like the inputs.
  typed = _typed_by(mesh)
  if not typed:
    mesh = _auto(mesh)
  inputs = (x, expert_index, gates, experts)
  in_specs = (batch_spec, batch_spec, batch_spec, expert_specs)
  # Whatever the inputs' layout (unsharded, or sharded for another mesh axis), each device
  # gets its groups and its experts.
  placed = jax.tree.map(lambda v, spec: _place(v, mesh, spec, typed), inputs, in_specs)
  outputs = jax.shard_map(
      body, mesh=mesh, in_specs=in_specs, out_specs=(batch_spec, batch_spec, batch_spec)
  )(*placed)
  if typed:  # The caller's next operations expect the layout of the input.
    group_spec = P(*jax.typeof(x).sharding.spec[:1])
    outputs = tuple(jax.sharding.reshard(o, NamedSharding(mesh, group_spec)) for o in outputs)
  y, kept, group_expert_fraction = outputs
  return y, DispatchStats.from_kept(kept, group_expert_fraction)
