"""The preflight (`--mode=compile`): a run compiled for a TPU slice or GPU node without one.

The TPU and GPU devices come from libtpu and the CUDA plugin (trainkit.preflight.compilers),
described on this CPU; nothing runs on them. What is checked: the memory accounting against a hand
count, the refusal of a run that does not fit (by the TPU compiler, and by our own check on a GPU,
whose compiler does not refuse), the collectives of expert parallelism, the FLOP count and the HLO
reading against simple references.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import REPO_ROOT
from fairmoe_jax import data as data_lib
from fairmoe_jax.methods import METHODS
from fairmoe_jax.preflight import batch_spec, dataset_info, preflight_program
from trainkit.errors import USER_ERROR_EXIT_CODE, ConfigError, UserError
from trainkit.mesh import make_mesh
from trainkit.prefetch import DEFAULT_PREFETCH, resident_batches
from trainkit.preflight import analysis
from trainkit.preflight.compile import (
    MEMORY_KEYS,
    does_not_fit_message,
    fallback_peak,
    host_rows,
    memory_keys,
    persistent_cache_off,
    preflight,
    summary,
    validate_preflight,
)
from trainkit.preflight.targets import TARGETS, devices, get_target


def quickstart(**overrides):
  path = REPO_ROOT / "configs" / "quickstart.py"
  spec = importlib.util.spec_from_file_location("quickstart", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("steps=10")
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def param_bytes_by_hand(config) -> tuple[int, int]:
  """(bytes of all parameters, of the experts' stacked weights), from a real model."""
  info = dataset_info(config)
  model = METHODS[config.method].build_model(config, info, nnx.Rngs(params=0), None)
  total = expert = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    total += size
    names = "/".join(str(getattr(k, "key", k)) for k in path)
    if re.search(r"/mlp/(w1|w2|b1|b2)/", names) and leaf.shape[0] == config.moe.num_experts:
      expert += size
  return total, expert


def _shapes(batch):
  return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()}


def test_the_declared_batches_are_the_pipelines():
  config = quickstart(batch_size=16, eval_batch_size=8)
  info, splits = data_lib.load_synthetic(
      image_size=32, num_classes=4, seed=0, sizes={"train": 32, "val": 16, "test": 16}
  )
  assert dataset_info(config) == info  # From the config alone, the loader's own description.
  train = next(
      data_lib.train_iterator(splits["train"], global_batch_size=16, image_size=32, seed=0)
  )
  assert _shapes(batch_spec(config, info, 16, eval=False)) == _shapes(train)
  evaluation = next(iter(data_lib.eval_batches(splits["val"], batch_size=8, image_size=32)))
  assert _shapes(batch_spec(config, info, 8, eval=True)) == _shapes(evaluation)


@pytest.mark.slow
@pytest.mark.compile_tpu
def test_quickstart_on_a_tpu_slice_with_expert_parallelism():
  # The train step alone: the refused run below compiles an eval step on this slice.
  config = quickstart(
      **{
          "preflight.target": "v5e-8",
          "preflight.eval_step": False,
          "mesh.expert": 2,
          "moe.dispatch": "sort",
      }
  )
  record = preflight(config, preflight_program)
  assert record["fits"] and record["mesh"] == {"data": 4, "expert": 2}
  assert record["batch"] == {
      "global": 128,
      "per_host": 128,
      "per_device": 16,
      "eval_global": 256,
      "host_rows": [[0, 128]],
  }
  train = record["train_step"]
  # Experts over two devices: tokens travel to their experts and back.
  assert "all-to-all" in train["collectives"] and train["collectives"]["all-to-all"]["count"] >= 2
  # Parameters: each device holds the replicated ones and half of the experts'.
  total, expert = param_bytes_by_hand(config)
  assert expert > 0
  memory = train["memory"]
  assert memory["parameters"] == total - expert + expert // 2
  # AdamW: two moments per parameter, plus two int32 step counters (Adam's, the schedule's).
  assert memory["optimizer_state"] == 2 * memory["parameters"] + 2 * 4
  assert memory["peak"] >= memory["parameters"] + memory["optimizer_state"] + memory["batch"]
  assert train["xla_cost"]["flops"] > 0 and train["roofline"]["bound_s"] > 0
  # Our matmul count is of the whole step on all devices; XLA's of one device's program, with
  # elementwise work and the optimiser besides: the same order of magnitude.
  per_device = train["matmul_flops_per_step"] / 8
  assert 0.2 < per_device / train["xla_cost"]["flops"] < 1.0
  assert record["run"]["device_hours"] > 0 and record["eval_step"]["skipped"]


