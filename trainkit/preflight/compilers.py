r"""The preflight's compilers, libtpu and the CUDA plugin, in a folder off every other import path.

JAX starts each installed plugin at the first backend it initialises, in any process: on a
machine without a TPU or a GPU, a user's own `import jax; jax.devices()` then prints a cuDNN
traceback and libtpu's errors. So the compilers are not installed into site-packages but into
`FOLDER` (`<environment>/compilers`), and only a process that compiles for a target puts it on
`sys.path` (`add_to_path`): `--mode=compile`, the benchmarks and the tests.

    python -m trainkit.preflight.compilers [pip options, e.g. -c constraints.txt]
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

FOLDER = pathlib.Path(sys.prefix) / "compilers"


def add_to_path() -> bool:
  """Puts FOLDER last on sys.path; whether it exists. JAX finds the CUDA plugin only if this
  runs before its first backend starts (libtpu it loads when a TPU slice is described)."""
  if FOLDER.is_dir() and str(FOLDER) not in sys.path:
    sys.path.append(str(FOLDER))
  return FOLDER.is_dir()


def requirements() -> list[str]:
  """The libtpu that jax's `tpu` extra pins, and the CUDA plugin and its PJRT at jaxlib's version
  (jax's `cuda12-local` extra, without the CUDA libraries)."""
  libtpu = [
      requirement.split(";")[0].strip()
      for requirement in importlib.metadata.requires("jax") or []
      if requirement.startswith("libtpu") and 'extra == "tpu"' in requirement
  ]
  jaxlib = importlib.metadata.version("jaxlib")
  return [*libtpu, f"jax-cuda12-plugin=={jaxlib}", f"jax-cuda12-pjrt=={jaxlib}"]


def main(pip_options: list[str]) -> int:
  command = [sys.executable, "-m", "pip", "install", "--upgrade", "--no-deps", "--target"]
  command += [str(FOLDER), *requirements(), *pip_options]
  print(" ".join(command), flush=True)
  return subprocess.call(command)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
