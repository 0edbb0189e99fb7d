"""Tests run on 8 fake CPU devices so multi-device code paths are exercised without accelerators."""

import importlib.metadata
import os
import tempfile

# The tests' programs are small and run a few steps, so compiling them is most of the suite's
# time, and most of a compile is LLVM optimising the CPU code. The tests compile without those
# passes: XLA's own (fusion, layout, sharding) still run, so the programs are what a user's run
# computes; only the machine code is slower, and its rounding may differ as it does from one
# processor to another, which every tolerance already allows (docs/reliability.md). A test that
# starts a process on one device gives it ONE_DEVICE_XLA_FLAGS, so that the flags a user set
# (`XLA_FLAGS=--xla_cpu_max_isa=AVX2 pytest`) reach it too.
TEST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA splits each program's LLVM module into up to 32 parts to generate code on several threads;
# with a test process per core, the parts' set-up costs more than the threads save (test_remat and
# test_moe_algorithms from a cold cache, CPU-s: 46 and 52 against 62 and 56 on the pinned stack,
# 94 and 97 against 96 and 108 on the newest; `XLA_FLAGS=--xla_cpu_parallel_codegen_split_count=32
# pytest -q -p no:xdist -m "not slow" FILES` puts XLA's default back). The programs are the same;
# only how their functions are grouped for code generation changes.
TEST_COMPILE_FLAGS += " --xla_cpu_parallel_codegen_split_count=1"
# The pinned jaxlib (0.10) still has XLA's elemental emitters beside the MLIR fusion emitters
# that replaced them: they turn the same fused HLO into machine code in about half the time (the
# pinned stack's test_methods, test_remat, test_moe_algorithms and test_causal_models: 50 s
# against 91 s from a cold cache). jaxlib 0.12 has only the fusion emitters, and XLA aborts on a
# flag it does not know.
_JAXLIB = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
if _JAXLIB < (0, 11):
  TEST_COMPILE_FLAGS += " --xla_cpu_use_fusion_emitters=false"
# The user's flags come after ours, so that theirs win (XLA takes a flag's last value).
# pytest-xdist's workers inherit the XLA_FLAGS this file set in the main process: ours and the
# device count are taken out of them again, so that they are not counted as the user's.
_USER_XLA_FLAGS = [
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if flag not in TEST_COMPILE_FLAGS.split()
    and not flag.startswith("--xla_force_host_platform_device_count=")
]
ONE_DEVICE_XLA_FLAGS = " ".join([TEST_COMPILE_FLAGS, *_USER_XLA_FLAGS])
os.environ["XLA_FLAGS"] = f"{ONE_DEVICE_XLA_FLAGS} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With the CUDA plugin loaded (the compile_gpu tests), XLA logs at INFO from C++; the tests read
# stderr.
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

import jax  # noqa: E402,F401

from trainkit.preflight import compilers  # noqa: E402

# The preflight's compilers (python -m trainkit.preflight.compilers) for the compile_tpu and
# compile_gpu tests in this process: before JAX starts its backends, after jax's import (which
# would load libtpu, and libtpu sets TPU_LIBRARY_PATH for every child). The `python -m ...`
# processes the tests start find them as a user's do.
compilers.add_to_path()

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
ENDE = SHARED_DATA / "translation" / "wmt14_ende_opennmt"
# The OpenNMT En-De sample cut to a few seconds of work: the data keys of a tiny translation run.
ENDE_TINY_DATA = {
    "data.train_source": str(ENDE / "src-train.txt"),
    "data.train_target": str(ENDE / "tgt-train.txt"),
    "data.eval_source": str(ENDE / "src-val.txt"),
    "data.eval_target": str(ENDE / "tgt-val.txt"),
    "data.unescape": True,
    "data.max_train_examples": 128,
    "data.max_eval_examples": 16,
    "data.vocab_size": 200,
}
# A translation model and beam search of a few seconds' work (with ENDE_TINY_DATA or a copy).
ENDE_TINY_MODEL = {
    "data.max_source_len": 12,
    "data.max_target_len": 12,
    "nmt.max_decode_len": 8,
    "nmt.beam_size": 2,
    "model.dim": 16,
    "model.num_layers": 1,
    "model.num_decoder_layers": 1,
    "model.num_heads": 2,
    "model.mlp_dim": 16,
    "batch_size": 8,
    "eval_batch_size": 8,
}

