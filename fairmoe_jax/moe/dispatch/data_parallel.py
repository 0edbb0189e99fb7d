"""Data parallelism for any dispatch: each device dispatches its own groups to its own copy of
the experts, under `jax.shard_map` (`spmd` says why).

    y, stats = data_parallel_moe(moe_sort, x, expert_index, gates, experts, capacity=C,
                                 mesh=mesh)

gives exactly `algorithm`'s results (capacity is per group, a group is one example), with each
device building only its G / n groups' buffers. The replicated experts are marked varying at
the top of the body (`spmd.vary_over`): one float32 all-reduce per weight gradient.
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

  Arguments and results as the dispatch interface's (`dispatch.base`), `experts` replicated on
  every device. `batch_axes`: the mesh axes the groups are split over (default every axis).
  `expert_features`: a router's `features(x, experts) -> [G, E, ...]`, computed per device with
  the dispatch's copy of the experts (one all-reduce for both gradients) and returned third.
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
  """`fn(*batched, experts)` on each device's groups (the leading axis), the replicated experts
  marked varying (one float32 gradient sum); outputs [G, ...] laid out on the group axis. For
  computations that treat groups apart (e.g. `routers.expert_choice.apply_expert_picks`).
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