@pytest.mark.slow
@pytest.mark.compile_gpu
def test_quickstart_on_an_h100_node(private_compilation_cache):
  before = sorted(private_compilation_cache.iterdir())
  # The train step alone: the eval step's compile is the TPU tests'.
  config = quickstart(**{"preflight.target": "h100x8", "preflight.eval_step": False})
  record = preflight(config, preflight_program)
  assert record["fits"] and record["target"]["devices"] == 8 and record["eval_step"]["skipped"]
  # The persistent cache is left as it was. A deviceless executable cannot be read back (no
  # client to load it into): writing one would only leave an entry that warns on every later
  # preflight of the same run.
  assert sorted(private_compilation_cache.iterdir()) == before
  train = record["train_step"]
  # GPU: no cost analysis of the compiled program; the optimised HLO's, read on this host.
  assert "xla_cost" not in train and train["optimized_hlo_cost"]["bytes accessed"] > 0
  assert train["bytes_accessed_source"].startswith("hlo cost analysis of the optimised program")
  assert train["flops_source"] != "xla cost analysis"
  assert "all-reduce" in train["collectives"]  # Data parallel: gradients are summed.
  # The bytes and FLOPs count the cuBLAS/cuDNN calls the cost analysis skips; the gradients'
  # all-reduce is priced on NVLink and lengthens the no-overlap step beyond the roofline's.
  split = train["cost_split"]
  assert split["library_calls"]["bytes accessed"] > 0 and split["library_calls"]["flops"] > 0
  assert train["bytes_accessed_per_device"] == pytest.approx(
      split["fusions"]["bytes accessed"] + split["library_calls"]["bytes accessed"]
  )
  run = record["run"]
  assert (
      train["collective_seconds"] > 0 and run["collective_seconds"] == train["collective_seconds"]
  )
  assert run["step_seconds"] == run["step_seconds_no_overlap"] > run["compute_step_seconds"]
  assert run["step_seconds_full_overlap"] == max(
      run["compute_step_seconds"], train["collective_seconds"]
  )
  assert run["device_hours"] > run["device_hours_full_overlap"] > 0
  assert "without overlap" in summary(record) and "with full overlap" in summary(record)
  # Where the bytes go: the parts sum to the step's, the gradients' all-reduce is collectives'.
  parts = train["cost_by_part"]
  assert sum(p["bytes accessed"] for p in parts.values()) == train["bytes_accessed_per_device"]
  assert parts["collectives"]["bytes accessed"] > 0 and parts["MoE block"]["flops"] > 0
  assert "bytes / FLOPs by part" in summary(record)
  # The band, and the jax and GEMM backend that compiled the estimate.
  low, high = run["device_hours_range"]
  assert low < run["device_hours"] < high
  assert f"compiled by jax {jax.__version__}; GEMMs: " in summary(record)
  assert record["provenance"]["gemm_backend"] == train["gemm_backend"]
  assert re.fullmatch(r"\d+ cuBLAS calls, \d+ Triton GEMM fusions.*", train["gemm_backend"])
  # The quickstart's data is generated in memory: no cores to feed it. A JPEG pipeline given
  # fewer cores per process than it needs is warned of.
  assert record["input"] is None
  fed = dict(examples_per_s_per_core=440.0, cores=1, cores_from="data.num_workers=0")
  short = dict(record, input=dict(fed, processes_per_host=8, cores_needed=5))
  assert "5 host cores per GPU (launch/slurm.sh --cpus-per-task)" in summary(short)
  assert "WARNING: data.num_workers=0 gives the input pipeline 1 core(s)" in summary(short)
  assert "WARNING" not in summary(dict(short, input=dict(short["input"], cores=5)))
  # The dispatch compiled is named, with the config's "auto" it was chosen for.
  dispatch = record["settings"]["moe.dispatch"]
  assert config.moe.dispatch == "auto" and record["settings_given"] == {"moe.dispatch": "auto"}
  assert f"moe.dispatch=auto (compiled: {dispatch})," in summary(record).splitlines()[0]
  total, _ = param_bytes_by_hand(config)
  assert train["memory"]["parameters"] == total
  # The fit counts the training batches a run keeps on each device, as trainkit.fits does: the
  # step's own (an argument of the program) and the DEFAULT_PREFETCH DevicePrefetch places
  # ahead of it.
  memory = train["memory"]
  assert memory["resident_batches"] == resident_batches(DEFAULT_PREFETCH) == DEFAULT_PREFETCH + 1
  assert memory["prefetched"] == DEFAULT_PREFETCH * memory["batch"] > 0
  assert memory["peak"] == memory["program_peak"] + memory["prefetched"]
  assert train["fits"] == (memory["peak"] <= record["target"]["usable_bytes"])
  assert f"and {DEFAULT_PREFETCH} prefetched ahead of it" in summary(record)
  # A GPU step compiled with the cuBLAS fallback says that a real run's program differs, and
  # where its temporaries 10% larger would not fit, that the run may not.
  caveat = "compiled with Triton GEMMs off"
  fallback = dict(
      record, train_step=dict(train, compiler_options={"xla_gpu_enable_triton_gemm": False})
  )
  line = summary(fallback).splitlines()[3]
  assert caveat in line and "may not fit" not in line
  scaled = memory["peak"] + 0.1078 * memory["temporaries"]
  assert fallback_peak(fallback) == pytest.approx(scaled, rel=1e-3)
  usable = (memory["peak"] + scaled) / 2  # Fits as compiled, not with the larger temporaries.
  tight = dict(fallback, target=dict(record["target"], usable_bytes=usable), fits=True)
  assert "a real run may not fit" in summary(tight).splitlines()[3]
  plain = dict(record, train_step={k: v for k, v in train.items() if k != "compiler_options"})
  assert caveat not in summary(plain) and fallback_peak(plain) is None