# This project's modules, as a regex over a warning's module (tests/e2e/test_deprecations.py).
OWN_MODULES = r"(fairmoe_jax|causal_attn_jax|trainkit|paper_runner)(\.|$)"
DEPRECATIONS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")
# `python -c STRICT_RUNNER module args...` runs a package's main with every deprecation attributed
# to our modules raised as an error.
STRICT_RUNNER = f"""
import runpy, sys, warnings
for category in ({", ".join(DEPRECATIONS)}):
  warnings.filterwarnings("error", category=category, module={OWN_MODULES!r})
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown():
  # Tracing makes many short-lived objects, and each of Python's full garbage collections walks
  # every live one: what the imports and each finished test leave alive (jit caches, module
  # fixtures) is frozen once its cycles are collected, as trainkit.cli.run freezes a run's
  # start-up. test_moe_algorithms, test_expert_parallel and test_moe_layer_options in one process
  # (`pytest -q -p no:xdist -m "not slow" FILES`, warm cache), CPU-s: 50.9, 54.1, 47.0, 49.4
  # against 59.8, 57.6, 50.5, 47.9 freezing only after the collection.
  gc.collect()
  gc.freeze()


def pytest_configure(config):
  # A deprecated call from our own code is an error in every test, on either stack (README,
  # "Tested versions").
  for category in DEPRECATIONS:
    config.addinivalue_line("filterwarnings", f"error::{category}:{OWN_MODULES}")


# The suite runs on the CPU (CI) and, with JAX_PLATFORMS=cuda or tpu, on a lent accelerator
# (docs/benchmarks.md, "The tests on a lent GPU"). Two things differ there, neither a defect of
# the code under test:
# - XLA's default float32 matmul on a GPU is TF32 (10-bit mantissa) and on a TPU bf16 passes,
#   not float32: a test whose tolerance is derived from float32's rounding (marked
#   `float32_reference`) asks for full precision; the CPU computes float32 whatever is asked.
# - A test that builds a mesh of the 8 fake CPU devices cannot on a host with fewer devices: it
#   is skipped there, naming what it needed. On the CPU, where 8 are forced, it fails as usual.
@pytest.fixture(autouse=True)
def _float32_matmuls_for_float64_references(request):
  if request.node.get_closest_marker("float32_reference") is None:
    yield
    return
  import jax

  if jax.default_backend() == "cpu":
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


_TOO_FEW_DEVICES = (
    re.compile(r"needs (\d+) devices but only (\d+) are available"),  # trainkit's ConfigError.
    re.compile(r"Number of devices (\d+) must be >= the product of mesh_shape"),  # jax.make_mesh.
)


def devices_missing(error: BaseException) -> bool:
  """Whether `error` says a mesh needs more devices than the host has."""
  return any(pattern.search(str(error)) for pattern in _TOO_FEW_DEVICES)


# A test not marked slow starts no Python process, and uses no fixture that did: the fast tier's
# promise (pytest.ini). Popen is wrapped for the whole session.
_python_started: list[str] = []
_fixtures_that_started_python: set[str] = set()
_popen_init = subprocess.Popen.__init__


def _popen_init_recording(self, args, *rest, **kwargs):
  argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
  words = os.fsdecode(argv[0]).split() if argv else []
  program = os.path.basename(words[0]) if words else ""
  if program.startswith("python"):
    _python_started.append(" ".join(os.fsdecode(a) for a in argv[:4]))
  _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _popen_init_recording


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
  _python_started.clear()
  return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
  started = len(_python_started)
  result = yield
  if len(_python_started) > started:
    _fixtures_that_started_python.add(fixturedef.argname)
  return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  try:
    result = yield
  except Exception as error:
    if not devices_missing(error):  # Checked first: most failures never touch jax here.
      raise
    import jax

    if jax.default_backend() == "cpu":
      raise
    pytest.skip(
        f"needs more devices than this {jax.default_backend()} host's {jax.device_count()}: "
        f"{str(error).splitlines()[0][:200]}"
    )
  if item.get_closest_marker("slow") is None:
    if _python_started:
      pytest.fail(f"starts a Python process but is not marked slow: {_python_started[0]}")
    if used := _fixtures_that_started_python.intersection(item.fixturenames):
      pytest.fail(f"uses fixtures that start a Python process but is not marked slow: {used}")
  return result


# CPU-scale FairSMoE on the CelebA sample (with --config.data.root): seconds of training.
FAIR_TINY_ARGS = [
    "--config.data.sensitive=Male",
    "--config.data.image_size=32",
    "--config.data.max_examples_per_split=96",
    "--config.model.dim=32",
    "--config.model.depth=1",
    "--config.model.patch_size=8",
    "--config.batch_size=32",
    "--config.eval_batch_size=32",
    "--config.plots=false",  # 2 CPU-s a run: QUICKSTART_RUN_ARGS draw them.
]
# The quickstart cut to seconds of training (tests of whole runs in several folders).
QUICKSTART_TINY_ARGS = [
    "--config.data.train_size=512",
    "--config.data.val_size=64",
    "--config.data.test_size=128",
    "--config.model.dim=32",
    "--config.model.depth=2",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.batch_size=32",
    "--config.eval_batch_size=64",
    "--config.plots=false",  # 2 CPU-s a run: QUICKSTART_RUN_ARGS draw them.
]


def one_device_env() -> dict[str, str]:
  """The environment of a `python -m ...` run on one CPU device, as on a user's laptop."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device, as on a user's laptop.
  env["PYTHONUNBUFFERED"] = "1"
  return env


