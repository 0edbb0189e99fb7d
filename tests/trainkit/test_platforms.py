"""The preflight's compilers (libtpu, the CUDA plugin) stay off the import path of every process
but the preflight's (trainkit/preflight/compilers.py), and describe a TPU slice quietly."""

import importlib.metadata
import importlib.util
import os
import re
import runpy
import subprocess
import sys

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO_ROOT
from trainkit.preflight import compilers
from trainkit.preflight.targets import TARGETS, devices, tpu_signs

# What JAX loads as a backend plugin, and probes for hardware at its first device use.
JAX_PLUGIN = re.compile(r"libtpu|jax-(cuda|rocm)\d+-(plugin|pjrt)")


def _reached(requirements: list[str]) -> set[str]:
  """The distributions `requirements` bring, transitively, as far as this environment has them
  installed (one not installed here is named, not followed)."""
  seen, todo = set(), [Requirement(r) for r in requirements]
  while todo:
    requirement = todo.pop()
    key = (canonicalize_name(requirement.name), *sorted(requirement.extras))
    if key in seen:
      continue
    seen.add(key)
    try:
      requires = importlib.metadata.requires(key[0]) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    for child in map(Requirement, requires):
      if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in key[1:] or [""]):
        todo.append(child)
  return {name for name, *_ in seen}


def test_the_base_install_and_the_paper_extras_bring_no_jax_plugin():
  setup_args = {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(setuptools, "setup", lambda **kwargs: setup_args.update(kwargs))
    runpy.run_path(str(REPO_ROOT / "setup.py"), run_name="__main__")
  extras = setup_args["extras_require"]
  for extra, requirements in [("base", []), *extras.items()]:
    plugins = {
        name
        for name in _reached(setup_args["install_requires"] + requirements)
        if JAX_PLUGIN.fullmatch(name)
    }
    assert not plugins, (extra, plugins)
  # The walk finds them where they are asked for.
  assert {"libtpu", "jax-cuda12-plugin"} <= set(_reached(["jax[tpu,cuda12-local]"]))


@pytest.mark.slow
@pytest.mark.compile_tpu
@pytest.mark.compile_gpu
def test_where_the_compilers_are_installed_a_users_script_prints_only_its_answer(tmp_path):
  devices(TARGETS["v5e-8"])  # This process loads libtpu; the script below is its child.
  script = (
      "import importlib.util, jax\n"
      "print(importlib.util.find_spec('libtpu'), jax.devices()[0].platform)"
  )
  result = subprocess.run(
      [sys.executable, "-c", script],
      cwd=tmp_path,
      env=_user_environment(),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert (result.returncode, result.stderr, result.stdout) == (0, "", "None cpu\n")
  assert compilers.add_to_path() and importlib.util.find_spec("libtpu") is not None


@pytest.mark.slow
def test_compilers_the_index_cannot_give_are_one_line_with_pips_reason():
  # --no-index, and no pip configuration (a machine's find-links would still be read): pip
  # reaches nothing, as offline, so it resolves nothing and installs nothing.
  pip_free = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  result = subprocess.run(
      [sys.executable, "-m", "trainkit.preflight.compilers", "--no-index", "--no-cache-dir"],
      env={**pip_free, "PIP_CONFIG_FILE": os.devnull},
      capture_output=True,
      text=True,
      timeout=300,
  )
  jax = importlib.metadata.version("jax")
  assert (result.returncode, result.stdout) == (1, "")
  assert result.stderr.startswith(f"error: pip found no libtpu and CUDA plugin for jax {jax}: ")
  assert "(from versions: none)" in result.stderr and result.stderr.count("\n") == 1


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
@pytest.mark.compile_tpu
@pytest.mark.skipif(bool(tpu_signs()), reason="this host has a TPU")
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