@pytest.mark.slow
@pytest.mark.compile_tpu
def test_a_run_the_tpu_compiler_refuses_is_reported_not_raised():
  # 64k images of 64 px on 8 chips of 16 GiB: the activations alone are ~3x the HBM.
  config = quickstart(
      **{
          "preflight.target": "v5e-8",
          "batch_size": 65536,
          "eval_batch_size": 64,
          "data.image_size": 64,
          "data.train_size": 65536,
      }
  )
  record = preflight(config, preflight_program)
  assert not record["fits"] and not record["train_step"]["fits"] and record["eval_step"]["fits"]
  assert "RESOURCE_EXHAUSTED" in record["train_step"]["refused_by_compiler"] or (
      "memory" in record["train_step"]["refused_by_compiler"]
  )
  # The compiler said how much the temporaries alone need: far over 16 GiB.
  assert record["train_step"]["memory"]["peak"] > 2 * 16 * 2**30
  message = does_not_fit_message(record)
  assert message.startswith("does not fit on v5e-8 (16.00 GiB usable per device)")
  assert "batch_size" in message and "short" in message
  # 8 chips: the experts can be split over more of them (the mesh already covers all 8).
  assert "mesh.expert" in message and "mesh.data" not in message


@pytest.mark.slow
@pytest.mark.compile_gpu
def test_an_oversized_run_on_a_gpu_is_one_error_naming_the_shortfall(tmp_path):
  # The GPU compiler compiles it anyway; our check against 1% of 80 GiB (the memory fraction
  # jax is given) refuses it. One block and no eval step: a small compile just over that.
  workdir = tmp_path / "w"
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.main",
          "--config=configs/quickstart.py:steps=10",
          "--mode=compile",
          "--config.preflight.target=h100x1",
          "--config.preflight.eval_step=False",
          "--config.model.depth=1",
          "--config.batch_size=2048",
          "--config.data.train_size=2048",
          f"--workdir={workdir}",
      ],
      capture_output=True,
      text=True,
      timeout=600,
      cwd=REPO_ROOT,
      env={**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.01"},
  )
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(error) == 1 and "Traceback" not in result.stderr
  assert error[0].startswith("error: does not fit on h100x1 (0.79 GiB usable per device)")
  assert "short" in error[0] and "batch_size" in error[0]
  # One GPU: no mesh key can help; the quickstart computes in float32 without remat.
  assert "mesh." not in error[0]
  assert "model.remat (now 'none'" in error[0] and "compute_dtype=bfloat16" in error[0]
  record = json.loads((workdir / "preflight.json").read_text())
  peak = record["train_step"]["memory"]["peak"]
  assert peak > record["target"]["usable_bytes"] and not record["fits"]
  assert "fits: NO" in result.stdout