# The reduced quickstart's whole run, shared by the tests that read one (tests/e2e/test_cli.py,
# test_deprecations.py, tests/fairmoe_jax/test_predictions.py): each process pays for imports,
# cache loads and compiles, while the steps cost little. Its length is also test_cli.py's runs'
# (the schedule's length is part of the train step: one compile in the persistent cache).
QUICKSTART_STEPS = 30
QUICKSTART_RUN_ARGS = [
    f"--config={REPO_ROOT / 'configs/quickstart.py'}:steps={QUICKSTART_STEPS}",
    *QUICKSTART_TINY_ARGS,
    "--config.eval_every_steps=15",
    "--config.log_every_steps=10",
    "--config.fair.review_every_steps=10",
    "--config.eval.intersections=sex*age",
    "--config.eval.min_group_size=10",
    "--config.plots=true",
]


# A dense (multifair: a plain ViT) run of the tiny quickstart on the images without cues, shared by
# tests/fairmoe_jax/test_export.py and tests/benchmarks/test_synthetic_stats.py.
DENSE_RUN_STEPS = 4
DENSE_RUN_ARGS = [
    f"--config={REPO_ROOT / 'configs/quickstart.py'}:steps={DENSE_RUN_STEPS},cues=false",
    *QUICKSTART_TINY_ARGS,
    "--config.method=multifair",
    "--config.eval_every_steps=0",
    "--config.analysis_batches=0",
]


