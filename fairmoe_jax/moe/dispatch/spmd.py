"""What the sharded dispatches (`data_parallel`, `expert_parallel`) share: running a per-device
body under `jax.shard_map` on the caller's mesh, and the expert weights' gradient reduction.

Why a `shard_map` at all: a dispatch routes by data-dependent gathers, sorts or one-hot tensors
over the flattened tokens of the batch, which the SPMD partitioner cannot split over the batch
axes; left to it, every device builds the capacity buffers of the whole global batch and runs
every expert on them (docs/design.md, "The MoE layer on a device mesh"). Inside `shard_map` the
body sees only its device's groups, so the work is each device's share by construction.

Why `vary_over`: under `shard_map(check_vma=True)` a weight replicated over a batch axis is
*invariant* there, and JAX inserts the `pvary` that makes it meet the varying tokens where the
two first meet. That is after the cast to the compute dtype, or after a bias is broadcast to
the tokens' shape, so the transpose of that `pvary`, an all-reduce over the batch axis, ran on
a bfloat16 (or token-shaped) tensor. Marking the float32 weights varying at the top of the
body puts the one all-reduce on the float32, parameter-shaped gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe.dispatch.capacity import DispatchStats

# `features(x [G, S, D], experts) -> [G, E, ...]`: something every expert computes of every
# group, each (group, expert) entry depending on that group and that expert's weights only
# (`RouterOutput.expert_features`); run inside the sharded region, beside the dispatch.
ExpertFeatures = Callable[[jax.Array, Any], jax.Array]


def typed_by(mesh: Mesh) -> bool:
  """Whether arrays here carry their layout on `mesh` in their type: the mesh has Explicit
  axes and is the one set by `jax.set_mesh` (outside it, arrays are not typed by any mesh)."""
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return False
  context = jax.sharding.get_abstract_mesh()
  return not context.empty and context == mesh.abstract_mesh


def auto(mesh: Mesh) -> Mesh:
  """The same devices and axis names, with every axis Auto."""
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def place(value: jax.Array, mesh: Mesh, spec: P, typed: bool) -> jax.Array:
  """`value` laid out as `spec` on `mesh`: moved if it is not already (eagerly or under jit).

  Where the layout is part of the array's type, shard_map requires it to match `in_specs`
  exactly, so the array is resharded; elsewhere a sharding constraint lets the compiler move
  it (a no-op for inputs already laid out so, as in the training kit).
  """
  sharding = NamedSharding(mesh, spec)
  if typed:
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


def vary_over(tree: Any, axes: Sequence[str]) -> Any:
  """`tree`'s arrays marked varying over `axes` (those they are not varying over already).

  Its transpose is one all-reduce (psum) over `axes` of each leaf's gradient, in the leaf's own
  dtype and shape: call it on the float32 weights before anything is cast or broadcast.
  """
  if not axes:
    return tree

  def vary(leaf: jax.Array) -> jax.Array:
    missing = tuple(a for a in axes if a not in varying_axes(leaf))
    if not missing:
      return leaf
    if hasattr(jax.lax, "pcast"):  # jax >= 0.8; pvary is its older name.
      return jax.lax.pcast(leaf, missing, to="varying")
    return jax.lax.pvary(leaf, missing)  # pragma: no cover

  return jax.tree.map(vary, tree)


def varying_axes(value: jax.Array) -> frozenset[str]:
  """The mesh axes `value` varies over inside `shard_map` (empty outside it)."""
  aval = jax.typeof(value)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def vma_check_off() -> Any:
  """A context without shard_map's varying-axes check, or None where this jax has no switch."""
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover
    return None
  state = getattr(jax_config, "_check_vma", None)
  return state(False) if state is not None else None


def kernels_can_run(*values: jax.Array) -> bool:
  """Whether a Pallas kernel can run on `values`: outside shard_map, or where `run_kernel` can
  type its outputs."""
  return not any(varying_axes(v) for v in values) or vma_check_off() is not None


def run_kernel(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *, fallback: str
) -> Any:
  """`fn(*args, **kwargs)`, a Pallas kernel, also inside `jax.shard_map(check_vma=True)`.

  `pallas_call` gives its outputs shapes without the mesh axes they vary over, which
  shard_map's check rejects. A kernel is per device, so its outputs vary over the axes its
  inputs vary over: it is traced without the check and typed so (`pcast`). Call it inside a
  custom VJP only, which never differentiates through that cast; `typed_like` types the
  cotangents. `fallback` says what to use instead where this jax has no switch for the check.
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
  """Cotangents typed as their primals inside shard_map (trees of the same structure): summed
  over the axes a primal does not vary over (a replicated input's gradient is the sum of every
  device's), cast to vary where the primal does."""

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
  """`jax.shard_map(body)(*inputs)` on `mesh`, whatever the inputs' layout and the mesh's axis
  types; outputs laid out on their group axis like `group_like` where arrays are typed.

  A mesh with Explicit axes (`jax.make_mesh`'s default) types every array with its layout
  inside `jax.set_mesh`; outside it the inputs carry no mesh, and the same devices are used as
  Auto axes so that the outputs come back untyped, like the inputs.
  """
  typed = typed_by(mesh)
  if not typed:
    mesh = auto(mesh)
  # Whatever the inputs' layout (unsharded, or sharded for another mesh axis), each device
  # gets its groups and its experts.
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
  """A sharded dispatch: `body(x, expert_index, gates, experts)` returning (y, kept,
  group_expert_fraction[, features]) per device, run on `mesh` with the groups split over
  `batch_axes` and the experts laid out as `expert_specs`; (y, `DispatchStats`[, features])."""
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
