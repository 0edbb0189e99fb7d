"""Data parallelism for any dispatch: each device dispatches its own groups to its own copy of
the experts, under `jax.shard_map`.

    y, stats = data_parallel_moe(moe_sort, x, expert_index, gates, experts, capacity=C,
                                 mesh=mesh)

has exactly the semantics and results of `algorithm(x, expert_index, gates, experts,
capacity=C)` (a group is one example and capacity is per group, so no routing decision depends
on another device's groups), but per device it builds the capacity buffers (or sorted rows) of
its G / n local groups only and runs the expert matmuls on them: [E, (G / n) C, D] for the
capacity algorithms, its own tokens' rows for `dropless` and `blocksparse`, its own examples for
`dense`. Left to the SPMD partitioner, the data-dependent gathers and sorts of a dispatch over
the flattened batch are not split, and every device computes the whole batch's experts
(docs/design.md, "The MoE layer on a device mesh").

The experts are replicated over the batch axes. They are marked varying over those axes at the
top of the body (`spmd.vary_over`), so the backward pass all-reduces each expert weight's float32
gradient once, parameter-shaped, and nothing token-shaped or bfloat16 crosses devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.base import DispatchAlgorithm, check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.spmd import ExpertFeatures

__all__ = ["data_parallel_moe", "per_device"]


def data_parallel_moe(
    algorithm: DispatchAlgorithm,
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None,
    mesh: Mesh,
    batch_axes: Sequence[str] | None = None,
    expert_features: ExpertFeatures | None = None,
) -> tuple[jax.Array, DispatchStats] | tuple[jax.Array, DispatchStats, jax.Array]:
  """`algorithm` run on every device's own groups; the same results as `algorithm` alone.

  Args:
    algorithm: a dispatch algorithm (`DISPATCH_ALGORITHMS[name]`).
    x: [G, S, D] tokens (G groups = examples).
    expert_index: [G, S, k] chosen experts, best first.
    gates: [G, S, k] gates of those choices.
    experts: `ExpertWeights`, replicated on every device.
    capacity: C, slots per group and expert, as `algorithm` takes it.
    mesh: the device mesh (e.g. `trainkit.mesh.make_mesh`).
    batch_axes: mesh axes the group axis is split over; default every mesh axis. G must be
      divisible by the product of their sizes.
    expert_features: `features(x, experts) -> [G, E, ...]`, per group and expert (a router's
      `expert_features`, e.g. FairSMoE's competence pass); computed on each device's groups
      with the same copy of the experts as the dispatch, so the weights' gradients of both
      are summed over devices in one all-reduce.

  Returns:
    y: [G, S, D] in x.dtype, laid out like x.
    stats: `DispatchStats` (kept [G, S, k] and group_expert_fraction [G, E] laid out on the
      group axis; fraction_dropped over the whole batch).
    features: with `expert_features`, its [G, E, ...] result, laid out on the group axis.
  """
  check_inputs(x, expert_index, gates)
  batch_axes = spmd.batch_axes_of(mesh, batch_axes)
  spmd.check_groups(x.shape[0], mesh, batch_axes)

  def body(x, expert_index, gates, experts):
    experts = spmd.vary_over(experts, batch_axes)
    y, stats = algorithm(x, expert_index, gates, experts, capacity=capacity)
    outputs = (y, stats.kept, stats.group_expert_fraction)
    if expert_features is not None:
      outputs += (expert_features(x, experts),)
    return outputs

  replicated = jax.tree.map(lambda _: P(), experts)
  inputs = (x, expert_index, gates, experts)
  return spmd.run_dispatch(
      body, mesh, inputs, replicated, batch_axes, with_features=expert_features is not None
  )


def per_device(
    fn: Callable[..., Any],
    batched: tuple[jax.Array, ...],
    experts: ExpertWeights,
    *,
    mesh: Mesh,
    batch_axes: Sequence[str] | None = None,
) -> Any:
  """`fn(*batched, experts)` on each device's groups (the leading axis of every `batched`
  array), with the replicated experts marked varying so their gradients are summed over devices
  once, in float32; its outputs (a pytree of [G, ...] arrays) laid out on the group axis.

  For a computation that treats every group apart, as `data_parallel_moe` runs a dispatch
  (e.g. expert choice's gather, experts and scatter, `routers.expert_choice.apply_expert_picks`).
  """
  batch_axes = spmd.batch_axes_of(mesh, batch_axes)
  spmd.check_groups(batched[0].shape[0], mesh, batch_axes)
  batch_spec = P(batch_axes)
  out_shape = jax.eval_shape(fn, *batched, experts)

  def body(*args):
    *local, local_experts = args
    return fn(*local, spmd.vary_over(local_experts, batch_axes))

  return spmd.run_sharded(
      body,
      mesh,
      (*batched, experts),
      (*(batch_spec for _ in batched), jax.tree.map(lambda _: P(), experts)),
      jax.tree.map(lambda _: batch_spec, out_shape),
      group_like=batched[0],
  )