@pytest.mark.compile_tpu
def test_each_host_of_a_slice_holds_the_rows_its_input_pipeline_reads():
  mesh = make_mesh({"data": -1, "expert": 4}, list(devices(get_target("v5e-16"))))
  assert host_rows(mesh, 256) == [[0, 64], [64, 128], [128, 192], [192, 256]]
  # Devices laid out host-interleaved: host 0 would hold rows another host's pipeline reads.
  shuffled = Mesh(
      np.asarray(devices(get_target("v5e-16")))[
          [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
      ].reshape(4, 4),
      ("data", "expert"),
  )
  with pytest.raises(
      RuntimeError, match=r"host 0's devices hold batch rows other than its block \[0, 64\)"
  ):
    host_rows(shuffled, 256)


@pytest.mark.compile_tpu
@pytest.mark.compile_gpu
def test_the_targets_describe_their_hosts():
  v5e16, h100x16 = get_target("v5e-16"), get_target("h100x16")
  assert [d.process_index for d in devices(v5e16)].count(0) == 4 and v5e16.num_hosts == 4
  assert sorted({d.process_index for d in devices(h100x16)}) == [0, 1]
  for target in TARGETS.values():
    assert target.num_devices % target.num_hosts == 0


# --- Reading programs, against simple references ------------------------------------------------


def test_matmul_flops_counts_dots_convolutions_scans_and_shard_map():
  x, w = jnp.ones((8, 64)), jnp.ones((64, 32))
  dense = jax.make_jaxpr(lambda w: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w))(w)
  # Forward x @ w, backward x.T @ g: 2 x 2 x 8 x 64 x 32.
  assert analysis.matmul_flops(dense)["flops"] == 4 * 8 * 64 * 32
  image, kernel = jnp.ones((2, 16, 16, 3)), jnp.ones((4, 4, 3, 8))
  conv = jax.make_jaxpr(
      lambda i, k: jax.lax.conv_general_dilated(
          i, k, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
  )(image, kernel)
  assert analysis.matmul_flops(conv)["flops"] == 2 * (2 * 4 * 4 * 8) * (4 * 4 * 3)
  scan = jax.make_jaxpr(
      lambda w: jax.lax.scan(lambda c, _: (c @ w, None), jnp.ones((8, 32)), None, length=5)[0]
  )(jnp.ones((32, 32)))
  assert analysis.matmul_flops(scan)["flops"] == 5 * 2 * 8 * 32 * 32
  mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
  sharded = jax.make_jaxpr(
      jax.shard_map(
          lambda a, b: a @ b, mesh=mesh, in_specs=(P("expert"), P()), out_specs=P("expert")
      )
  )(jnp.ones((16, 64)), jnp.ones((64, 32)))
  # Each of the 4 devices multiplies its 4 rows: the whole product, once.
  assert analysis.matmul_flops(sharded)["flops"] == 2 * 16 * 64 * 32
  loop = jax.make_jaxpr(
      lambda w: jax.lax.while_loop(
          lambda c: c[1] < 3, lambda c: (c[0] @ w, c[1] + 1), (jnp.ones((2, 4)), 0)
      )[0]
  )(jnp.ones((4, 4)))
  assert analysis.matmul_flops(loop) == {"flops": 2 * 2 * 4 * 4, "uncounted_loops": 1}


def test_collectives_are_read_from_hlo_text():
  hlo = "\n".join(
      [
          "  %all-reduce-start = (f32[1024,1024]{1,0}, bf16[16]{0}) all-reduce-start(%a, %b), channel_id=1",
          "  %all-reduce-done = (f32[1024,1024]{1,0}, bf16[16]{0}) all-reduce-done(%all-reduce-start)",
          "  %all-gather-start = (f32[8,4]{1,0}, f32[64,4]{1,0}) all-gather-start(%c), dimensions={0}",
          "  ROOT %all-to-all.3 = s32[4,2,6]{2,1,0} all-to-all(%d), dimensions={0}",
          "  %fusion = f32[4]{0} fusion(%all-to-all.3), kind=kLoop",
      ]
  )
  assert analysis.collectives(hlo) == {
      "all-gather": {"count": 1, "bytes": 64 * 4 * 4},
      "all-reduce": {"count": 1, "bytes": 1024 * 1024 * 4 + 16 * 2},
      "all-to-all": {"count": 1, "bytes": 4 * 2 * 6 * 4},
  }


def test_bytes_per_device_follow_the_sharding():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "expert"))
  tree = {
      "split": jax.ShapeDtypeStruct(
          (8, 6), jnp.float32, sharding=NamedSharding(mesh, P("data", "expert"))
      ),
      "whole": jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
  }
  assert analysis.bytes_per_device(tree) == 2 * 3 * 4 + 3 * 2


