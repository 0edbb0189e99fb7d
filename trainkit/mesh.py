"""Device mesh with axes `data` and `expert`, and the shardings of batches and parameters.

The batch is split over both axes (expert parallelism is also data parallelism for the rest of
the network); parameters are replicated unless annotated with mesh axes (`("expert", ...)`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainkit.errors import ConfigError

MESH_AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, int]:
  """Resolves `{data, expert}` sizes, where one size may be -1 ("all remaining devices")."""
  sizes = {axis: mesh_config.get(axis, 1) for axis in MESH_AXES}
  for axis, size in sizes.items():
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
      raise ConfigError(f"mesh.{axis}", f"must be a positive integer or -1, got {size!r}")
  unknown = [axis for axis, size in sizes.items() if size == -1]
  if len(unknown) > 1:
    raise ConfigError("mesh", "at most one of mesh.data and mesh.expert may be -1")
  for axis, size in sizes.items():
    if size > num_devices:  # Name the key that asks too much, not the -1 that cannot fill.
      raise ConfigError(
          f"mesh.{axis}", f"{size} needs {size} devices but only {num_devices} are available"
      )
  known = math.prod(size for size in sizes.values() if size != -1)
  if unknown:
    if num_devices % known:
      # Name the key set to a number (-1 is mesh.data's default, rarely the user's choice).
      (axis,) = [axis for axis in MESH_AXES if axis not in unknown]
      raise ConfigError(
          f"mesh.{axis}",
          f"{known} does not divide the {num_devices} devices, so mesh.{unknown[0]}=-1 cannot "
          f"fill the rest; use one of {', '.join(map(str, _divisors(num_devices)))}",
      )
    sizes[unknown[0]] = num_devices // known
  total = math.prod(sizes.values())
  if total > num_devices:
    raise ConfigError(
        "mesh",
        f"mesh data={sizes['data']} x expert={sizes['expert']} needs {total} "
        f"devices but only {num_devices} are available",
    )
  return sizes["data"], sizes["expert"]


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def idle_devices_message(mesh_config: Mapping[str, int], num_devices: int, where: str) -> str:
  """The error for a mesh that leaves some of `num_devices` (named by `where`) idle, or ""."""
  data, expert = mesh_shape(mesh_config, num_devices)
  used = data * expert
  if used == num_devices:
    return ""
  if num_devices % expert == 0:
    fix = f"set mesh.data=-1, which fills them (data={num_devices // expert} x expert={expert})"
  else:
    divisors = ", ".join(map(str, _divisors(num_devices)))
    fix = f"set mesh.data=-1 and mesh.expert to one of {divisors}"
  return (
      f"mesh.data={data} x mesh.expert={expert} uses {used} of {where}, leaving "
      f"{num_devices - used} idle; {fix}"
  )


def require_all_devices(
    mesh_config: Mapping[str, int], num_devices: int, where: str
) -> tuple[int, int]:
  """`mesh_shape`, with a ConfigError naming `mesh.data` or `mesh.expert` for a mesh over fewer
  than `num_devices` (a preflight's target, or every process's devices, which each get a block)."""
  message = idle_devices_message(mesh_config, num_devices, where)
  data, expert = mesh_shape(mesh_config, num_devices)
  if message:
    raise ConfigError("mesh.data" if num_devices % expert == 0 else "mesh.expert", message)
  return data, expert


def make_mesh(mesh_config: Mapping[str, int], devices: list[Any] | None = None) -> Mesh:
  """The (data, expert) mesh over the first of `devices` (default: the run's). Idle devices of
  the run's own are refused over several processes, a warning in one (a reference run may)."""
  run_devices = devices is None
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  if run_devices and math.prod(shape) < len(devices):
    where = f"the {len(devices)} devices of this run"
    if jax.process_count() > 1:
      require_all_devices(mesh_config, len(devices), f"{where} ({jax.process_count()} processes)")
    logging.warning("%s", idle_devices_message(mesh_config, len(devices), where))
  device_grid = np.asarray(devices[: math.prod(shape)]).reshape(shape)
  return Mesh(device_grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over all mesh axes."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def place(tree: Any, shardings: Any) -> Any:
  """Puts host values identical on every process onto `shardings` (one, or a matching tree);
  each fills its own shards (`jax.device_put` would compare values across processes)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def put(x: Any, sharding: jax.sharding.Sharding) -> Any:
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=impl)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree.map(put, tree, shardings)


def process_block(tree: Any) -> Any:
  """Rows [i * B/n, (i + 1) * B/n) of a global batch for process i of n: what `shard_batch`
  expects."""
  count, index = jax.process_count(), jax.process_index()

  def block(x: Any) -> Any:
    if len(x) % count:
      raise ValueError(f"a batch of {len(x)} rows cannot be split over {count} processes")
    size = len(x) // count
    return x[index * size : (index + 1) * size]

  return jax.tree.map(block, tree)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of `x` as numpy on every process (a collective when `x` spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles the global batch from this process's local part (multi-host safe)."""
  sharding = batch_sharding(mesh)
  return {
      k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
  }
