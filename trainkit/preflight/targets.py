"""The accelerators a run can be compiled for without them: TPU slices and NVIDIA GPU nodes.

A target is hardware facts plus how `jax.experimental.topologies` describes its devices without
the hardware (libtpu for a TPU slice; the CUDA plugin and a `GpuTargetConfigProto` for a GPU).
Peaks are the data sheets' dense bf16 figures; float32 is costed at JAX's default matmul
precision (one bf16 pass on a TPU, TF32 on a GPU).

GPU memory: the fit and the compiler's limit are one number, `Target.usable_bytes`
(XLA_PYTHON_CLIENT_MEM_FRACTION of the device). Without a client, XLA's GPU compiler takes 80%
of the description's `device_memory_size` as the base of its rematerialisation limit
(`GetSchedulerMemoryLimit`), so the description carries usable / 0.8 and the preflight's
compile aims at the limit a real run's compile applies (tests/trainkit/test_preflight.py checks the base
limit XLA logs is `usable_bytes` exactly).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import itertools
import os
from typing import Any

from trainkit.errors import UserError
from trainkit.preflight import compilers
from trainkit.throughput import PEAK_FLOPS_BY_KIND

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator configuration; memory in bytes and FLOP/s per device.

  `topology` is libtpu's name (`v5e:4x4`) or the GPU layout `1x<hosts>x<devices per host>`.
  `interconnect_bandwidth` is bytes/s one device sends into a collective within its host (GPU:
  NVLink) or slice (TPU: ICI), one direction; `inter_host_bandwidth` the same across hosts.
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
  # A GPU's chip facts for its XLA description (`gpu_description`).
  gpu_chip: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
  interconnect: str = ""
  interconnect_bandwidth: float = 0.0
  inter_host_bandwidth: float = 0.0

  @property
  def usable_bytes(self) -> int:
    return int(self.memory_bytes * self.usable_fraction)

  def peak_flops(self, compute_dtype: str) -> float:
    return self.peak_bf16_flops if compute_dtype == "bfloat16" else self.peak_tf32_flops

  @property
  def gpu_description(self) -> str:
    """A GpuTargetConfigProto in text form, its memory as `described_memory_bytes` gives it."""
    chip = self.gpu_chip
    major, minor = chip["compute_capability"]
    described = described_memory_bytes(self.usable_bytes)
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip["shared_memory_per_core"]}
  threads_per_core_limit: 2048
  core_count: {chip["core_count"]}
  fpus_per_core: {chip["fpus_per_core"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {chip["l2_cache_bytes"]}
  clock_rate_ghz: {chip["clock_ghz"]}
  device_memory_size: {described}
  shared_memory_per_block_optin: {chip["shared_memory_per_block_optin"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{self.device_kind}"
"""

  def describe(self) -> str:
    return (
        f"{self.name}: {self.num_devices} x {self.device_kind} on {self.num_hosts} host(s), "
        f"{self.memory_bytes / GIB:.0f} GiB each"
    )


GPU_DEFAULT_MEMORY_FRACTION = 0.75
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# XLA's base limit without a client, in percent of the described memory (module docstring).
_XLA_DEFAULT_BASE_PERCENT = 80


@functools.cache
def gpu_memory_fraction() -> float:
  """XLA_PYTHON_CLIENT_MEM_FRACTION as JAX reads it; a UserError when not in (0, 1]."""
  text = os.environ.get(MEMORY_FRACTION_VARIABLE, "").strip()
  if not text:
    return GPU_DEFAULT_MEMORY_FRACTION
  try:
    fraction = float(text)
  except ValueError:
    fraction = float("nan")
  if not 0.0 < fraction <= 1.0:  # NaN fails too.
    raise UserError(
        f"{MEMORY_FRACTION_VARIABLE}={text!r}: the share of each GPU's memory JAX takes must be a "
        f"number in (0, 1] (JAX's default is {GPU_DEFAULT_MEMORY_FRACTION}); unset it or fix it"
    )
  return fraction


