"""Tests run on 8 fake CPU devices so multi-device code paths are exercised without accelerators."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With the preflight extra installed (CI installs it), the CUDA plugin logs at INFO from C++ on
# every import of JAX on a machine without a GPU; the tests read stderr.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Many tests compile the same programs (a run, then its resume; one device, then a mesh), in
# this process and in the `python -m ...` subprocesses they start, which inherit these
# variables: JAX's persistent compilation cache makes the repeats cheap.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"fairmoe_jax_tests_xla_cache_{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def repo_root() -> pathlib.Path:
  return REPO_ROOT
