"""The accelerators a run can be compiled for without them: TPU slices and NVIDIA GPU nodes.

A target is hardware facts (devices, hosts, memory, peak FLOP/s, memory bandwidth) plus how
JAX describes its devices without the hardware (`jax.experimental.topologies`): libtpu for a
TPU slice, the CUDA plugin and a GPU description (`GpuTargetConfigProto`, in text form) for a
GPU node. `devices(target)` returns the target's devices on this machine, with the process
(host) index each has in a real multi-host run.

Peak FLOP/s are the dense bf16 matrix figures of the vendors' data sheets. A float32 run is
costed at the same peak: JAX's default matmul precision runs float32 matmuls as one bf16 pass
on a TPU, and as TF32 on an A100 or H100, whose TF32 peak is half the bf16 one; the step-time
estimate says which peak it used (`peak_flops_per_s`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from typing import Any

from trainkit.errors import UserError
from trainkit.throughput import PEAK_FLOPS_BY_KIND

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator configuration.

  Attributes:
    name: the name `--config.preflight.target` takes (e.g. `v5e-16`, `h100x8`).
    platform: "tpu" or "gpu".
    device_kind: what `jax.devices()[0].device_kind` says on the real hardware.
    num_devices: devices JAX sees (TPU chips with megacore, GPUs).
    num_hosts: processes of a real run (one per host).
    memory_bytes: memory per device (HBM).
    usable_fraction: the share of `memory_bytes` a JAX program may use (GPU: JAX preallocates
      XLA_PYTHON_CLIENT_MEM_FRACTION = 0.75 by default; TPU: the compiler checks the fit).
    peak_bf16_flops: dense bf16 FLOP/s per device.
    peak_tf32_flops: dense float32 matmul FLOP/s per device under JAX's default precision.
    memory_bandwidth: HBM bytes per second per device.
    topology: the TPU topology name (`v5e:4x4`) or the GPU layout (`1x<hosts>x<devices per
      host>`, slices x hosts x devices).
    chip_config: libtpu's chip configuration ("default", or "megacore" for v4 and v5p).
    chips_per_host_bounds: TPU chips per host as (x, y, z).
    wrap: TPU torus wraparound per axis.
    gpu_description: the GpuTargetConfigProto text of the GPU (gpu only).
  """

  name: str
  platform: str
  device_kind: str
  num_devices: int
  num_hosts: int
  memory_bytes: int
  usable_fraction: float
  peak_bf16_flops: float
  peak_tf32_flops: float
  memory_bandwidth: float
  topology: str
  chip_config: str = "default"
  chips_per_host_bounds: tuple[int, int, int] = (2, 2, 1)
  wrap: tuple[bool, bool, bool] = (False, False, False)
  gpu_description: str = ""

  @property
  def usable_bytes(self) -> int:
    return int(self.memory_bytes * self.usable_fraction)

  def peak_flops(self, compute_dtype: str) -> float:
    return self.peak_bf16_flops if compute_dtype == "bfloat16" else self.peak_tf32_flops

  def describe(self) -> str:
    return (
        f"{self.name}: {self.num_devices} x {self.device_kind} on {self.num_hosts} host(s), "
        f"{self.memory_bytes / GIB:.0f} GiB each"
    )


