r"""The preflight's compilers, libtpu and the CUDA plugin, in a folder off every other import path.

JAX starts each plugin it can import at its first backend, in any process: without a TPU or GPU, a
user's own `import jax; jax.devices()` then prints a cuDNN traceback and libtpu's errors. So they
go into `FOLDER`, not site-packages, and only a process that compiles for a target puts it on
`sys.path` (`--mode=compile`, `targets.devices`, the tests).

    python -m trainkit.preflight.compilers [pip options]
"""

import importlib.metadata
import json
import pathlib
import subprocess
import sys

FOLDER = pathlib.Path(sys.prefix) / "compilers"
_EXTRAS = "jax[tpu,cuda12-local]"
_COMPILERS = ("libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def add_to_path() -> bool:
  """FOLDER last on sys.path; whether it exists. JAX finds the CUDA plugin only if this runs
  before its first backend starts (libtpu it loads when a TPU slice is described)."""
  if FOLDER.is_dir() and str(FOLDER) not in sys.path:
    sys.path.append(str(FOLDER))
  return FOLDER.is_dir()


def _resolve(pip: list[str], *requirement: str) -> tuple[dict[str, str], str]:
  """({distribution: version} pip would install for `requirement`, {} where it cannot; why not:
  pip's first error, whose "from versions: none" tells an index that could not be reached)."""
  command = [*pip, "--dry-run", "-q", "--report", "-", *requirement]
  dry_run = subprocess.run(command, capture_output=True, text=True)
  report = json.loads(dry_run.stdout)["install"] if dry_run.returncode == 0 else []
  pins = {p["metadata"]["name"].lower().replace("_", "-"): p["metadata"]["version"] for p in report}
  return pins, next((line for line in dry_run.stderr.splitlines() if "ERROR" in line), "")


if __name__ == "__main__":
  pip = [sys.executable, "-m", "pip", "install", *sys.argv[1:]]
  jax = importlib.metadata.version("jax")
  # The compilers jax's own extras pin for the installed jax; where the index has none (a release
  # whose libtpu is not out yet), pip steps jax back to the newest that has them.
  found, why = _resolve(pip, "--ignore-installed", f"{_EXTRAS}=={jax}")
  found, why = (found, why) if found else _resolve(pip, _EXTRAS)
  if not set(_COMPILERS) <= set(found):
    sys.exit(f"error: pip found no libtpu and CUDA plugin for jax {jax}: {why}")
  if found.get("jax", jax) != jax:
    print(f"the preflight's compilers need jax {found['jax']}, the newest jax they exist for")
    subprocess.check_call([*pip, f"jax=={found['jax']}", f"jaxlib=={found['jaxlib']}"])
  compilers = [f"{name}=={found[name]}" for name in _COMPILERS]
  sys.exit(subprocess.call([*pip, "--upgrade", "--no-deps", "--target", str(FOLDER), *compilers]))