def test_without_the_plugins_the_preflight_says_what_to_install(monkeypatch):
  from jax.experimental import topologies

  def missing(**_):
    raise RuntimeError("Unknown backend tpu")

  monkeypatch.setattr(topologies, "get_topology_desc", missing)
  target = dataclasses.replace(get_target("v5e-8"), name="v5e-8-without-libtpu")
  with pytest.raises(UserError, match=r"needs libtpu: python -m trainkit\.preflight\.compilers"):
    devices(target)


@pytest.mark.slow
@pytest.mark.compile_tpu
def test_describing_a_slice_leaves_no_tpu_pod_variables_to_subprocesses():
  # libtpu sets TPU_WORKER_ID, CLOUD_TPU_TASK_ID, ... behind Python's back; a run started
  # afterwards from the same process would take itself for a TPU pod worker.
  script = (
      "import subprocess, jax\n"
      "from trainkit.preflight.targets import devices, get_target\n"
      "devices(get_target('v5e-8'))\n"
      "print(subprocess.run(['env'], capture_output=True, text=True).stdout)\n"
  )
  result = subprocess.run(
      [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  inherited = {line.partition("=")[0] for line in result.stdout.splitlines()}
  assert not inherited & {"TPU_WORKER_ID", "CLOUD_TPU_TASK_ID", "TPU_WORKER_HOSTNAMES"}


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        (
            "preflight.target",
            "v9-1024",
            r"preflight.target.*unknown target 'v9-1024'; known: v3-8, v4-8",
        ),
        ("preflight.utilization", -0.1, r"preflight.utilization"),
        ("preflight.utilization", float("nan"), r"preflight.utilization"),
        ("preflight.train_examples", -1, r"preflight.train_examples"),
    ],
)
def test_bad_preflight_keys_are_errors_naming_the_key(key, value, pattern):
  config = quickstart(**{key: value})
  with pytest.raises(ConfigError, match=pattern):
    validate_preflight(config)


def test_compile_without_a_target_names_the_key():
  config = quickstart()
  with pytest.raises(
      ConfigError, match=r"preflight.target.*name the target to compile for; known: v3-8, v4-8"
  ):
    preflight(config, preflight_program)


@pytest.mark.compile_gpu
def test_the_optimised_gpu_program_is_costed_from_its_text():
  target = get_target("h100x1")
  mesh = Mesh(np.array(devices(target)).reshape(1, 1), ("data", "expert"))
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
  x, w = spec((512, 256)), spec((256, 1024))
  with jax.set_mesh(mesh), persistent_cache_off():  # A deviceless program: as the preflight.
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, w).compile()
  assert analysis.cost(compiled) is None  # XLA's GPU compiler gives none.
  # One fusion of a product and a tanh (a transcendental: no FLOPs): 2MNK FLOPs, its operands
  # read and its result written.
  assert analysis.optimized_hlo_cost(compiled.as_text()) == {
      "flops": 2 * 512 * 256 * 1024,
      "bytes accessed": 4 * (512 * 256 + 256 * 1024 + 512 * 1024),
  }


def _refused(target: str, *, compute_dtype: str, remat: str, train: bool, eval: bool):
  """A record of a run that does not fit (the fields `does_not_fit_message` reads)."""
  t = get_target(target)
  step = lambda fits: {"fits": fits, "memory": {"peak": 2 * t.usable_bytes}}
  return {
      "target": {"name": t.name, "devices": t.num_devices, "usable_bytes": t.usable_bytes},
      "compute_dtype": compute_dtype,
      "remat": remat,
      "train_step": step(not train),
      "eval_step": step(not eval),
  }


