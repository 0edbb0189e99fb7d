"""On a host without a GPU or TPU, the preflight extra's CUDA plugin and libtpu stay silent
(trainkit/platforms.py; a TPU compile: trainkit/preflight/targets.py)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from trainkit import platforms
from trainkit.platforms import Host, cpu_only_reason

CUDA = ("jax_plugins.xla_cuda12",)
BARE = Host(system="Linux", plugins=CUDA, libtpu=True, accelerator_signs=())
EXTRA_INSTALLED = bool(platforms.installed_plugins()) or importlib.util.find_spec("libtpu")
NO_ACCELERATOR = not platforms.accelerator_signs()


def test_a_host_without_accelerators_uses_the_cpu_alone():
  assert "no GPU or TPU" in cpu_only_reason({}, BARE)
  assert cpu_only_reason({}, Host("Linux", (), True, ())) is not None  # libtpu alone.
  assert cpu_only_reason({}, Host("Linux", CUDA, False, ())) is not None  # CUDA alone.


@pytest.mark.parametrize(
    "environ, host, jax_platforms",
    [
        ({"JAX_PLATFORMS": ""}, BARE, None),  # The user's choice, even empty (JAX's "any").
        ({"JAX_PLATFORMS": "cuda"}, BARE, None),
        ({}, BARE, "tpu"),  # Set in the process already (--jax_platforms, jax.config).
        ({}, Host("Linux", CUDA, True, ("/dev/nvidia0",)), None),
        ({}, Host("Linux", CUDA, True, ("/dev/kfd",)), None),
        ({}, Host("Linux", CUDA, True, ("/dev/vfio/0",)), None),
        ({}, Host("Linux", CUDA, True, ("/sys/bus/pci/devices/0000:00:04.0",)), None),
        ({}, Host("Darwin", CUDA, True, ()), None),  # Metal, or what this module cannot see.
        ({}, Host("Linux", (*CUDA, "jax_plugins.xla_rocm7"), True, ()), None),  # Unknown plugin.
        ({}, Host("Linux", (), False, ()), None),  # Only the CPU backend: nothing to skip.
    ],
)
def test_the_platforms_are_left_alone_unless_nothing_can_start(environ, host, jax_platforms):
  assert cpu_only_reason(environ, host, jax_platforms) is None


def _user_environment() -> dict[str, str]:
  """The tests' environment as a user's shell has it: no JAX_PLATFORMS, C++ logs at INFO."""
  drop = ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")
  return {k: v for k, v in os.environ.items() if k not in drop}


def _assert_quiet(stderr: str) -> None:
  for noise in (
      "Traceback",
      "Unable to load",
      "plugin configuration error",
      "E0000",
      "unexpected worker hostname",
      "Failed to find host bounds",
  ):
    assert noise not in stderr, stderr


@pytest.mark.slow
@pytest.mark.skipif(not EXTRA_INSTALLED, reason="needs the preflight extra (CUDA plugin, libtpu)")
@pytest.mark.skipif(not NO_ACCELERATOR, reason="this host has a GPU or TPU")
def test_a_run_with_the_extra_on_a_cpu_host_prints_no_traceback(tmp_path, repo_root):
  # A run that starts JAX's backends (joining the runtime, counting the devices) and then stops
  # at a config check: one line on stderr, and nothing from the plugins.
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.main",
          "--config=configs/quickstart.py",
          f"--workdir={tmp_path / 'run'}",
          "--config.optimizer.learning_rate=-1",
      ],
      cwd=repo_root,
      env=_user_environment(),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 2, result.stderr
  assert "optimizer.learning_rate" in result.stderr
  _assert_quiet(result.stderr)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
@pytest.mark.skipif(not NO_ACCELERATOR, reason="this host has a GPU or TPU")
@pytest.mark.parametrize("users_hostnames", [None, "localhost"])
def test_describing_a_tpu_slice_without_a_tpu_prints_no_libtpu_errors(repo_root, users_hostnames):
  script = (
      "import jax\n"
      "jax.config.update('jax_platforms', 'cpu')\n"
      "from trainkit.preflight.targets import TARGETS, devices\n"
      "target = TARGETS['v5e-16']\n"
      "found = devices(target)\n"
      "hosts = sorted({d.process_index for d in found})\n"
      "print('described:', len(found), hosts == list(range(target.num_hosts)), len(hosts))\n"
      "import os\n"
      "names = ('TPU_WORKER_HOSTNAMES', 'TPU_HOST_BOUNDS')\n"
      "print('left:', [k for k in names if k in os.environ])\n"
  )
  environment = _user_environment()
  if users_hostnames:
    environment["TPU_WORKER_HOSTNAMES"] = users_hostnames
  result = subprocess.run(
      [sys.executable, "-c", script],
      cwd=repo_root,
      env=environment,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stderr
  # The slice described is the one asked for (16 chips on 4 hosts), not this one host.
  assert "described: 16 True 4" in result.stdout, result.stdout
  # Nothing of ours is handed on to the processes started later; a user's own value stays.
  left = "['TPU_WORKER_HOSTNAMES']" if users_hostnames else "[]"
  assert f"left: {left}" in result.stdout, result.stdout
  _assert_quiet(result.stderr)


def test_a_mesh_too_large_for_the_host_is_recognised_by_its_message():
  """tests/conftest.py skips a test on an accelerator host with fewer devices than its mesh: the
  two messages it recognises are the real ones, on this jax (CPU: 8 fake devices)."""
  import jax

  from conftest import devices_missing
  from trainkit.errors import ConfigError
  from trainkit.mesh import mesh_shape

  with pytest.raises(ConfigError) as too_many:
    mesh_shape({"data": 16, "expert": 1}, jax.device_count())
  with pytest.raises(ConfigError) as product:
    mesh_shape({"data": 4, "expert": 4}, jax.device_count())
  with pytest.raises(ValueError) as make_mesh:
    jax.make_mesh((2 * jax.device_count(),), ("data",))
  for error in (too_many.value, product.value, make_mesh.value):
    assert devices_missing(error), str(error)
  assert not devices_missing(ConfigError("mesh.data", "must be a positive integer or -1, got 0"))
