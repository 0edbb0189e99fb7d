"""Which JAX backends this host can start, decided before JAX starts them.

JAX probes every backend it finds installed. With the preflight extra (`pip install -e
".[preflight]"`: libtpu and the CUDA plugin, for compiling without the hardware), that probe fails
on a machine without a GPU or TPU, loudly: the CUDA plugin's version check prints a traceback
("Jax plugin configuration error ... Unable to load cuDNN") and libtpu prints `E0000 ...
unexpected worker hostname` lines, in every run and every run of a sweep, although the run then
uses the CPU as it should. `cpu_only_reason` decides, from the host alone, that no installed
accelerator backend can start here; the entry points (`trainkit.cli.run`) then set JAX's
`jax_platforms` to "cpu" before any backend starts, which skips both probes. It never acts when
the user chose the platforms (`JAX_PLATFORMS`, even empty, or `--jax_platforms`), on a system
other than Linux, when a backend it does not know is installed (ROCm, Metal, oneAPI, ...), or
when this host shows any sign of a GPU or TPU: NVIDIA's or AMD's device files, TPU device files,
or a Google (TPU) device on the PCI bus.

`deviceless_tpu_environment` is the same care for the preflight's TPU targets: libtpu, loaded to
describe a slice on a host without a TPU, asks for the worker hostnames and host bounds of a
slice it is not part of; the variables it returns describe this one host, which is what it is.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import pkgutil
import platform
from typing import Iterable, Mapping

# Device files that mean a GPU may be usable (JAX's own test for NVIDIA uses the first three;
# /dev/dxg is WSL2's GPU; /dev/kfd is AMD's ROCm driver).
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# TPU device files: /dev/accel* (v2 to v4), /dev/vfio/<n> (v5e and later).
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
GOOGLE_PCI_VENDOR = "0x1ae0"
# JAX plugins (modules of the `jax_plugins` namespace) whose absence of hardware is detected
# here; any other plugin means a backend this module cannot judge, and nothing is changed.
KNOWN_PLUGIN_PREFIXES = ("xla_cuda",)


@dataclasses.dataclass(frozen=True)
class Host:
  """What `cpu_only_reason` looks at, gathered by `probe_host` (tests build their own).

  Attributes:
    system: `platform.system()`, e.g. "Linux".
    plugins: the JAX plugin modules installed (`jax_plugins.*` and the `jax_plugins` entry
      points), e.g. ("jax_plugins.xla_cuda12",).
    libtpu: whether libtpu is installed (JAX's TPU backend).
    accelerator_signs: the device files or PCI devices found that may be a GPU or TPU.
  """

  system: str
  plugins: tuple[str, ...]
  libtpu: bool
  accelerator_signs: tuple[str, ...]


def _google_pci_devices() -> list[str]:
  found = []
  for vendor_path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor_path) as f:
        vendor = f.read().strip()
    except OSError:
      continue
    if vendor == GOOGLE_PCI_VENDOR:
      found.append(os.path.dirname(vendor_path))
  return found


def tpu_signs() -> list[str]:
  """TPU device files and Google PCI devices of this host (empty: no TPU here)."""
  found = [path for pattern in TPU_DEVICE_GLOBS for path in sorted(glob.glob(pattern))]
  return found + _google_pci_devices()


def accelerator_signs() -> list[str]:
  """Everything on this host that may be a GPU or a TPU (empty: none)."""
  return [path for path in GPU_DEVICE_FILES if os.path.exists(path)] + tpu_signs()


def installed_plugins() -> list[str]:
  """The JAX plugin modules JAX would load, found without importing JAX or them."""
  names = set()
  try:
    spec = importlib.util.find_spec("jax_plugins")
  except (ImportError, ValueError):
    spec = None
  if spec is not None and spec.submodule_search_locations:
    for module in pkgutil.iter_modules(spec.submodule_search_locations, "jax_plugins."):
      names.add(module.name)
  from importlib.metadata import entry_points  # pylint: disable=import-outside-toplevel

  names.update(entry_point.value for entry_point in entry_points(group="jax_plugins"))
  return sorted(names)


def probe_host() -> Host:
  try:
    libtpu = importlib.util.find_spec("libtpu") is not None
  except (ImportError, ValueError):
    libtpu = False
  return Host(
      system=platform.system(),
      plugins=tuple(installed_plugins()),
      libtpu=libtpu,
      accelerator_signs=tuple(accelerator_signs()),
  )


def _is_known_plugin(name: str) -> bool:
  short = name.rpartition(".")[2].partition(":")[0]
  return any(short.startswith(prefix) for prefix in KNOWN_PLUGIN_PREFIXES)


def cpu_only_reason(
    environ: Mapping[str, str], host: Host, jax_platforms: str | None = None
) -> str | None:
  """Why JAX should use the CPU alone here, or None to leave JAX's choice as it is.

  Args:
    environ: the process's environment (`JAX_PLATFORMS`, even empty, is the user's choice).
    host: what this host has (`probe_host()`).
    jax_platforms: JAX's `jax_platforms` as already set in the process (e.g. by code that ran
      before), which is the user's choice too.
  """
  if "JAX_PLATFORMS" in environ or jax_platforms:
    return None
  if host.system != "Linux":  # Metal (macOS), or hardware this module cannot see.
    return None
  if any(not _is_known_plugin(name) for name in host.plugins):
    return None
  if host.accelerator_signs:
    return None
  probed = (["the CUDA plugin"] if host.plugins else []) + (["libtpu"] if host.libtpu else [])
  if not probed:
    return None  # Nothing but the CPU backend is installed: nothing to skip.
  return f"{' and '.join(probed)} installed, but no GPU or TPU on this host"


def skip_absent_accelerators(environ: Mapping[str, str] | None = None) -> str | None:
  """Sets `jax_platforms` to "cpu" when `cpu_only_reason` says so; returns the reason (None
  when nothing was changed). Call it before anything starts a JAX backend; the environment is
  left as it is (the subprocesses a run starts decide for themselves)."""
  import jax  # pylint: disable=import-outside-toplevel

  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or jax.config.jax_platforms:
    return None  # The user's choice: nothing to probe.
  reason = cpu_only_reason(environ, probe_host(), jax.config.jax_platforms)
  if reason is not None:
    jax.config.update("jax_platforms", "cpu")
  return reason


def deviceless_tpu_environment(
    environ: Mapping[str, str], signs: Iterable[str] | None = None
) -> dict[str, str]:
  """The variables to set while libtpu describes a slice on this host: this host alone as the
  one worker, so libtpu does not print `E0000 ... unexpected worker hostname` or "Failed to find
  host bounds". Empty on a host with a TPU (libtpu reads the real values there) and for each
  variable the user set. The slice described is given explicitly (its topology and chips per
  host) and does not change."""
  signs = tpu_signs() if signs is None else list(signs)
  if signs:
    return {}
  wanted = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
  return {name: value for name, value in wanted.items() if name not in environ}