@pytest.mark.compile_gpu
@pytest.mark.parametrize(
    "record, named, not_named",
    [
        # One H100 in bfloat16 without remat: the batch or remat can help; no mesh key, no dtype.
        (
            _refused("h100x1", compute_dtype="bfloat16", remat="none", train=True, eval=False),
            ["batch_size", "model.remat (now 'none'; 'dots' or 'block'"],
            ["compute_dtype", "mesh.", "eval_batch_size"],
        ),
        # At the strongest remat in float32: the batch or bfloat16.
        (
            _refused("h100x1", compute_dtype="float32", remat="block", train=True, eval=False),
            ["batch_size", "compute_dtype=bfloat16"],
            ["model.remat", "mesh."],
        ),
        # Eight GPUs: the experts may be split over more of them.
        (
            _refused("h100x8", compute_dtype="bfloat16", remat="dots", train=True, eval=False),
            ["batch_size", "model.remat (now 'dots'; 'block'", "mesh.expert", "of the 8 devices"],
            ["compute_dtype", "mesh.data"],
        ),
        # The eval step alone: remat (training only) and batch_size cannot help it.
        (
            _refused("h100x1", compute_dtype="bfloat16", remat="none", train=False, eval=True),
            ["eval_batch_size"],
            ["model.remat", "Change batch_size", "compute_dtype", "mesh."],
        ),
    ],
    ids=["h100x1-bf16", "h100x1-f32-block", "h100x8", "eval-only"],
)
def test_a_refusal_names_only_the_keys_that_can_help_on_its_target(record, named, not_named):
  message = does_not_fit_message(record)
  assert message.startswith(f"does not fit on {record['target']['name']}")
  keys = [re.split(r"[ =]", item)[0] for item in memory_keys(record)]
  assert keys and set(keys) <= set(MEMORY_KEYS)
  for text in named:
    assert text in message, (text, message)
  for text in not_named:
    assert text not in message, (text, message)


@pytest.mark.compile_gpu
def test_the_gpu_compiler_is_given_the_memory_jax_gives_a_program(capfd):
  # XLA's GPU compiler takes 80% of the described memory as its base limit when no client
  # passes its allocator's size (targets.py's docstring), and says so when a program's
  # arguments and outputs alone exceed it: the base it logs is the fit's usable bytes.
  target = get_target("h100x1")
  sharding = jax.sharding.SingleDeviceSharding(devices(target)[0])
  n = target.usable_bytes // 8 + 1024  # float32 argument and output: just over the usable bytes.
  x = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
  with persistent_cache_off():
    jax.jit(lambda x: x * 2).lower(x).compile()
  found = re.findall(r"exceeds the base limit \((\d+)\)", capfd.readouterr().err)
  assert found and {int(b) for b in found} == {target.usable_bytes}, found
  assert target.usable_bytes == int(target.memory_bytes * 0.75)


@pytest.mark.compile_tpu
@pytest.mark.compile_gpu
def test_xla_python_client_mem_fraction_sets_the_usable_memory_and_the_compilers(monkeypatch):
  from trainkit.preflight import targets  # pylint: disable=import-outside-toplevel

  def target_with(value):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    targets.gpu_memory_fraction.cache_clear()
    return get_target("h100x1")

  try:
    half = target_with("0.5")
    assert half.usable_fraction == 0.5 and half.usable_bytes == half.memory_bytes // 2
    described = int(re.search(r"device_memory_size: (\d+)", half.gpu_description).group(1))
    assert described * 80 // 100 == half.usable_bytes  # XLA's base limit.
    assert get_target("v5e-8").usable_fraction == 1.0  # TPUs: the compiler checks the fit.
    for bad in ("abc", "0", "1.5", "nan"):
      with pytest.raises(UserError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION=.*number in \(0, 1\]"):
        target_with(bad)
  finally:
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    targets.gpu_memory_fraction.cache_clear()
  assert get_target("h100x1") == TARGETS["h100x1"]


@pytest.mark.compile_gpu
@pytest.mark.parametrize(
    "mesh, key, pattern",
    [
        # Compiling for 2 of the 8 GPUs would print another run's per-device figures.
        (
            {"data": 2},
            "mesh.data",
            r"mesh.data=2 x mesh.expert=1 uses 2 of the 8 devices of h100x8, leaving 6 idle; "
            r"set mesh.data=-1, which fills them \(data=8 x expert=1\)",
        ),
        ({"data": 1, "expert": 4}, "mesh.data", r"uses 4 of the 8 devices.*data=2 x expert=4"),
        # The key the user set, not the -1 of mesh.data's default that cannot fill.
        ({"expert": 3}, "mesh.expert", r"3 does not divide the 8 devices.*one of 1, 2, 4, 8"),
    ],
)
def test_a_mesh_that_does_not_cover_the_target_is_refused_naming_the_key(mesh, key, pattern):
  # 12 experts divide over any of these expert axes: the mesh is refused for its coverage only.
  config = quickstart(**{"preflight.target": "h100x8", "moe.num_experts": 12})
  config.mesh.update(mesh)
  with pytest.raises(ConfigError, match=pattern) as e:
    preflight(config, preflight_program)
  assert e.value.key == key