def described_memory_bytes(usable_bytes: int) -> int:
  """ceil(usable / 0.8): the `device_memory_size` whose 80% is `usable_bytes` exactly."""
  return -(-usable_bytes * 100 // _XLA_DEFAULT_BASE_PERCENT)


# NVIDIA data sheets (NVLink figures there count both directions); between nodes, one DGX NIC per
# GPU.
_H100 = dict(
    device_kind="NVIDIA H100 80GB HBM3",
    memory_bytes=84_942_979_072,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA H100"],
    peak_tf32_flops=494e12,
    memory_bandwidth=3.35e12,
    interconnect="NVLink 4 via NVSwitch (450 GB/s per GPU each way); 400 Gb/s InfiniBand NDR per GPU between nodes",
    interconnect_bandwidth=450e9,
    inter_host_bandwidth=50e9,
)
_HOPPER_SXM = dict(
    compute_capability=(9, 0),
    core_count=132,
    fpus_per_core=128,
    clock_ghz=1.98,
    l2_cache_bytes=50 * 1024**2,
    shared_memory_per_core=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
)
# H200: the H100's die and links with 141 GB of HBM3e. Memory as CUDA reports it (nvidia-smi's
# 143,771 MiB less the driver's reserve): JAX's bytes_limit at the default fraction was
# 112,583,507,968 on both lent H200s (benchmarks/results/h200_2026-11-2*/device.json; a test checks).
_H200 = dict(
    _H100,
    device_kind="NVIDIA H200",
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA H200"],
    memory_bytes=150_111_343_958,
    memory_bandwidth=4.8e12,
)
_A100 = dict(
    device_kind="NVIDIA A100-SXM4-80GB",
    memory_bytes=85_100_068_864,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA A100"],
    peak_tf32_flops=156e12,
    memory_bandwidth=2.039e12,
    interconnect="NVLink 3 via NVSwitch (300 GB/s per GPU each way); 200 Gb/s InfiniBand HDR per GPU between nodes",
    interconnect_bandwidth=300e9,
    inter_host_bandwidth=25e9,
)
_AMPERE_SXM = dict(
    compute_capability=(8, 0),
    core_count=108,
    fpus_per_core=64,
    clock_ghz=1.41,
    l2_cache_bytes=40 * 1024**2,
    shared_memory_per_core=164 * 1024,
    shared_memory_per_block_optin=163 * 1024,
)


def _gpu(
    name: str, facts: dict[str, Any], chip: dict[str, Any], hosts: int, per_host: int
) -> Target:
  return Target(
      name=name,
      platform="gpu",
      num_devices=hosts * per_host,
      num_hosts=hosts,
      usable_fraction=GPU_DEFAULT_MEMORY_FRACTION,
      topology=f"1x{hosts}x{per_host}",
      gpu_chip=chip,
      **facts,
  )


# Cloud TPU system architecture pages. ICI per chip, one way, all links (an upper bound).
_V4 = dict(
    device_kind="TPU v4",
    memory_bytes=32 * GIB,
    memory_bandwidth=1.2e12,
    interconnect="ICI, 3D torus (6 links, 300 GB/s per chip each way)",
    interconnect_bandwidth=300e9,
)
_V5E = dict(
    device_kind="TPU v5 lite",
    memory_bytes=16 * GIB,
    memory_bandwidth=8.19e11,
    interconnect="ICI, 2D torus (4 links, 200 GB/s per chip each way)",
    interconnect_bandwidth=200e9,
)
_V5P = dict(
    device_kind="TPU v5",
    memory_bytes=95 * GIB,
    memory_bandwidth=2.765e12,
    interconnect="ICI, 3D torus (6 links, 600 GB/s per chip each way)",
    interconnect_bandwidth=600e9,
)
for _chip in (_V4, _V5E, _V5P):
  _chip["peak_bf16_flops"] = _chip["peak_tf32_flops"] = PEAK_FLOPS_BY_KIND[_chip["device_kind"]]
  _chip["inter_host_bandwidth"] = _chip["interconnect_bandwidth"]


# TPU v3, for the step-time calibration: each core is a device with half the chip.
_V3_CORE = dict(
    device_kind="TPU v3",
    memory_bytes=16 * GIB,
    memory_bandwidth=450e9,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["TPU v3"],
    peak_tf32_flops=PEAK_FLOPS_BY_KIND["TPU v3"],
    interconnect="ICI, 2D torus (332 GB/s per chip all-reduce, half per core)",
    interconnect_bandwidth=166e9,
    inter_host_bandwidth=166e9,
)


def _tpu(
    name: str, facts: dict[str, Any], topology: str, chips: int, per_host: int = 4, **kwargs: Any
) -> Target:
  kwargs.setdefault("chips_per_host_bounds", (2, 2, 1) if per_host == 4 else (2, 4, 1))
  return Target(
      name=name,
      platform="tpu",
      num_devices=chips,
      num_hosts=max(1, chips // per_host),
      usable_fraction=1.0,
      topology=topology,
      **facts,
      **kwargs,
  )


# v4 and v5p names count TensorCores (two per chip, one megacore device); v5e names count chips.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _tpu("v3-8", _V3_CORE, "v3:2x2", 8, per_host=8, chips_per_host_bounds=(2, 2, 1)),
        _tpu("v4-8", _V4, "v4:2x2x1", 4, chip_config="megacore"),
        _tpu("v4-32", _V4, "v4:2x2x4", 16, chip_config="megacore"),
        _tpu("v4-64", _V4, "v4:2x4x4", 32, chip_config="megacore"),
        _tpu("v5e-8", _V5E, "v5e:2x4", 8, per_host=8),  # One host with 8 chips (2x4).
        _tpu("v5e-16", _V5E, "v5e:4x4", 16),
        _tpu("v5e-64", _V5E, "v5e:8x8", 64),
        _tpu("v5e-256", _V5E, "v5e:16x16", 256),
        _tpu("v5p-8", _V5P, "v5p:2x2x1", 4, chip_config="megacore"),
        _tpu("v5p-32", _V5P, "v5p:2x2x4", 16, chip_config="megacore"),
        _gpu("h100x1", _H100, _HOPPER_SXM, hosts=1, per_host=1),
        _gpu("h100x8", _H100, _HOPPER_SXM, hosts=1, per_host=8),
        _gpu("h100x16", _H100, _HOPPER_SXM, hosts=2, per_host=8),
        _gpu("h200x1", _H200, dict(_HOPPER_SXM, l2_cache_bytes=60 * 1024**2), hosts=1, per_host=1),
        _gpu("h200x8", _H200, dict(_HOPPER_SXM, l2_cache_bytes=60 * 1024**2), hosts=1, per_host=8),
        _gpu("a100x8", _A100, _AMPERE_SXM, hosts=1, per_host=8),
    )
}


