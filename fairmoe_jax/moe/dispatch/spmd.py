"""What the sharded dispatches (`data_parallel`, `expert_parallel`) share: a per-device body
under `jax.shard_map` on the caller's mesh, and the expert weights' gradient reduction.

Why `shard_map`: a dispatch routes by data-dependent gathers, sorts or one-hots over the flat
batch, which the SPMD partitioner cannot split; left to it, every device would run every expert
on the whole global batch (docs/design.md, "The MoE layer on a device mesh").

Why `vary_over`: under `shard_map(check_vma=True)` JAX inserts the `pvary` of a replicated
weight where it first meets the varying tokens, after the cast to the compute dtype or a
broadcast, so its transpose (an all-reduce) would run on a bfloat16 or token-shaped tensor.
Marking the float32 weights varying first puts the one all-reduce on their float32 gradients.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe.dispatch.capacity import DispatchStats

# `features(x [G, S, D], experts) -> [G, E, ...]` (`RouterOutput.expert_features`).
ExpertFeatures = Callable[[jax.Array, Any], jax.Array]


def typed_by(mesh: Mesh) -> bool:
  """Whether arrays carry their layout on `mesh` in their type (Explicit, `jax.set_mesh`)."""
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return False
  context = jax.sharding.get_abstract_mesh()
  return not context.empty and context == mesh.abstract_mesh


def auto(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
  """The same devices and axis names, with every axis Auto."""
  if all(t == AxisType.Auto for t in mesh.axis_types):  # Also the context's AbstractMesh.
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def place(value: jax.Array, mesh: Mesh, spec: P, typed: bool) -> jax.Array:
  """`value` laid out as `spec` on `mesh`: resharded where layouts are typed (shard_map then
  requires an exact match), else a sharding constraint.
  """
  sharding = NamedSharding(mesh, spec)
  if typed:
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


def vary_over(tree: Any, axes: Sequence[str]) -> Any:
  """`tree`'s arrays marked varying over `axes`; the transpose is one psum per leaf, in its own
  dtype and shape, so call it on the float32 weights before any cast or broadcast.
  """
  if not axes:
    return tree

  def vary(leaf: jax.Array) -> jax.Array:
    missing = tuple(a for a in axes if a not in varying_axes(leaf))
    return leaf if not missing else jax.lax.pcast(leaf, missing, to="varying")

  return jax.tree.map(vary, tree)


def varying_axes(value: jax.Array) -> frozenset[str]:
  """The mesh axes `value` varies over inside `shard_map` (empty outside it)."""
  return frozenset(jax.typeof(value).manual_axis_type.varying)


def vma_check_off() -> Any:
  """A context without shard_map's varying-axes check, or None where this jax has no switch."""
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover
    return None
  state = getattr(jax_config, "_check_vma", None)
  return state(False) if state is not None else None


def kernels_can_run(
    *values: jax.Array, dispatch: str = "a Pallas kernel", report: bool = True
) -> bool:
  """Whether a Pallas kernel can run on `values`: outside shard_map, or where `run_kernel` can
  (else the fall-back is reported, for `dispatch`, unless the caller reports its own)."""
  if not any(varying_axes(v) for v in values) or vma_check_off() is not None:
    return True
  if report:
    report_fallback(dispatch, f"XLA's MLP: jax {jax.__version__} lacks jax._src.config._check_vma")
  return False


# "<dispatch> on <platform>: <what runs instead, and its cost>", once per process: what
# `fairmoe_jax.train` adds to run_info.json ("fallbacks").
FALLBACKS: list[str] = []


def report_fallback(dispatch: str, cost: str) -> None:
  """Says once, in one line, that `dispatch` runs something other than its name promises on
  this process' platform, and at what cost."""
  line = f"{dispatch} on {jax.default_backend()}: {cost}"
  if line not in FALLBACKS:
    FALLBACKS.append(line)
    logging.warning("fall-back: %s", line)