def _session_run(tmp_path_factory, name: str, args: list[str]) -> types.SimpleNamespace:
  """`python -m fairmoe_jax.main` (our deprecations raised as errors, for test_deprecations.py)
  run once per session into a workdir `name`: `.workdir` and the finished process `.result`. A
  test that writes into the workdir copies it first (shutil.copytree). Under pytest-xdist the
  workers share one run: the first to need it trains it while the others wait on a lock
  (xdist's documented recipe)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # This session's folder, above each worker's own.
  workdir, saved = root / name, root / f"{name}.json"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not saved.exists():
      result = subprocess.run(
          [sys.executable, "-c", STRICT_RUNNER, "fairmoe_jax.main", f"--workdir={workdir}", *args],
          cwd=REPO_ROOT,
          env=one_device_env(),
          capture_output=True,
          text=True,
          timeout=600,
      )
      saved.write_text(json.dumps(vars(result)))
  _fixtures_that_started_python.add(name)  # Here or by another worker: slow either way.
  result = subprocess.CompletedProcess(**json.loads(saved.read_text()))
  return types.SimpleNamespace(workdir=workdir, result=result)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
  """The reduced quickstart trained once (_session_run)."""
  return _session_run(tmp_path_factory, "quickstart_run", QUICKSTART_RUN_ARGS)


@pytest.fixture(scope="session")
def dense_run(tmp_path_factory):
  """DENSE_RUN_ARGS trained once (_session_run); its returncode checked here."""
  run = _session_run(tmp_path_factory, "dense_run", DENSE_RUN_ARGS)
  assert run.result.returncode == 0, run.result.stderr[-3000:]
  return run


# A tiny Causal Transformer (model, vocabulary and data) so a run takes seconds.
CAUSAL_TINY_ARGS = [
    "--config.model.dim=16",
    "--config.model.num_layers=1",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=16",
    "--config.data.vocab_size=200",
    "--config.data.max_len=24",
    "--config.data.max_train_examples=256",
    "--config.data.max_eval_examples=64",
    "--config.batch_size=16",
    "--config.eval_batch_size=32",
    "--config.log_every_steps=2",
    "--config.eval_every_steps=0",
    "--config.checkpoint_every_steps=4",
    "--config.plots.num_examples=1",
]


@pytest.fixture
def repo_root() -> pathlib.Path:
  return REPO_ROOT


@pytest.fixture
def private_compilation_cache(tmp_path):
  """JAX's persistent compilation cache in a folder of this test's own (the suite's is shared by
  every worker), used in this process before the test begins and keeping every entry; the
  suite's cache settings come back afterwards."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  keys = (
      "jax_compilation_cache_dir",
      "jax_enable_compilation_cache",
      "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes",
  )
  saved = {key: getattr(jax.config, key) for key in keys}
  folder = tmp_path / "xla_cache"
  for key, value in zip(keys, (str(folder), True, 0, 0)):
    jax.config.update(key, value)
  compilation_cache.reset_cache()
  jax.jit(lambda x: x + 1)(jax.numpy.ones(3)).block_until_ready()  # The cache is now in use.
  try:
    yield folder
  finally:
    for key, value in saved.items():
      jax.config.update(key, value)
    compilation_cache.reset_cache()


# The CUDA plugin (trainkit.preflight.compilers; CI installs it) logs these lines from C++, before
# any log set-up, whenever a process that can import it starts JAX without a GPU; no setting
# silences them. They are not the program's output: the tests that read a subprocess's stderr (one
# error line, no traceback) read it without them.
_CUDA_PLUGIN_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your "
    r"machine, GPU will not be used\.)$"
)


def without_cuda_plugin_log(text):
  if not isinstance(text, str):
    return text
  lines = text.splitlines(keepends=True)
  return "".join(line for line in lines if not _CUDA_PLUGIN_LOG.match(line.rstrip("\n")))


_run = subprocess.run


def _run_without_cuda_plugin_log(*args, **kwargs):
  result = _run(*args, **kwargs)
  if isinstance(result.stderr, str):
    result.stderr = without_cuda_plugin_log(result.stderr)
  if isinstance(result.stdout, str) and kwargs.get("stderr") == subprocess.STDOUT:
    result.stdout = without_cuda_plugin_log(result.stdout)
  return result


@pytest.fixture(autouse=True)
def _cuda_plugin_log_removed(monkeypatch):
  monkeypatch.setattr(subprocess, "run", _run_without_cuda_plugin_log)


@contextlib.contextmanager
def small_disk(tmp_path, megabytes: int):
  """A real filesystem of `megabytes` (a tmpfs), or a skip where mounting is not allowed."""
  mount_point = tmp_path / "small_disk"
  mount_point.mkdir()
  mounted = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", f"size={megabytes}M", "tmpfs", str(mount_point)],
      capture_output=True,
  )
  if mounted.returncode != 0:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    yield mount_point
  finally:
    subprocess.run(["umount", str(mount_point)], check=False)


# What each compiler marker needs, and the line its skip says (pytest.ini names the markers): a
# compiled-program guard skips only for the compiler it lacks.
_COMPILERS = {
    "compile_tpu": (
        "libtpu",
        "no TPU compiler: libtpu is not installed (python -m trainkit.preflight.compilers)",
    ),
    "compile_gpu": (
        "jax_cuda12_plugin",
        "no GPU compiler: the CUDA plugin is not installed "
        "(python -m trainkit.preflight.compilers)",
    ),
}
E2E = REPO_ROOT / "tests" / "e2e"


def pytest_collection_modifyitems(config, items):
  import importlib.util

  for item in items:
    if E2E in item.path.parents:
      item.add_marker(pytest.mark.slow)
    for marker, (module, reason) in _COMPILERS.items():
      if item.get_closest_marker(marker) and importlib.util.find_spec(module) is None:
        item.add_marker(pytest.mark.skip(reason=reason))
