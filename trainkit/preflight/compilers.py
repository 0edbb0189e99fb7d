r"""The preflight's compilers, libtpu and the CUDA plugin, in a folder off every other import path.

JAX starts each plugin it can import at its first backend, in any process: without a TPU or GPU, a
user's own `import jax; jax.devices()` then prints a cuDNN traceback and libtpu's errors. So they
go into `FOLDER`, not site-packages, and only a process that compiles for a target puts it on
`sys.path` (`--mode=compile`, `targets.devices`, the tests).

    python -m trainkit.preflight.compilers [pip options]
"""

import importlib.metadata
import pathlib
import subprocess
import sys

FOLDER = pathlib.Path(sys.prefix) / "compilers"


def add_to_path() -> bool:
  """FOLDER last on sys.path; whether it exists. JAX finds the CUDA plugin only if this runs
  before its first backend starts (libtpu it loads when a TPU slice is described)."""
  if FOLDER.is_dir() and str(FOLDER) not in sys.path:
    sys.path.append(str(FOLDER))
  return FOLDER.is_dir()


def requirements() -> list[str]:
  """The libtpu jax's `tpu` extra pins; the CUDA plugin and its PJRT at jaxlib's version."""
  tpu = [r.split(";")[0] for r in importlib.metadata.requires("jax") if r.startswith("libtpu")]
  jaxlib = importlib.metadata.version("jaxlib")
  return [*tpu, f"jax-cuda12-plugin=={jaxlib}", f"jax-cuda12-pjrt=={jaxlib}"]


if __name__ == "__main__":
  pip = [sys.executable, "-m", "pip", "install", "--upgrade", "--no-deps", "--target", str(FOLDER)]
  sys.exit(subprocess.call([*pip, *requirements(), *sys.argv[1:]]))
