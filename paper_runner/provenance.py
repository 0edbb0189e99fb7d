"""What a recorded number depends on beyond the code: the machine, the software, the input data.
`--reproduce` compares a rerun exactly only where `differences` finds none (XLA:CPU compiles for
the host's instruction set; libraries change kernels; data changes everything after it)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from typing import Any, Iterable, Mapping

from paper_runner.spec import flatten

# The instruction-set extensions LLVM may use when XLA compiles for this CPU (vector widths,
# fused multiply-add, bfloat16 and int8 dot products): two CPUs that differ in these may round
# the same program differently.
_CPU_FEATURES = frozenset(
    "sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16 "
    "avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8 asimd sve sve2 bf16 i8mm".split()
)
# Packages whose version changes numbers (kernels, initialisers, optimiser updates).
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")
# Environment variables that change what XLA compiles or how JAX computes.
_ENVIRONMENT = ("XLA_FLAGS", "JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION", "JAX_PLATFORMS")


def _cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo (Linux), or {} elsewhere."""
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:
    return {}
  pairs = (line.partition(":") for line in text.split("\n\n", 1)[0].splitlines())
  return {key.strip(): value.strip() for key, _, value in pairs}


def processor() -> dict[str, Any]:
  """The CPU: its model, family and the instruction-set extensions XLA can compile for."""
  info = _cpuinfo()
  flags = set((info.get("flags") or info.get("Features") or "").split())
  return {
      "model": info.get("model name") or platform.processor() or platform.machine(),
      "vendor": info.get("vendor_id") or info.get("CPU implementer", ""),
      "family": "/".join(info.get(k, "") for k in ("cpu family", "model", "stepping")),
      "features": sorted(flags.intersection(_CPU_FEATURES)),
  }


def host(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
  """`machine()` but the devices (`environ` default: this process's), so a sweep's supervisor can
  describe the host its runs start on without initialising a backend the runs need."""
  environ = os.environ if environ is None else environ
  return {
      "cpu_cores": os.cpu_count(),
      "arch": platform.machine(),
      "processor": processor(),
      "python": platform.python_version(),
      "jax": importlib.metadata.version("jax"),
      "versions": {package: importlib.metadata.version(package) for package in _PACKAGES},
      "environment": {name: environ.get(name, "") for name in _ENVIRONMENT},
  }


def machine() -> dict[str, Any]:
  """Device kind and count, processor, cores, software versions and the numerics environment."""
  import jax  # Lazily: only recording and reproducing need it, not --write or --check.

  devices = jax.devices()
  kind = devices[0].device_kind
  return {
      "device": devices[0].platform.upper() + (f" ({kind})" if kind != devices[0].platform else ""),
      "devices": len(devices),
      **host(),
  }


def _git(repo: str, *args: str) -> str:
  try:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout
  except (OSError, subprocess.CalledProcessError):
    return ""


def source_state(repo: str) -> dict[str, Any]:
  """The commit checked out in `repo` and its tracked files with uncommitted changes (results
  documents and records aside: recording a table changes them)."""
  status = _git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
  changed = [line[3:] for line in status if not line[3:].startswith(("docs/", "results/records/"))]
  commit = _git(repo, "rev-parse", "--short=10", "HEAD").strip() or "unknown"
  return {"commit": commit, "uncommitted_changes": changed}


def _file_hash(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def data_hash(path: str) -> str:
  """sha256 of a file, or of a directory's files (their relative names and contents)."""
  if os.path.isfile(path):
    return _file_hash(path)
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      digest.update(f"{os.path.relpath(full, path)}\0{_file_hash(full)}\n".encode())
  return digest.hexdigest()


def data_hashes(configs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
  """{path: sha256} of every input file or directory the runs of `configs` read besides their
  workdir: the config keys under `data` (and `model.glove_path`) that name an existing one."""
  paths = {
      os.path.abspath(value)
      for config in configs
      for key, value in flatten(config).items()
      if isinstance(value, str)
      and value
      and (key.startswith("data.") or key == "model.glove_path")
      and os.path.exists(value)
  }
  return {path: data_hash(path) for path in sorted(paths)}


def differences(recorded: Mapping, current: Mapping, path: str = "") -> list[str]:
  """What differs between a recorded and a current description ("processor.model: A != B");
  a value the record lacks counts as different (an older record cannot vouch for it)."""
  found = []
  for key in sorted(set(recorded) | set(current)):
    name = f"{path}{key}"
    old, new = recorded.get(key, "<not recorded>"), current.get(key, "<absent>")
    if isinstance(old, Mapping) and isinstance(new, Mapping):
      found += differences(old, new, f"{name}.")
    elif old != new:
      found.append(f"{name}: {old} != {new}")
  return found