def _gpu_description(
    *,
    name: str,
    compute_capability: tuple[int, int],
    core_count: int,
    fpus_per_core: int,
    clock_ghz: float,
    memory_bytes: int,
    memory_bandwidth: float,
    l2_cache_bytes: int,
    shared_memory_per_core: int,
    shared_memory_per_block_optin: int,
) -> str:
  """A GpuTargetConfigProto in text form: the facts XLA's GPU compiler reads of a device."""
  major, minor = compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {core_count}
  fpus_per_core: {fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(memory_bandwidth)}
  l2_cache_size: {l2_cache_bytes}
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: {shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{name}"
"""


# H100 SXM5 80 GB and A100 SXM4 80 GB (NVIDIA data sheets; device memory as the driver reports it).
_H100 = dict(
    device_kind="NVIDIA H100 80GB HBM3",
    memory_bytes=84_942_979_072,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA H100"],
    peak_tf32_flops=494e12,
    memory_bandwidth=3.35e12,
)
_H100_DESCRIPTION = _gpu_description(
    name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    core_count=132,
    fpus_per_core=128,
    clock_ghz=1.98,
    memory_bytes=_H100["memory_bytes"],
    memory_bandwidth=_H100["memory_bandwidth"],
    l2_cache_bytes=50 * 1024**2,
    shared_memory_per_core=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
)
_A100 = dict(
    device_kind="NVIDIA A100-SXM4-80GB",
    memory_bytes=85_100_068_864,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA A100"],
    peak_tf32_flops=156e12,
    memory_bandwidth=2.039e12,
)
_A100_DESCRIPTION = _gpu_description(
    name="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0),
    core_count=108,
    fpus_per_core=64,
    clock_ghz=1.41,
    memory_bytes=_A100["memory_bytes"],
    memory_bandwidth=_A100["memory_bandwidth"],
    l2_cache_bytes=40 * 1024**2,
    shared_memory_per_core=164 * 1024,
    shared_memory_per_block_optin=163 * 1024,
)
# The share of a GPU's memory JAX takes by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_DEFAULT_MEMORY_FRACTION = 0.75


def _gpu(name: str, facts: dict[str, Any], description: str, hosts: int, per_host: int) -> Target:
  return Target(
      name=name,
      platform="gpu",
      num_devices=hosts * per_host,
      num_hosts=hosts,
      usable_fraction=GPU_DEFAULT_MEMORY_FRACTION,
      topology=f"1x{hosts}x{per_host}",
      gpu_description=description,
      **facts,
  )


# TPU chips (Google Cloud's system architecture pages): HBM, bf16 peak, HBM bandwidth.
# float32 matmuls run as bf16 passes on a TPU: one peak for both (the bf16 peaks are
# trainkit.throughput's, which MFU uses too).
_V4 = dict(device_kind="TPU v4", memory_bytes=32 * GIB, memory_bandwidth=1.2e12)
_V5E = dict(device_kind="TPU v5 lite", memory_bytes=16 * GIB, memory_bandwidth=8.19e11)
_V5P = dict(device_kind="TPU v5", memory_bytes=95 * GIB, memory_bandwidth=2.765e12)
for _chip in (_V4, _V5E, _V5P):
  _chip["peak_bf16_flops"] = _chip["peak_tf32_flops"] = PEAK_FLOPS_BY_KIND[_chip["device_kind"]]


def _tpu(name: str, facts: dict[str, Any], topology: str, chips: int, **kwargs: Any) -> Target:
  per_host = 4 if chips >= 4 else chips
  if name.startswith("v5e") and chips == 8:
    per_host = 8  # A v5e-8 is one host with 8 chips (2x4).
  bounds = kwargs.pop("chips_per_host_bounds", (2, 2, 1) if per_host == 4 else (2, 4, 1))
  return Target(
      name=name,
      platform="tpu",
      num_devices=chips,
      num_hosts=max(1, chips // per_host),
      usable_fraction=1.0,
      topology=topology,
      chips_per_host_bounds=bounds,
      **facts,
      **kwargs,
  )


# v4 and v5p names count TensorCores (two per chip, one device each with megacore); v5e names
# count chips.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _tpu("v4-8", _V4, "v4:2x2x1", 4, chip_config="megacore"),
        _tpu("v4-32", _V4, "v4:2x2x4", 16, chip_config="megacore"),
        _tpu("v4-64", _V4, "v4:2x4x4", 32, chip_config="megacore"),
        _tpu("v5e-8", _V5E, "v5e:2x4", 8),
        _tpu("v5e-16", _V5E, "v5e:4x4", 16),
        _tpu("v5e-64", _V5E, "v5e:8x8", 64),
        _tpu("v5e-256", _V5E, "v5e:16x16", 256),
        _tpu("v5p-8", _V5P, "v5p:2x2x1", 4, chip_config="megacore"),
        _tpu("v5p-32", _V5P, "v5p:2x2x4", 16, chip_config="megacore"),
        _gpu("h100x1", _H100, _H100_DESCRIPTION, hosts=1, per_host=1),
        _gpu("h100x8", _H100, _H100_DESCRIPTION, hosts=1, per_host=8),
        _gpu("h100x16", _H100, _H100_DESCRIPTION, hosts=2, per_host=8),
        _gpu("a100x8", _A100, _A100_DESCRIPTION, hosts=1, per_host=8),
    )
}


def get_target(name: str) -> Target:
  """The target called `name`; a KeyError listing the known names otherwise."""
  if name not in TARGETS:
    raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
  return TARGETS[name]


def target_table() -> str:
  """One line per target: its name, devices, hosts and memory (for --help and the docs)."""
  return "\n".join(t.describe() for t in TARGETS.values())


def _c_environment() -> dict[str, str]:
  """The process's environment as the C library holds it (os.environ is Python's copy)."""
  environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
  found = {}
  i = 0
  while environ[i] is not None:
    name, _, value = environ[i].decode(errors="replace").partition("=")
    found[name] = value
    i += 1
  return found


def _forget_variables_set_behind_pythons_back(before: dict[str, str]) -> None:
  """Unsets what libtpu wrote into the C environment when it described a slice.

  Loading libtpu outside a TPU VM sets TPU_WORKER_ID, CLOUD_TPU_TASK_ID and others to
  "WARNING: could not determine ..." with setenv, unseen by os.environ but inherited by every
  subprocess started later: a run started from this process would take itself for a Cloud TPU
  pod worker (trainkit/distributed.py) and fail to join one.
  """
  libc = ctypes.CDLL(None)
  for name in _c_environment():
    if name not in before and name not in os.environ:
      libc.unsetenv(name.encode())


@functools.cache
def devices(target: Target) -> tuple[Any, ...]:
  """The target's devices, described without the hardware (each with its host's process index).

  TPU: libtpu's topology of the slice. GPU: the CUDA plugin with the target's description.
  Raises a UserError saying what to install when the plugin is missing.
  """
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  environment = _c_environment()
  try:
    if target.platform == "tpu":
      # Two processes that load libtpu at once (tests in parallel) need this.
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      topology = topologies.get_topology_desc(
          topology_name=target.topology,
          platform="tpu",
          chip_config_name=target.chip_config,
          chips_per_host_bounds=target.chips_per_host_bounds,
          num_slices=1,
          wrap=target.wrap,
      )
    else:
      topology = topologies.get_topology_desc(
          platform="cuda", target_config=target.gpu_description, topology=target.topology
      )
  except Exception as e:  # pylint: disable=broad-except  # The plugin's own error types.
    extra = "libtpu" if target.platform == "tpu" else "the CUDA plugin (jax[cuda12-local])"
    raise UserError(
        f"cannot describe the devices of {target.name} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); the preflight needs {extra}: "
        'pip install -e ".[preflight]"'
    ) from e
  finally:
    _forget_variables_set_behind_pythons_back(environment)
  found = tuple(topology.devices)
  if len(found) != target.num_devices:
    raise RuntimeError(f"{target.name}: expected {target.num_devices} devices, got {len(found)}")
  return found
