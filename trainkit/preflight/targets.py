"""The accelerators a run can be compiled for without them: TPU slices and NVIDIA GPU nodes.

A target is hardware facts (devices, hosts, memory, peak FLOP/s, memory and interconnect
bandwidth) plus how JAX describes its devices without the hardware
(`jax.experimental.topologies`): libtpu for a TPU slice, the CUDA plugin and a GPU description
(`GpuTargetConfigProto`, in text form) for a GPU node. `devices(target)` returns the target's
devices on this machine, with the process (host) index each has in a real multi-host run.

Peak FLOP/s are the dense bf16 matrix figures of the vendors' data sheets. A float32 run is
costed at the same peak: JAX's default matmul precision runs float32 matmuls as one bf16 pass
on a TPU, and as TF32 on an A100 or H100, whose TF32 peak is half the bf16 one; the step-time
estimate says which peak it used (`peak_flops_per_s`).

GPU memory: the fit and the compiler's limit are one number, `Target.usable_bytes`. A JAX
process gives its programs XLA_PYTHON_CLIENT_MEM_FRACTION of each GPU's memory (0.75 by
default; `gpu_memory_fraction` reads the variable once): its allocator's size, what the fit is
checked against. XLA's GPU compiler rematerialises a program toward a limit of its own
(`GetSchedulerMemoryLimit`, xla/service/gpu/gpu_hlo_schedule.cc): 0.95
(`xla_gpu_memory_limit_slop_factor`) x (base - the program's argument and output bytes). When
a client compiles, jaxlib passes its allocator's size as the build option `device_memory_size`
and the base is that size; when none does, as in this deviceless compile, the base is 80% of
the description's `device_memory_size`. So the description carries usable / 0.8 (93.75% of the
memory at the default fraction): the preflight's compile then rematerialises toward the limit a
real run's compile applies, and a program XLA brings under it peaks below `usable_bytes`.
Checked on the CUDA plugin (jax 0.10.2) by tests/test_preflight.py: the base limit XLA logs
is `usable_bytes` exactly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
from typing import Any

from trainkit.errors import UserError
from trainkit.platforms import tpu_signs
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
    interconnect: what links the devices, in words (for the record).
    interconnect_bandwidth: bytes per second one device sends into a collective over its
      links to the others in its host (GPU: NVLink through NVSwitch) or slice (TPU: ICI), one
      direction, all its links together.
    inter_host_bandwidth: the same for a collective whose group spans hosts (GPU: the node's
      network per GPU; TPU: the ICI again, which spans a slice's hosts).
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
  interconnect: str = ""
  interconnect_bandwidth: float = 0.0
  inter_host_bandwidth: float = 0.0

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


# The share of a GPU's memory JAX takes by default, and the variable that changes it.
GPU_DEFAULT_MEMORY_FRACTION = 0.75
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# XLA's GPU compiler takes this percentage of the described device memory as its base limit
# when no client passes `device_memory_size` (the module docstring).
_XLA_DEFAULT_BASE_PERCENT = 80


@functools.cache
def gpu_memory_fraction() -> float:
  """XLA_PYTHON_CLIENT_MEM_FRACTION as JAX reads it (read once); its default when unset.

  Raises a UserError naming the variable when it is not a number in (0, 1]: JAX would take
  more than the GPU has only with unified memory, which the preflight does not model.
  """
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
  """The `device_memory_size` a GPU description carries so that XLA's base limit, 80% of it
  (integer arithmetic), is `usable_bytes` exactly: ceil(usable / 0.8)."""
  return -(-usable_bytes * 100 // _XLA_DEFAULT_BASE_PERCENT)


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
  """A GpuTargetConfigProto in text form: the facts XLA's GPU compiler reads of a device.

  `memory_bytes` is the device's memory; the description says the memory a JAX program gets of
  it at the default fraction, as the compiler's base limit sees it (`described_memory_bytes`).
  """
  major, minor = compute_capability
  described = described_memory_bytes(int(memory_bytes * GPU_DEFAULT_MEMORY_FRACTION))
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
  device_memory_size: {described}
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
# Interconnect, per GPU and per direction (the data sheets' NVLink figures count both directions):
# - H100 SXM: "NVLink: 900GB/s" (NVIDIA H100 Tensor Core GPU data sheet; 18 NVLink 4 links),
#   i.e. 450 GB/s each way, to every other GPU of an HGX/DGX H100 node through its NVSwitches.
# - A100 SXM: "NVLink: 600GB/s" (NVIDIA A100 Tensor Core GPU data sheet; 12 NVLink 3 links),
#   i.e. 300 GB/s each way, likewise through NVSwitch in an HGX/DGX A100 node.
# - Between nodes: a DGX H100 has 8 single-port ConnectX-7 adapters at 400 Gb/s InfiniBand NDR
#   for its compute fabric (NVIDIA DGX H100 data sheet / user guide), one per GPU: 50 GB/s per
#   GPU each way; a DGX A100 has 8 ConnectX-6 at 200 Gb/s HDR (NVIDIA DGX A100 data sheet):
#   25 GB/s per GPU each way. A multi-node target is taken to be such nodes.
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
# The GH100 die of the H100 and H200 SXM: what XLA's GPU compiler is told besides memory and L2.
_HOPPER_SXM = dict(
    compute_capability=(9, 0),
    core_count=132,
    fpus_per_core=128,
    clock_ghz=1.98,
    shared_memory_per_core=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
)
_H100_DESCRIPTION = _gpu_description(
    name="NVIDIA H100 80GB HBM3",
    memory_bytes=_H100["memory_bytes"],
    memory_bandwidth=_H100["memory_bandwidth"],
    l2_cache_bytes=50 * 1024**2,
    **_HOPPER_SXM,
)
# H200 SXM 141 GB (NVIDIA H200 Tensor Core GPU data sheet): the H100's compute (the same GH100
# die, 132 SMs: 989 TFLOP/s dense bf16, 494 TF32) with 141 GB of HBM3e at 4.8 TB/s, and the same
# NVLink 4 (900 GB/s both ways). Device memory as nvidia-smi reported it on the H200 the
# accelerator check ran on (143771 MiB; docs/benchmarks.md, "Accelerator check"); 60 MB of L2 as
# PyTorch reported it on such a machine. Between nodes: taken to be a DGX H200, with the DGX
# H100's eight 400 Gb/s ConnectX-7 adapters.
_H200 = dict(
    _H100,
    device_kind="NVIDIA H200",
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["NVIDIA H200"],
    memory_bytes=143_771 * 1024**2,
    memory_bandwidth=4.8e12,
)
_H200_DESCRIPTION = _gpu_description(
    name="NVIDIA H200",
    memory_bytes=_H200["memory_bytes"],
    memory_bandwidth=_H200["memory_bandwidth"],
    l2_cache_bytes=60 * 1024**2,
    **_HOPPER_SXM,
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
# ICI per chip, per direction, all its links together:
# - v5e: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip): 400 GBps", 4 ICI
#   ports (Cloud TPU "TPU v5e" page; an older version of it says "Interchip Interconnect BW:
#   1,600 Gbps", the same 200 GB/s one way): 200 GB/s each way.
# - v5p: "Bidirectional inter-chip interconnect (ICI) bandwidth per chip: 1200 GBps" (Cloud TPU
#   "TPU v5p" page; formerly "Interchip Interconnect BW: 4800 Gbps"): 600 GB/s each way, 6 links.
# - v4: the Cloud TPU "TPU v4" page gives no per-chip figure; the TPU v4 paper (Jouppi et al.,
#   ISCA 2023) gives 6 ICI links per chip at 50 GB/s (400 Gb/s) each way: 300 GB/s each way.
# A slice's ICI spans its hosts (the data-centre network only joins slices), so a group across
# hosts gets the same bandwidth. A collective over one axis of the torus uses 2 of the chip's
# links, not all of them: the figure bounds the rate from above, as the roofline does.
_V4 = dict(
    device_kind="TPU v4", memory_bytes=32 * GIB, memory_bandwidth=1.2e12,
    interconnect="ICI, 3D torus (6 links, 300 GB/s per chip each way)", interconnect_bandwidth=300e9,
)
_V5E = dict(
    device_kind="TPU v5 lite", memory_bytes=16 * GIB, memory_bandwidth=8.19e11,
    interconnect="ICI, 2D torus (4 links, 200 GB/s per chip each way)", interconnect_bandwidth=200e9,
)
_V5P = dict(
    device_kind="TPU v5", memory_bytes=95 * GIB, memory_bandwidth=2.765e12,
    interconnect="ICI, 3D torus (6 links, 600 GB/s per chip each way)", interconnect_bandwidth=600e9,
)
for _chip in (_V4, _V5E, _V5P):
  _chip["peak_bf16_flops"] = _chip["peak_tf32_flops"] = PEAK_FLOPS_BY_KIND[_chip["device_kind"]]
  _chip["inter_host_bandwidth"] = _chip["interconnect_bandwidth"]


# TPU v3 (Cloud TPU system architecture page, "TPU v3"): per chip 123 TFLOP/s bf16, 32 GiB HBM
# at 900 GB/s, two TensorCores that JAX sees as two devices: each device gets half of each. The
# page gives ICI only per pod ("All-reduce bandwidth per Pod: 340 TB/s", 1024 chips): 332 GB/s
# per chip, 166 GB/s per core. A v3-8 is one host, 4 chips, 8 devices. It is here for the
# calibration of the step time (paper_runner/calibration.py: big_vision's ViT-S/16 figure).
_V3_CORE = dict(
    device_kind="TPU v3", memory_bytes=16 * GIB, memory_bandwidth=450e9,
    peak_bf16_flops=PEAK_FLOPS_BY_KIND["TPU v3"], peak_tf32_flops=PEAK_FLOPS_BY_KIND["TPU v3"],
    interconnect="ICI, 2D torus (332 GB/s per chip all-reduce, half per core)",
    interconnect_bandwidth=166e9, inter_host_bandwidth=166e9,
)


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
        Target(name="v3-8", platform="tpu", num_devices=8, num_hosts=1, usable_fraction=1.0,
               topology="v3:2x2", **_V3_CORE),
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
        _gpu("h200x1", _H200, _H200_DESCRIPTION, hosts=1, per_host=1),
        _gpu("h200x8", _H200, _H200_DESCRIPTION, hosts=1, per_host=8),
        _gpu("a100x8", _A100, _A100_DESCRIPTION, hosts=1, per_host=8),
    )
}


def get_target(name: str) -> Target:
  """The target called `name`; a KeyError listing the known names otherwise.

  A GPU target's usable memory, and the memory its description gives the compiler, follow
  XLA_PYTHON_CLIENT_MEM_FRACTION when it is set (`gpu_memory_fraction`).
  """
  if name not in TARGETS:
    raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
  return _with_memory_fraction(TARGETS[name])


def _with_memory_fraction(target: Target) -> Target:
  if target.platform != "gpu":
    return target
  fraction = gpu_memory_fraction()
  if fraction == target.usable_fraction:
    return target
  described = described_memory_bytes(int(target.memory_bytes * fraction))
  description, count = re.subn(
      r"device_memory_size: \d+", f"device_memory_size: {described}", target.gpu_description
  )
  assert count == 1, "a GPU description has one device_memory_size"
  return dataclasses.replace(target, usable_fraction=fraction, gpu_description=description)


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


_ONE_WORKER = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


@functools.cache
def devices(target: Target) -> tuple[Any, ...]:
  """The target's devices, described without the hardware (each with its host's process index).

  TPU: libtpu's topology of the slice. GPU: the CUDA plugin with the target's description.
  Raises a UserError saying what to install when the plugin is missing.
  """
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  environment = _c_environment()
  # On a host without a TPU, libtpu asks for the hostnames and host bounds of a slice this host
  # is not part of and prints `E0000 ... unexpected worker hostname`: this host alone is the
  # worker, only while the slice is described; the user's own values are kept.
  single_host = {}
  if target.platform == "tpu" and not tpu_signs():
    single_host = {k: v for k, v in _ONE_WORKER.items() if k not in os.environ}
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
    extra = "libtpu" if target.platform == "tpu" else "the CUDA plugin (jax[cuda12-local])"
    raise UserError(
        f"cannot describe the devices of {target.name} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); the preflight needs {extra}: "
        'pip install -e ".[preflight]"'
    ) from e
  finally:
    for name in single_host:
      os.environ.pop(name, None)
    _forget_variables_set_behind_pythons_back(environment)
  found = tuple(topology.devices)
  if len(found) != target.num_devices:
    raise RuntimeError(f"{target.name}: expected {target.num_devices} devices, got {len(found)}")
  return found
