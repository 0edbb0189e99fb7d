"""On a host without a GPU or TPU, JAX uses the CPU alone instead of probing absent hardware.

The preflight extra installs libtpu and the CUDA plugin, whose probes print a traceback on a CPU
host; JAX's only switch is `jax_platforms`, set here by the entry points when nothing but those
would be skipped (docs/reliability.md, row 26).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import pkgutil
import platform
from typing import Mapping

# NVIDIA's device files (those JAX checks), WSL2's GPU, AMD's ROCm driver.
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# TPU device files: /dev/accel* (v2 to v4), /dev/vfio/<n> (v5e and later).
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
GOOGLE_PCI_VENDOR = "0x1ae0"


@dataclasses.dataclass(frozen=True)
class Host:
  """What `cpu_only_reason` looks at (`probe_host`; tests build their own)."""

  system: str  # platform.system()
  plugins: tuple[str, ...]  # The JAX plugin modules installed, e.g. "jax_plugins.xla_cuda12".
  libtpu: bool
  accelerator_signs: tuple[str, ...]  # Device files or PCI devices that may be a GPU or TPU.


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


def accelerator_signs() -> list[str]:
  """Everything on this host that may be a GPU or a TPU (empty: none)."""
  return [path for path in GPU_DEVICE_FILES if os.path.exists(path)] + tpu_signs()


def installed_plugins() -> list[str]:
  """The JAX plugin modules JAX would load, found as JAX finds them, without importing them."""
  names = {e.value for e in importlib.metadata.entry_points(group="jax_plugins")}
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names.update(
        m.name for m in pkgutil.iter_modules(spec.submodule_search_locations, "jax_plugins.")
    )
  return sorted(names)


def probe_host() -> Host:
  return Host(
      system=platform.system(),
      plugins=tuple(installed_plugins()),
      libtpu=importlib.util.find_spec("libtpu") is not None,
      accelerator_signs=tuple(accelerator_signs()),
  )


def cpu_only_reason(
    environ: Mapping[str, str], host: Host, jax_platforms: str | None = None
) -> str | None:
  """Why JAX should use the CPU alone here, or None: never where the user chose platforms (even
  `JAX_PLATFORMS=""`) or another plugin (ROCm, Metal) is installed."""
  if "JAX_PLATFORMS" in environ or jax_platforms or host.system != "Linux":
    return None
  cuda = [n.partition(":")[0].rpartition(".")[2].startswith("xla_cuda") for n in host.plugins]
  if not all(cuda) or host.accelerator_signs:
    return None
  probed = (["the CUDA plugin"] if cuda else []) + (["libtpu"] if host.libtpu else [])
  if not probed:
    return None
  return f"{' and '.join(probed)} installed, but no GPU or TPU on this host"


def skip_absent_accelerators(environ: Mapping[str, str] | None = None) -> str | None:
  """Sets `jax_platforms` (not the environment) to "cpu" when `cpu_only_reason` says so; returns
  the reason."""
  import jax  # pylint: disable=import-outside-toplevel

  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or jax.config.jax_platforms:
    return None
  reason = cpu_only_reason(environ, probe_host())
  if reason is not None:
    jax.config.update("jax_platforms", "cpu")
  return reason