def run_kernel(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *, fallback: str
) -> Any:
  """`fn(*args, **kwargs)`, a Pallas kernel, also inside `jax.shard_map(check_vma=True)`.

  `pallas_call`'s outputs lack the mesh axes they vary over, which the check rejects; a kernel is
  per device, so it is traced without the check and its outputs cast to vary as its inputs do.
  Call it inside a custom VJP only (`typed_like` types the cotangents). `fallback` is the advice
  where this jax has no switch for the check.
  """
  axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))
  check_off = vma_check_off()
  if check_off is None:  # Outside shard_map no check applies.
    if axes:
      raise NotImplementedError(
          f"a Pallas kernel inside shard_map needs jax's check_vma switch, which jax "
          f"{jax.__version__} lacks; {fallback}"
      )
    return fn(*args, **kwargs)
  with check_off:  # Also for inputs that vary over no axis inside shard_map (all replicated).
    out = fn(*args, **kwargs)
  return vary_over(out, tuple(sorted(axes)))


def typed_like(cotangent: Any, primal: Any) -> Any:
  """Cotangents typed as their primals inside shard_map: summed over the axes a primal does not
  vary over, cast to vary where it does.
  """

  def like(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
    if extra:
      cotangent = jax.lax.psum(cotangent, extra)
    return vary_over(cotangent, tuple(sorted(varying_axes(primal))))

  return jax.tree.map(like, cotangent, primal)


def batch_axes_of(mesh: Mesh, batch_axes: Sequence[str] | None) -> tuple[str, ...]:
  """The mesh axes the group axis is split over: `batch_axes`, default every mesh axis."""
  axes = tuple(mesh.axis_names if batch_axes is None else batch_axes)
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(f"batch_axes {unknown} are not axes of the mesh {tuple(mesh.axis_names)}")
  return axes


def check_groups(num_groups: int, mesh: Mesh, batch_axes: Sequence[str]) -> None:
  """Raises ValueError unless the groups split evenly over `batch_axes`."""
  shards = math.prod(mesh.shape[a] for a in batch_axes)
  if num_groups % shards:
    raise ValueError(
        f"the number of groups (batch size) {num_groups} is not divisible by the "
        f"{shards} devices of the mesh axes {tuple(batch_axes)}"
    )


def run_sharded(
    body: Callable[..., Any],
    mesh: Mesh,
    inputs: tuple[Any, ...],
    in_specs: tuple[Any, ...],
    out_specs: Any,
    group_like: jax.Array,
) -> Any:
  """`jax.shard_map(body)(*inputs)` on `mesh`, whatever the inputs' layout and axis types.

  Outside `jax.set_mesh` an Explicit mesh is used as Auto, so outputs come back untyped like the
  inputs; where typed, outputs are laid out on their group axis like `group_like`.
  """
  typed = typed_by(mesh)
  if not typed:
    mesh = auto(mesh)
  placed = jax.tree.map(lambda v, spec: place(v, mesh, spec, typed), inputs, in_specs)
  outputs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*placed)
  if typed:  # The caller's next operations expect the layout of the input.
    group_spec = P(*jax.typeof(group_like).sharding.spec[:1])
    outputs = jax.tree.map(
        lambda o: jax.sharding.reshard(o, NamedSharding(mesh, group_spec)), outputs
    )
  return outputs


def run_dispatch(
    body: Callable[..., tuple[jax.Array, ...]],
    mesh: Mesh,
    inputs: tuple[jax.Array, jax.Array, jax.Array, Any],
    expert_specs: Any,
    batch_axes: Sequence[str],
    with_features: bool,
) -> tuple[Any, ...]:
  """`body(x, expert_index, gates, experts) -> (y, kept, group_expert_fraction[, features])`
  per device, groups over `batch_axes`, experts as `expert_specs`; returns
  (y, `DispatchStats`[, features]).
  """
  batch_spec = P(tuple(batch_axes))
  outputs = run_sharded(
      body,
      mesh,
      inputs,
      (batch_spec, batch_spec, batch_spec, expert_specs),
      (batch_spec,) * (4 if with_features else 3),
      group_like=inputs[0],
  )
  y, kept, group_expert_fraction = outputs[:3]
  return (y, DispatchStats.from_kept(kept, group_expert_fraction), *outputs[3:])