def get_target(name: str) -> Target:
  """The target called `name`, its GPU memory at `gpu_memory_fraction`; a KeyError if unknown."""
  if name not in TARGETS:
    raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
  target = TARGETS[name]
  if target.platform != "gpu":
    return target
  return dataclasses.replace(target, usable_fraction=gpu_memory_fraction())


def _c_environment() -> set[str]:
  """The variable names of the C library's environment (os.environ is Python's copy)."""
  environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
  raw = itertools.takewhile(lambda e: e is not None, map(environ.__getitem__, itertools.count()))
  return {entry.decode(errors="replace").partition("=")[0] for entry in raw}


def _forget_variables_set_behind_pythons_back(before: set[str]) -> None:
  """Unsets what libtpu setenv'd (TPU_WORKER_ID="WARNING: ..."): children would take
  themselves for a TPU pod worker (trainkit/distributed.py)."""
  libc = ctypes.CDLL(None)
  for name in _c_environment():
    if name not in before and name not in os.environ:
      libc.unsetenv(name.encode())


_ONE_WORKER = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
# TPU device files: /dev/accel* (v2 to v4), /dev/vfio/<n> (v5e and later).
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_signs() -> list[str]:
  """TPU device files and Google PCI devices of this host (empty: no TPU here)."""
  found = [path for pattern in TPU_DEVICE_GLOBS for path in sorted(glob.glob(pattern))]
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor) as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          found.append(os.path.dirname(vendor))
    except OSError:
      pass
  return found


@functools.cache
def devices(target: Target) -> tuple[Any, ...]:
  """The target's devices without the hardware; a UserError naming the missing plugin."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  compilers.add_to_path()
  environment = _c_environment()
  # Without a TPU, libtpu prints `E0000 ... unexpected worker hostname` unless this host is the
  # one worker (only meanwhile; the user's own values are kept).
  single_host = {}
  if target.platform == "tpu" and not tpu_signs():
    single_host = {k: v for k, v in _ONE_WORKER.items() if k not in os.environ}
  # libtpu's import sets TPU_LIBRARY_PATH, with which every child process would start libtpu.
  meanwhile = [*single_host, *{"TPU_LIBRARY_PATH"} - set(os.environ)]
  try:
    if target.platform == "tpu":
      # Two processes that load libtpu at once (tests in parallel) need this.
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      os.environ.update(single_host)
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
    extra = "libtpu" if target.platform == "tpu" else "the CUDA plugin"
    raise UserError(
        f"cannot describe the devices of {target.name} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); the preflight needs {extra}: "
        "python -m trainkit.preflight.compilers"
    ) from e
  finally:
    for name in meanwhile:
      os.environ.pop(name, None)
    _forget_variables_set_behind_pythons_back(environment)
  found = tuple(topology.devices)
  if len(found) != target.num_devices:
    raise RuntimeError(f"{target.name}: expected {target.num_devices} devices, got {len(found)}")
  return found
