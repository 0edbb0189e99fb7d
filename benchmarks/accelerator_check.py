r"""One command for a lent GPU: the figures the preflight and the dispatch choice rest on.

  python benchmarks/accelerator_check.py --out=$OUT/accelerator_check.json    # a lent GPU, < 9 min
  python benchmarks/accelerator_check.py --size=tiny --out=/tmp/ac/check.json  # any CPU: the path

Parts, each measured on this machine's default JAX device (docs/benchmarks.md, "Accelerator
check", says how to run it on a lent GPU):

* `train_step`: the CelebA FairSMoE DeiT-S train step (`configs/celeba.py`, batch 256,
  bfloat16) on synthetic inputs: the program that `--mode=compile` compiles
  (`fairmoe_jax.preflight`'s Program: same model, loss, optimiser, schedule and uint8 batch),
  built for real and run for a few dozen steps. Measured peak memory
  (`memory_stats()["peak_bytes_in_use"]`; a CPU reports none) and step time (median of the timed
  steps after warm-up, each ended by `block_until_ready`) beside the preflight's prediction for
  `--target` (by default the one-device target of the chip the check finds, `h200x1` on an
  H200, else `h100x1`; compiled on this host's CPU, in a process of its own, as
  `--mode=compile --config.preflight.target=h100x1` compiles it), and their ratios;
* `moe_layer`: one MoE layer at DeiT-S scale (`benchmarks/moe_layer.py`'s cases: sort, einsum,
  dropless, V-MoE's own einsum and indices dispatchers where a google-research/vmoe checkout is
  found, else `vmoe_ref`, our re-creation of its layer, and the equal-FLOPs dense MLP), forward
  and backward, the cases alternated round by round in one process. The fastest of ours is what
  this platform's `moe.dispatch=auto` should be (`fairmoe_jax.methods.base.AUTO_DISPATCH`);
* `input_pipeline`: the training input pipeline's images/s on this host's cores
  (`benchmarks/input_pipeline.py`'s `uint8_one_pass` row, in-process and with one grain worker
  per core but one) beside the images/s the measured step consumes (batch / step time);
* `tests`: the test files of `DEVICE_TESTS` run by pytest on the device (JAX_PLATFORMS set to
  its platform): counts, and each failing test's line;
* `quickstart`: the README's quickstart on the device and on this host's CPU
  (JAX_PLATFORMS=cpu): test accuracy, last training loss and wall time of each.

Built for a lease of a few minutes: every unit (the prediction, the step, the layer, the
pipeline, the tests, each quickstart) runs in a process of its own, stopped at its share of the
time budget (`--budget_s`, 8 minutes by default at full size). The JSON (`--out`) and its markdown section
(the same path with `.md`, printed at the end) are rewritten after every unit, so a unit that
fails, hangs or crashes is recorded with its error, and with whatever it measured before
failing, while the others still report; units the remaining budget cannot hold are skipped, the
reason recorded. This process never touches the accelerator: each unit has all of it.

`--size=tiny` runs every part at toy sizes (vanilla SMoE instead of FairSMoE, which compiles
several times slower) in a minute or two on a CPU (tests/test_accelerator_check.py): its figures
test the path, not the hardware.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The project importable without an install (a lent machine gets a copy of the working tree).
if ROOT not in sys.path:
  sys.path.insert(1, ROOT)
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "accelerator_check.json")
# Where a google-research/vmoe checkout (the folder holding vmoe/) and real CelebA JPEGs
# (img_align_celeba/*.jpg) are looked for: beside the repository, or carried into .carry/.
PEER_CANDIDATES = (
    os.path.join(os.path.dirname(ROOT), "shared", "peers", "vmoe"),
    os.path.join(ROOT, ".carry", "vmoe"),
)
CELEBA_CANDIDATES = (
    os.path.join(os.path.dirname(ROOT), "shared", "data", "celeba"),
    os.path.join(ROOT, ".carry", "celeba"),
)
# The paper table's recorded preflight cells: what the step is compared with at full size when
# the prediction cannot be compiled here.
RECORDED_PREFLIGHT = os.path.join(ROOT, "results", "records", "preflight_paper.json")
RECORDED_CELL = "fairsmoe/deit_s@{target}"
GIB = 2**30
CELEBA_IMAGE_SIZE = (178, 218)  # Width, height of CelebA's aligned images.
# What the units import that a machine's image may lack (then they travel as wheels).
PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "array-record",
    "ml-collections",
    "tensorboardX",
    "numpy",
)
PARTS = ("train_step", "moe_layer", "input_pipeline", "tests", "quickstart")
# The test files a lent device runs (docs/benchmarks.md, "The tests on a lent GPU"): the layers,
# routers, dispatches, attention and training steps against their references. Those that
# compare float32 with float64 ask for full matmul precision there, and those that need the 8
# fake CPU devices skip on a host with fewer (tests/conftest.py).
DEVICE_TESTS = tuple(
    f"tests/test_{name}.py"
    for name in (
        "moe_algorithms", "moe", "routers", "causal_attention", "gelu", "vit", "swin",
        "fairness_metrics", "decoding", "moe_layer_options", "remat", "optim", "causal_models",
        "dropless_tpu", "methods", "fairness_training", "constraints",
    )
)
# A failing test's line kept in the record: enough to sort the failures by cause.
FAILURE_CHARS = 240
OURS = ("sort", "einsum", "dropless")  # What `moe.dispatch=auto` may choose on a GPU.
# Lines of the units' output not worth echoing (XLA's start-up chatter where CUDA is absent).
NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")


@dataclasses.dataclass(frozen=True)
class Size:
  """What each part runs at one `--size`."""

  train_config: str  # FILE[:ARG], relative to the repository root.
  train_overrides: dict[str, Any]
  batch_size: int
  warmup_steps: int  # Steps before the timed ones: compilation, autotuning, first allocations.
  timed_steps: int
  moe_shape: str  # A key of moe_layer.SHAPES.
  moe_experts: tuple[int, ...]
  moe_top_k: int
  moe_repeats: int
  pipeline_image_size: int
  pipeline_batch_size: int
  pipeline_batches: int  # Per row, and 2 more per worker: many workers need a longer run.
  pipeline_workers: tuple[str, ...]  # Counts, or "cores": a worker per core of this host but one.
  quickstart_config: str
  quickstart_overrides: tuple[str, ...]
  device_tests: tuple[str, ...]  # pytest arguments: files, or a file and -k.
  budget_s: float
  use_unit_minimum: bool  # Whether a unit needs its `min_s` of the budget left to start.


SIZES = {
    "full": Size(
        train_config="configs/celeba.py",
        train_overrides={},
        batch_size=256,
        warmup_steps=3,
        timed_steps=30,
        moe_shape="deit_s",
        moe_experts=(4, 64),  # The paper config's 4, and many experts.
        moe_top_k=2,
        moe_repeats=20,
        pipeline_image_size=224,
        pipeline_batch_size=256,
        pipeline_batches=4,
        pipeline_workers=("0", "cores"),
        quickstart_config="configs/quickstart.py",
        quickstart_overrides=(),
        device_tests=DEVICE_TESTS,
        budget_s=480.0,
        use_unit_minimum=True,
    ),
    "tiny": Size(
        train_config="configs/celeba.py:size=small,method=vanilla_smoe",
        train_overrides={"model.depth": 1},
        batch_size=8,
        warmup_steps=1,
        timed_steps=2,
        moe_shape="tiny",
        moe_experts=(4,),
        moe_top_k=2,
        moe_repeats=2,
        pipeline_image_size=32,
        pipeline_batch_size=8,
        pipeline_batches=2,
        pipeline_workers=("0",),
        quickstart_config="configs/quickstart.py:steps=2",
        # tests/test_cli.py's tiny model and dataset: every phase of the run, in seconds.
        quickstart_overrides=(
            "--config.method=vanilla_smoe",
            "--config.data.train_size=64",
            "--config.data.val_size=32",
            "--config.data.test_size=32",
            "--config.model.dim=16",
            "--config.model.depth=1",
            "--config.model.num_heads=2",
            "--config.model.mlp_dim=32",
            "--config.batch_size=16",
            "--config.eval_batch_size=32",
            "--config.log_every_steps=1",
            "--config.analysis_batches=0",  # No gradient-conflict analysis: one compile less.
        ),
        device_tests=("tests/test_gelu.py", "-k", "float64_reference"),
        budget_s=900.0,
        use_unit_minimum=False,
    ),
}


@dataclasses.dataclass(frozen=True)
class Unit:
  """One process's work: `part`'s `name`. At full size it is stopped after `cap_s` seconds and
  not started with less than `min_s` of the budget left (too little to finish, at a guess)."""

  part: str
  name: str
  cap_s: float
  min_s: float
  platform: str  # "device" (JAX's default backend) or "cpu" (JAX_PLATFORMS=cpu).


# In order of what the figures decide: the preflight's calibration first, then the dispatch,
# the pipeline, the tests, and the quickstart, whose CPU run is the longest and the least needed.
UNITS = (
    Unit("environment", "probe", 60, 10, "device"),
    Unit("train_step", "prediction", 150, 30, "cpu"),
    Unit("train_step", "measured", 200, 60, "device"),
    Unit("moe_layer", "layer", 180, 45, "device"),
    Unit("input_pipeline", "throughput", 90, 20, "cpu"),
    # From a cold compilation cache the 17 files took over 240 s on an H200 (315 of 316 run at
    # 241 s, 2026-11-28), then 74 s with the cache warm.
    Unit("tests", "device", 330, 60, "device"),
    Unit("quickstart", "device", 150, 30, "device"),
    Unit("quickstart", "cpu", 200, 45, "cpu"),
)

# ---------------------------------------------------------------------------------------------
# The units, each run in a child process (`--run_unit=PART.NAME`): it fills `record` and calls
# `save()` whenever it has something worth keeping. They import JAX and the project inside, so
# that the parent, which never touches the accelerator, imports neither.


def _load_train_config(size: Size, args: argparse.Namespace) -> Any:
  """The CelebA run's config at this size, the same for the prediction and the measurement."""
  import train_step  # benchmarks/train_step.py

  config = train_step.load_config(size.train_config)
  config.batch_size = size.batch_size
  config.compute_dtype = "bfloat16"
  for key, value in size.train_overrides.items():
    *path, leaf = key.split(".")
    node = config
    for name in path:
      node = node[name]
    node[leaf] = value
  config.mesh.data, config.mesh.expert = 1, 1  # One device: the target's and this machine's.
  config.preflight.target = args.target
  config.preflight.eval_step = False  # The train step is what is measured.
  return config


def unit_environment(args: argparse.Namespace, record: dict, save: Callable[[], None]) -> None:
  """The device, JAX, and the versions of the packages the other units import."""
  from importlib import metadata

  packages: dict[str, str | None] = {}
  for name in PACKAGES:
    try:
      packages[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      packages[name] = None
  record["packages"] = packages
  save()
  import jax

  device = jax.devices()[0]
  record.update(
      device_kind=str(device.device_kind),
      platform=device.platform,
      device_count=jax.device_count(),
      jax=jax.__version__,
      python=platform.python_version(),
      host=platform.node(),
      host_cores=_cores(),
      memory_stats=device.memory_stats() is not None,
  )


def _cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def unit_train_step_prediction(
    args: argparse.Namespace, record: dict, save: Callable[[], None]
) -> None:
  """The run's `--mode=compile` for `--target`, in this process (on the CPU)."""
  from fairmoe_jax import config as fairmoe_config
  from fairmoe_jax.preflight import preflight_program
  from trainkit.preflight.compile import preflight
  from trainkit.preflight.targets import get_target

  size = SIZES[args.size]
  config = _load_train_config(size, args)
  target = get_target(args.target)
  fairmoe_config.validate(
      config, num_devices=target.num_devices, num_processes=target.num_hosts, check_data=False
  )
  record["command"] = _preflight_command(size, args)
  record.update(prediction_summary(preflight(config, preflight_program)))
  record["source"] = "compiled in this run"


def _preflight_command(size: Size, args: argparse.Namespace) -> str:
  """The `--mode=compile` command whose record the prediction unit makes in-process."""
  overrides = "".join(f" --config.{k}={v}" for k, v in size.train_overrides.items())
  return (
      f"python -m fairmoe_jax.main --config={size.train_config} --mode=compile "
      f"--config.preflight.target={args.target} --config.preflight.eval_step=False "
      f"--config.batch_size={size.batch_size} --config.compute_dtype=bfloat16{overrides} "
      "--workdir=DIR"
  )


def prediction_summary(record: dict) -> dict:
  """The preflight record's figures a measurement can check, and the record itself."""
  target, run = record.get("target") or {}, record.get("run") or {}
  train = record.get("train_step") or {}
  memory, roofline = train.get("memory") or {}, train.get("roofline") or {}
  return {
      "target": target.get("name"),
      "target_device_kind": target.get("device_kind"),
      "usable_bytes": target.get("usable_bytes"),
      "fits": record.get("fits"),
      # The fit's peak adds the batches the input pipeline places ahead of the step; the
      # program's is the step's own, what one step on synthetic inputs can reach.
      "peak_bytes": memory.get("peak"),
      "program_peak_bytes": memory.get("program_peak"),
      "step_seconds": run.get("step_seconds"),
      "utilization": run.get("utilization"),
      "roofline_seconds": roofline.get("bound_s"),
      "bound_by": roofline.get("bound_by"),
      "flops_per_step": train.get("flops_per_device"),
      "bytes_accessed_per_step": train.get("bytes_accessed_per_device"),
      "dispatch": (record.get("settings") or {}).get("moe.dispatch"),
      "compile_seconds": train.get("compile_seconds"),
      "provenance": record.get("provenance"),
      "record": record,
  }


def recorded_prediction(target: str) -> dict | None:
  """The paper table's recorded preflight cell of the full-size run on `target`, if any."""
  cell = RECORDED_CELL.format(target=target)
  try:
    with open(RECORDED_PREFLIGHT) as f:
      entry = json.load(f)["cells"][cell]
  except (OSError, KeyError, ValueError):
    return None
  return {
      "target": target,
      "peak_bytes": entry.get("peak"),
      "program_peak_bytes": None,
      "step_seconds": entry.get("step_s"),
      "utilization": entry.get("utilization"),
      "roofline_seconds": entry.get("roofline_s"),
      "bound_by": entry.get("bound_by"),
      "dispatch": (entry.get("settings") or {}).get("moe.dispatch"),
      "source": f"{os.path.relpath(RECORDED_PREFLIGHT, ROOT)} {cell} ({entry.get('date')}, "
      f"commit {entry.get('commit')})",
  }


def _synthetic_batch(spec: dict, info: Any, seed: int = 0) -> dict:
  """Random inputs of the Program's train batch: uint8 pixels, valid labels and groups."""
  import numpy as np

  rng = np.random.default_rng(seed)
  batch = {}
  for key, s in spec.items():
    n = s.shape[0]
    if key == "image":
      batch[key] = rng.integers(0, 256, s.shape, dtype=np.uint8)
    elif key == "label":
      batch[key] = rng.integers(0, info.num_classes, n).astype(s.dtype)
    elif key == "attributes":
      columns = [rng.integers(0, len(groups), n) for groups in info.group_names]
      batch[key] = np.stack(columns, axis=1).astype(s.dtype)
    else:  # The mask: every example counts.
      batch[key] = np.ones(s.shape, s.dtype)
  return batch


def unit_train_step_measured(
    args: argparse.Namespace, record: dict, save: Callable[[], None]
) -> None:
  """The preflight's program built for real on this device, run on synthetic inputs."""
  import jax

  import bench_utils
  import train_step
  from fairmoe_jax import config as fairmoe_config
  from fairmoe_jax.preflight import dataset_info, preflight_program
  from fairmoe_jax.train import create_state
  from trainkit.mesh import make_mesh, shard_batch
  from trainkit.optim import learning_rate_schedule, make_optimizer
  from trainkit.train_state import jit_train_step, make_train_step

  size = SIZES[args.size]
  config = _load_train_config(size, args)
  fairmoe_config.validate(config, num_devices=1, check_data=False)
  device = jax.devices()[0]
  mesh = make_mesh(config.mesh, [device])
  info = dataset_info(config)
  program = preflight_program(config, mesh)
  # The step count sets the learning-rate schedule's values only; counted as the preflight
  # counts it, so that the program is the same.
  steps = config.num_train_steps
  examples = config.preflight.train_examples or program.train_examples
  if config.num_epochs > 0 and examples:
    steps = max(1, math.ceil(config.num_epochs * examples / config.batch_size))
  tx = make_optimizer(config.optimizer, steps, config.batch_size)
  schedule = learning_rate_schedule(config.optimizer, steps, config.batch_size)
  record.update(
      config=size.train_config,
      method=config.method,
      backbone=config.model.backbone,
      batch_size=config.batch_size,
      compute_dtype=config.compute_dtype,
      image_size=config.data.image_size,
      dispatch=program.settings.get("moe.dispatch"),
      device_kind=str(device.device_kind),
  )
  save()
  graphdef, state = create_state(config, info, tx, mesh, pretrained=False)
  train = make_train_step(graphdef, program.loss_fn, tx, schedule, program.update_extra)
  inputs = shard_batch(_synthetic_batch(program.train_batch, info), mesh)
  t0 = time.perf_counter()
  compiled = jit_train_step(train, state, mesh).lower(state, inputs).compile()
  record["compile_seconds"] = time.perf_counter() - t0
  record["compiled_memory"] = bench_utils.memory_analysis(compiled)
  save()
  step = train_step._Step(compiled, state, inputs)  # pylint: disable=protected-access
  for _ in range(size.warmup_steps):
    jax.block_until_ready(step())
  # bench_utils' timing runs one more warm-up call, then times each step to its end.
  _, [times] = bench_utils.time_interleaved([step], size.timed_steps)
  step_s = statistics.median(times)
  record.update(
      warmup_steps=size.warmup_steps + 1,
      timed_steps=len(times),
      step_seconds=step_s,
      step_min_seconds=min(times),
      step_max_seconds=max(times),
      images_per_s=config.batch_size / step_s,
  )
  stats = device.memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    record["peak_bytes"] = int(stats["peak_bytes_in_use"])  # The process's: this unit's alone.
    record["bytes_limit"] = stats.get("bytes_limit")
  else:
    record["peak_bytes"] = None
    record["peak_note"] = f"{device.platform} reports no memory_stats: no measured peak"


def _find_peer(args: argparse.Namespace) -> str | None:
  if args.peer_vmoe:
    return args.peer_vmoe
  for path in PEER_CANDIDATES:
    if os.path.isfile(os.path.join(path, "vmoe", "moe.py")):
      return path
  return None


def unit_moe_layer(args: argparse.Namespace, record: dict, save: Callable[[], None]) -> None:
  """moe_layer.py's cases at this size, timed alternately; the fastest of ours at each E."""
  import jax

  import moe_layer  # benchmarks/moe_layer.py
  from fairmoe_jax.methods.base import AUTO_DISPATCH

  size = SIZES[args.size]
  peer, path = None, _find_peer(args)
  if path is None:
    record["peer"] = {"error": f"no google-research/vmoe checkout in {', '.join(PEER_CANDIDATES)}"}
  else:
    try:
      peer = moe_layer.import_peer_vmoe(path)
      record["peer"] = {"path": path}
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except  # SystemExit: no vmoe/.
      record["peer"] = {"path": path, "error": f"{type(e).__name__}: {e}"}
  references = list(moe_layer.PEER_ROWS) if peer is not None else [moe_layer.REFERENCE]
  cases = [(None, moe_layer.BASELINE)]
  cases += [(e, d) for e in size.moe_experts for d in (*references, *OURS)]
  record.update(
      shape=size.moe_shape,
      groups_tokens_dim_hidden=list(moe_layer.SHAPES[size.moe_shape]),
      top_k=size.moe_top_k,
      dtype="bfloat16",
      capacity_factor=1.25,
      repeats=size.moe_repeats,
      rows=[],
      errors=[],
  )
  runs = []
  for num_experts, dispatch in cases:
    try:
      row, compiled, call_args = moe_layer.compile_case(
          size.moe_shape, num_experts, size.moe_top_k, dispatch, "bfloat16", 1.25, peer=peer
      )
    except Exception as e:  # pylint: disable=broad-except  # One case's failure costs that case.
      error = f"{type(e).__name__}: {e}"
      record["errors"].append({"num_experts": num_experts, "dispatch": dispatch, "error": error})
      save()
      continue
    print(f"  E={num_experts} {dispatch}: compiled in {row['compile_s']:.1f} s", flush=True)
    record["rows"].append(row)
    runs.append((compiled, call_args))
    save()
  for row, timing in zip(record["rows"], moe_layer.time_interleaved(runs, size.moe_repeats)):
    row.update(timing)
  moe_layer.add_ratios(record["rows"])
  save()
  fastest = {}
  for num_experts in size.moe_experts:
    timed = [r for r in record["rows"] if r["num_experts"] == num_experts and r["time_ms"]]
    ours = [r for r in timed if r["dispatch"] in OURS]
    if ours:
      best = min(ours, key=lambda r: r["time_ms"])
      overall = min(timed, key=lambda r: r["time_ms"])
      fastest[str(num_experts)] = {
          "ours": best["dispatch"],
          "ours_ms": best["time_ms"],
          "overall": overall["dispatch"],
          "overall_ms": overall["time_ms"],
      }
  platform_name = jax.devices()[0].platform
  current = AUTO_DISPATCH.get(platform_name, "sort")
  winners = {f["ours"] for f in fastest.values()}
  record["fastest"] = fastest
  record["auto"] = {
      "platform": platform_name,
      "current": current,
      # One dispatch fastest at every E decides; a split says so (None).
      "fastest": next(iter(winners)) if len(winners) == 1 else None,
      "agrees": winners == {current},
  }


def _jpeg_source(size: Size, args: argparse.Namespace, scratch: str) -> tuple[str, str]:
  """(a folder holding img_align_celeba/*.jpg, what they are): real CelebA files where found,
  else synthetic JPEGs of CelebA's size written under `scratch`."""
  needed = 2 * size.pipeline_batch_size
  for root in [args.data_root] if args.data_root else CELEBA_CANDIDATES:
    if len(glob.glob(os.path.join(root, "img_align_celeba", "*.jpg"))) >= needed:
      return root, f"CelebA JPEG files in {root}"
  import numpy as np
  from PIL import Image

  folder = os.path.join(scratch, "img_align_celeba")
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  width, height = CELEBA_IMAGE_SIZE
  yy, xx = np.mgrid[0:height, 0:width]
  for i in range(needed):
    # Smooth shapes and mild noise: about a photograph's entropy; white noise would decode
    # slower than any face.
    phase = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack(
        [127 + 80 * np.sin(xx / (17 + 5 * c) + yy / (23 + 3 * c) + phase[c]) for c in range(3)],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)
  return scratch, f"{needed} synthetic {width}x{height} JPEG files (no CelebA files found)"


def unit_input_pipeline(args: argparse.Namespace, record: dict, save: Callable[[], None]) -> None:
  """input_pipeline.py's default row, in this process and with a worker per core but one."""
  import numpy as np
  from absl import flags

  import input_pipeline  # benchmarks/input_pipeline.py

  size = SIZES[args.size]
  cores = _cores()
  workers = [max(1, cores - 1) if w == "cores" else int(w) for w in size.pipeline_workers]
  flags.FLAGS.mark_as_parsed()  # grain hands its absl flags to worker processes.
  with tempfile.TemporaryDirectory() as scratch:
    root, source = _jpeg_source(size, args, scratch)
    paths = sorted(glob.glob(os.path.join(root, "img_align_celeba", "*.jpg")))
    split = {
        "path": np.array(paths, dtype=object),
        "label": np.zeros(len(paths), np.int32),
        "attributes": np.zeros((len(paths), 1), np.int32),
    }
    record.update(source=source, host_cores=cores, image_size=size.pipeline_image_size, rows=[])
    for count in dict.fromkeys(workers):
      settings = argparse.Namespace(
          batch_size=size.pipeline_batch_size,
          image_size=size.pipeline_image_size,
          batches=size.pipeline_batches + 2 * count,
      )
      record["rows"].append(input_pipeline.measure("uint8_one_pass", split, settings, count))
      print(f"  {count} worker(s): {record['rows'][-1]['images_per_s']} images/s", flush=True)
      save()


UNIT_FUNCTIONS = {
    "environment.probe": unit_environment,
    "train_step.prediction": unit_train_step_prediction,
    "train_step.measured": unit_train_step_measured,
    "moe_layer.layer": unit_moe_layer,
    "input_pipeline.throughput": unit_input_pipeline,
}


def run_unit(args: argparse.Namespace) -> int:
  """The child process: runs one unit, saving its record as it goes; 1 if it failed."""
  record: dict[str, Any] = {}

  def save() -> None:
    _write_json(args.unit_out, record)

  try:
    UNIT_FUNCTIONS[args.run_unit](args, record, save)
    if args.inject_failure in (args.run_unit, args.run_unit.split(".")[0]):
      # After the unit's figures: the test sees that they are kept and the error is said.
      raise RuntimeError(f"injected failure (--inject_failure={args.inject_failure})")
  except BaseException as e:  # pylint: disable=broad-except  # Recorded, and the exit says so.
    record["error"] = f"{type(e).__name__}: {e}".strip()
    record["traceback"] = traceback.format_exc()[-3000:]
    save()
    traceback.print_exc()
    return 1
  save()
  return 0


# ---------------------------------------------------------------------------------------------
# The parent: runs the units one after the other within the budget and writes what they found.


def _write_json(path: str, data: Any) -> None:
  """Written whole or not at all: a unit stopped mid-write leaves its previous save."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(data, f, indent=2, default=str)
  os.replace(temporary, path)


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


_running: list[subprocess.Popen] = []  # The unit in progress, stopped if this process is.


def _stop(process: subprocess.Popen) -> None:
  """Kills the unit's process group: its own workers (grain's) go with it."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    process.kill()
  process.wait()


def _on_signal(signum: int, _: Any) -> None:
  for process in _running:
    _stop(process)
  raise SystemExit(128 + signum)


def run_process(
    command: list[str], env: dict[str, str], timeout: float
) -> tuple[int | None, str, float]:
  """(exit code, None if stopped at `timeout`; the output's tail; seconds). The output is echoed
  as it comes, indented, so that a long unit shows its progress."""
  start = time.perf_counter()
  process = subprocess.Popen(  # pylint: disable=consider-using-with
      command,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors="replace",
      # A process group of its own, so that a timeout stops its workers too; the same session,
      # so that whatever stops this command's session stops the unit as well.
      process_group=0,
  )
  _running.append(process)
  tail: collections.deque[str] = collections.deque(maxlen=60)

  def echo() -> None:
    for line in process.stdout:
      tail.append(line)
      if not any(n in line for n in NOISE):
        print(f"    {line.rstrip()}", flush=True)

  reader = threading.Thread(target=echo, daemon=True)
  reader.start()
  code: int | None
  try:
    code = process.wait(timeout=max(timeout, 1.0))
  except subprocess.TimeoutExpired:
    code = None
    _stop(process)
  finally:
    _running.remove(process)
  reader.join(timeout=10)
  return code, "".join(tail)[-4000:], time.perf_counter() - start


def _environment(platform_name: str) -> dict[str, str]:
  from trainkit.distributed import child_environment  # pylint: disable=import-outside-toplevel

  # This process touched JAX (libtpu may have set placeholders a child would take for a pod).
  env = child_environment({"PYTHONUNBUFFERED": "1"})
  if platform_name == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  return env


def _outcome(record: dict, code: int | None, tail: str, seconds: float, failed: str) -> dict:
  """`record` with its status (ok, timeout, error), error and output tail where it failed."""
  record["seconds"] = round(seconds, 1)
  if code == 0 and not failed:
    record["status"] = "ok"
    return record
  if code is None:
    record.update(status="timeout", error=f"stopped after {seconds:.0f} s, its share of the budget")
  elif code == 0:
    record.update(status="error", error=failed)
  else:
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    record["status"] = "error"
    record.setdefault("error", f"exit code {code}: {lines[-1] if lines else 'no output'}")
  record["output_tail"] = tail[-2000:]
  return record


def run_child(unit: Unit, args: argparse.Namespace, scratch: str, timeout: float) -> dict:
  """`unit` in a child process of this script: its record, status and seconds."""
  name = f"{unit.part}.{unit.name}"
  unit_out = os.path.join(scratch, f"{name}.json")
  command = [
      sys.executable,
      os.path.abspath(__file__),
      *args.forwarded,
      f"--run_unit={name}",
      f"--unit_out={unit_out}",
  ]
  code, tail, seconds = run_process(command, _environment(unit.platform), timeout)
  return _outcome(_read_json(unit_out), code, tail, seconds, failed="")


def run_device_tests(unit: Unit, args: argparse.Namespace, scratch: str, timeout: float) -> dict:
  """The test files of `Size.device_tests` on the device: counts, and each failure's line."""
  size = SIZES[args.size]
  junit = os.path.join(scratch, "device_tests.xml")
  platform_name = {"gpu": "cuda"}.get(args.device_platform, args.device_platform)
  workers = max(1, min(12, _cores() - 1)) if args.size == "full" else 1
  command = [
      # No pytest-benchmark (the GPU image has it): under xdist it warns once per worker.
      sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
      f"--junitxml={junit}",
      *(["-n", str(workers)] if workers > 1 else []), *size.device_tests,
  ]
  env = dict(_environment(unit.platform), JAX_PLATFORMS=platform_name)
  if workers > 1:  # Several processes share the device: none may take most of its memory.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  shown = shlex.join(["python", *command[1:]]).replace(junit, "FILE")
  record: dict[str, Any] = {"command": f"JAX_PLATFORMS={platform_name} {shown}"}
  code, tail, seconds = run_process(command, env, timeout)
  record.update(junit_summary(junit))
  if not record.get("tests"):  # Stopped before pytest wrote its report: what its progress shows.
    record.update(progress_summary(tail))
  failed = "" if record.get("tests") else "no test report"
  if code == 1 and record.get("tests"):  # Tests failed: recorded above, not a crash.
    failed = f"{record['failed'] + record['errors']} of {record['tests']} tests failed"
    code = 0
  return _outcome(record, code, tail, seconds, failed=failed)


# A line of pytest -q's progress: one character per test, then the share done.
_PROGRESS_LINE = re.compile(r"^([.sxXFE]+)(\s+\[\s*\d+%\])?$")


def progress_summary(output: str) -> dict:
  """How many tests had run, and failed, by pytest -q's progress lines in `output`; {} if none.
  What a run stopped before its report still says (the lines are counted, not the report's)."""
  marks = "".join(
      match.group(1)
      for match in map(_PROGRESS_LINE.match, (line.strip() for line in output.splitlines()))
      if match
  )
  if not marks:
    return {}
  return {"ran_before_stop": len(marks), "failed_before_stop": marks.count("F") + marks.count("E")}


def junit_summary(path: str) -> dict:
  """pytest's JUnit XML as counts and one line per failing test; {} where there is none."""
  import xml.etree.ElementTree as ElementTree  # pylint: disable=import-outside-toplevel

  try:
    root = ElementTree.parse(path).getroot()
  except (OSError, ElementTree.ParseError):
    return {}
  counts = collections.Counter()
  failures = []
  for case in root.iter("testcase"):
    counts["tests"] += 1
    problem = case.find("failure")
    if problem is None:
      problem = case.find("error")
    if case.find("skipped") is not None:
      counts["skipped"] += 1
    elif problem is not None:
      counts["failed" if problem.tag == "failure" else "errors"] += 1
      test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
      message = " ".join((problem.get("message") or "").split())[:FAILURE_CHARS]
      failures.append({"test": test, "message": message})
  return {
      "tests": counts["tests"],
      "passed": counts["tests"] - counts["skipped"] - counts["failed"] - counts["errors"],
      "failed": counts["failed"],
      "errors": counts["errors"],
      "skipped": counts["skipped"],
      "failures": failures,
  }


def run_quickstart(unit: Unit, args: argparse.Namespace, scratch: str, timeout: float) -> dict:
  """The README's quickstart command on `unit.platform`: its report's figures and wall time."""
  size = SIZES[args.size]
  workdir = os.path.join(scratch, f"quickstart_{unit.name}")
  command = [
      sys.executable,
      "-m",
      "fairmoe_jax.main",
      f"--config={size.quickstart_config}",
      f"--workdir={workdir}",
      *size.quickstart_overrides,
  ]
  shown = shlex.join(["python", *command[1:]]).replace(workdir, "DIR")
  record: dict[str, Any] = {
      "command": ("JAX_PLATFORMS=cpu " if unit.platform == "cpu" else "") + shown
  }
  code, tail, seconds = run_process(command, _environment(unit.platform), timeout)
  record["wall_seconds"] = round(seconds, 1)
  report = _read_json(os.path.join(workdir, "report.json"))
  if report:
    record.update(
        test_accuracy=report.get("accuracy"),
        test_examples=report.get("num_examples"),
        mf_pqd=(report.get("mf") or {}).get("pqd"),
        # What docs/report.md's quickstart table lists for each run (FairSMoE's mechanisms).
        mf_dp=(report.get("mf") or {}).get("dp"),
        routing_by_group=report.get("routing_by_group"),
        sa_classifiers=report.get("sa_classifiers"),
        sa_branch=report.get("sa_branch"),
    )
  training = [m for m in _read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in m]
  if training:
    record.update(
        steps=training[-1].get("step"),
        final_loss=training[-1].get("loss"),
        examples_per_second=training[-1].get("examples_per_second"),
    )
  return _outcome(record, code, tail, seconds, failed="" if report else "no report.json")


def _read_jsonl(path: str) -> list[dict]:
  rows = []
  try:
    with open(path) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          pass  # A torn last line.
  except OSError:
    pass
  return rows


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def _prediction(train: dict) -> dict:
  """The prediction the step is compared with: this run's, else the recorded one."""
  predicted = train.get("prediction") or {}
  if predicted.get("status") != "ok" and train.get("recorded_prediction"):
    return train["recorded_prediction"]
  return predicted


def derive(result: dict) -> None:
  """The comparisons across units: measured over predicted, the pipeline beside the step."""
  train = result["parts"]["train_step"]
  measured, predicted = train.get("measured") or {}, _prediction(train)
  step_s = measured.get("step_seconds")
  if step_s and predicted.get("step_seconds"):
    peak = measured.get("peak_bytes")
    train["ratios"] = {
        "source": predicted.get("source"),
        "peak_over_program_peak": _ratio(peak, predicted.get("program_peak_bytes")),
        "peak_over_fit_peak": _ratio(peak, predicted.get("peak_bytes")),
        "step_over_predicted_step": _ratio(step_s, predicted["step_seconds"]),
        "step_over_roofline": _ratio(step_s, predicted.get("roofline_seconds")),
        # The share of the roofline bound this device reached: the preflight's `utilization`.
        "implied_utilization": _ratio(predicted.get("roofline_seconds"), step_s),
        "same_dispatch": measured.get("dispatch") == predicted.get("dispatch"),
        # A prediction for another chip (an explicit --target) compares different hardware.
        "same_chip": _same_chip(measured.get("device_kind"), predicted.get("target_device_kind")),
    }
  pipeline = result["parts"]["input_pipeline"]
  rows = (pipeline.get("throughput") or {}).get("rows") or []
  if rows and measured.get("images_per_s"):
    best = max(rows, key=lambda r: r["images_per_s"])
    per_core = max(r["images_per_s_per_core"] for r in rows)
    pipeline["vs_step"] = {
        "step_images_per_s": measured["images_per_s"],
        "pipeline_images_per_s": best["images_per_s"],
        "pipeline_workers": best["workers"],
        "pipeline_over_step": best["images_per_s"] / measured["images_per_s"],
        "cores_to_feed_step": measured["images_per_s"] / per_core,
    }


def _same_chip(measured_kind: str | None, predicted_kind: str | None) -> bool | None:
  """Whether two device kinds name one chip (one may add to the other: "NVIDIA H100 80GB HBM3"
  and "NVIDIA H100"); None where either is unknown."""
  if not measured_kind or not predicted_kind:
    return None
  return measured_kind.startswith(predicted_kind) or predicted_kind.startswith(measured_kind)


def part_status(units: dict) -> str:
  """ok, skipped, error (a unit failed or timed out), partial or pending."""
  statuses = [u["status"] for u in units.values() if isinstance(u, dict) and "status" in u]
  if not statuses:
    return "pending"
  if all(s == "ok" for s in statuses):
    return "ok"
  if all(s == "skipped" for s in statuses):
    return "skipped"
  return "error" if any(s in ("error", "timeout") for s in statuses) else "partial"


# ---------------------------------------------------------------------------------------------
# The markdown section, for docs/benchmarks.md.


def _f(value: Any, digits: int = 2, scale: float = 1.0) -> str:
  if value is None:
    return "-"
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return str(value)
  return f"{value * scale:,.{digits}f}" if math.isfinite(value) else "-"


def _train_step_markdown(train: dict) -> list[str]:
  measured, predicted = train.get("measured") or {}, _prediction(train)
  ratios = train.get("ratios") or {}
  lines = [
      f"**Train step** ({train.get('status')}): `{measured.get('config', '?')}`, "
      f"{measured.get('method', '?')} {measured.get('backbone', '?')}, batch "
      f"{measured.get('batch_size', '?')}, {measured.get('compute_dtype', '?')}, dispatch "
      f"`{measured.get('dispatch', '?')}`, synthetic inputs; median of "
      f"{measured.get('timed_steps', '?')} steps after {measured.get('warmup_steps', '?')} "
      f"warm-up. Predicted for `{predicted.get('target') or '-'}`: "
      f"{predicted.get('source') or 'none'}.",
      "",
      "| | measured | predicted | measured / predicted |",
      "|---|---:|---:|---:|",
  ]
  rows = (
      ("peak memory (GiB), the step's program", "peak_bytes", "program_peak_bytes",
       "peak_over_program_peak", 1 / GIB),
      ("peak memory (GiB), with the prefetched batches", None, "peak_bytes",
       "peak_over_fit_peak", 1 / GIB),
      ("step time (ms)", "step_seconds", "step_seconds", "step_over_predicted_step", 1e3),
      ("roofline bound (ms)", None, "roofline_seconds", "step_over_roofline", 1e3),
  )
  for label, mine, theirs, ratio, scale in rows:
    lines.append(
        f"| {label} | {_f(measured.get(mine) if mine else None, 2, scale)} | "
        f"{_f(predicted.get(theirs), 2, scale)} | {_f(ratios.get(ratio))} |"
    )
  lines.append(f"| images/s | {_f(measured.get('images_per_s'), 0)} | | |")
  if ratios.get("implied_utilization") is not None:
    lines += [
        "",
        f"Share of the roofline bound reached: {ratios['implied_utilization']:.1%} (the "
        f"preflight assumes {_f(predicted.get('utilization'), 0, 100)}%).",
    ]
  if ratios.get("same_chip") is False:
    lines += [
        "",
        f"**The prediction is for another chip** ({predicted.get('target_device_kind')}; "
        f"measured on {measured.get('device_kind')}): the ratios compare different hardware.",
    ]
  return lines


def _moe_layer_markdown(moe: dict) -> list[str]:
  layer = moe.get("layer") or {}
  lines = [
      f"**MoE layer** ({moe.get('status')}): shape `{layer.get('shape', '?')}` (images, tokens, "
      f"dim, hidden = {layer.get('groups_tokens_dim_hidden', '?')}), top-{layer.get('top_k', '?')}"
      f", {layer.get('dtype', '?')}, forward and backward, median of {layer.get('repeats', '?')} "
      "alternated rounds.",
  ]
  if (layer.get("peer") or {}).get("error"):
    lines.append(
        f"V-MoE's own dispatchers not run ({layer['peer']['error']}); `vmoe_ref`, our "
        "re-creation of its layer, stands in."
    )
  lines += [
      "",
      "| E | dispatch | fwd+bwd (ms) | vs dense | scratch (MiB) |",
      "|---|---|---:|---:|---:|",
  ]
  for r in layer.get("rows", []):
    lines.append(
        f"| {_f(r.get('num_experts'), 0)} | {r['dispatch']} | {_f(r.get('time_ms'))} | "
        f"{_f(r.get('vs_dense'))} | {_f(r.get('temp_size_in_bytes'), 1, 2**-20)} |"
    )
  for e in layer.get("errors", []):
    lines.append(f"| {_f(e['num_experts'], 0)} | {e['dispatch']} | error: {e['error'][:80]} | | |")
  auto = layer.get("auto")
  if auto:
    fastest = ", ".join(
        f"E={e}: `{f['ours']}` ({f['ours_ms']:.2f} ms; fastest of all rows: `{f['overall']}`)"
        for e, f in layer.get("fastest", {}).items()
    )
    if auto["agrees"]:
      verdict = f"keep `{auto['current']}`"
    elif auto["fastest"]:
      verdict = f"`{auto['fastest']}` is faster than today's `{auto['current']}`"
    else:
      verdict = f"no one dispatch is fastest at every E (today `{auto['current']}`)"
    lines += ["", f"Fastest of ours: {fastest}. `moe.dispatch=auto` on {auto['platform']}: "
              f"{verdict}."]
  return lines


def _input_pipeline_markdown(pipeline: dict) -> list[str]:
  throughput = pipeline.get("throughput") or {}
  lines = [
      f"**Input pipeline** ({pipeline.get('status')}): `uint8_one_pass` at "
      f"{throughput.get('image_size', '?')} px, {throughput.get('source', '?')}; host "
      f"{throughput.get('host_cores', '?')} cores.",
      "",
      "| workers | images/s | images/s per core |",
      "|---:|---:|---:|",
  ]
  for r in throughput.get("rows", []):
    lines.append(
        f"| {r['workers']} | {_f(r['images_per_s'], 0)} | {_f(r['images_per_s_per_core'], 0)} |"
    )
  vs = pipeline.get("vs_step")
  if vs:
    lines += [
        "",
        f"The measured step consumes {vs['step_images_per_s']:,.0f} images/s; the pipeline gives "
        f"{vs['pipeline_images_per_s']:,.0f} with {vs['pipeline_workers']} workers "
        f"({vs['pipeline_over_step']:.2f}x the step); at the best per-core rate, "
        f"{vs['cores_to_feed_step']:.1f} cores feed the step.",
    ]
  return lines


def _tests_markdown(tests: dict) -> list[str]:
  run = tests.get("device") or {}
  if not run.get("tests"):
    why = run.get("error") or run.get("reason", "not run")
    if "ran_before_stop" in run:
      why += (f"; {run['ran_before_stop']} tests had run by then, "
              f"{run['failed_before_stop']} of them failing")
    return [f"**Tests on the device** ({tests.get('status')}): {why}"]
  lines = [
      f"**Tests on the device** ({tests.get('status')}): {run['passed']} passed, "
      f"{run['failed']} failed, {run['errors']} errors, {run['skipped']} skipped, in "
      f"{_f(run.get('seconds'), 0)} s.",
      "",
      "```bash",
      run.get("command", "?"),
      "```",
  ]
  if run["failures"]:
    lines += ["", "| failing test | message |", "|---|---|"]
    lines += [
        f"| `{f['test']}` | {f['message'].replace('|', '/')[:160]} |" for f in run["failures"][:30]
    ]
    if len(run["failures"]) > 30:
      lines.append(f"| ... {len(run['failures']) - 30} more in the JSON | |")
  return lines


def _quickstart_markdown(quick: dict) -> list[str]:
  on_device, on_cpu = quick.get("device") or {}, quick.get("cpu") or {}
  lines = [
      f"**Quickstart** ({quick.get('status')}): `{on_device.get('command', '?')}`",
      "",
      "| | device | CPU |",
      "|---|---:|---:|",
  ]
  same = "same run" if on_cpu.get("same_as_device") else None
  for label, key, digits in (
      ("wall time (s)", "wall_seconds", 1),
      ("test accuracy", "test_accuracy", 4),
      ("last training loss", "final_loss", 4),
      ("training examples/s (last log line)", "examples_per_second", 0),
  ):
    lines.append(
        f"| {label} | {_f(on_device.get(key), digits)} | {same or _f(on_cpu.get(key), digits)} |"
    )
  return lines


def markdown(result: dict) -> str:
  """The docs/benchmarks.md section of a result: device, date, JAX, command, then each part."""
  env, parts = result.get("environment") or {}, result["parts"]
  device = env.get("device_kind", "unknown device")
  lines = [
      f"### Accelerator check: {device}, {result['date']}",
      "",
      f"Device: {device} ({env.get('platform', '?')}, {env.get('device_count', '?')} device(s)); "
      f"host {env.get('host_cores', '?')} cores; JAX {env.get('jax', '?')}; Python "
      f"{env.get('python', '?')}; date {result['date']}; size `{result['size']}`; "
      f"{result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget.",
      "",
      "```bash",
      result["command"],
      *([result["compared_again"]] if result.get("compared_again") else []),
      "```",
  ]
  for part_lines in (
      _train_step_markdown(parts["train_step"]),
      _moe_layer_markdown(parts["moe_layer"]),
      _input_pipeline_markdown(parts["input_pipeline"]),
      _tests_markdown(parts.get("tests") or {}),
      _quickstart_markdown(parts["quickstart"]),
  ):
    lines += ["", *part_lines]
  problems = [
      f"- `{p}.{u}`: {r['status']}: {r.get('error') or r.get('reason', '')}"
      for p, units in [("environment", {"probe": env}), *parts.items()]
      for u, r in units.items()
      if isinstance(r, dict) and r.get("status") in ("error", "timeout", "skipped")
  ]
  if problems:
    lines += ["", "Not measured, or not all of it:", "", *problems]
  return "\n".join(lines) + "\n"


def _summary_line(unit: Unit, record: dict) -> str:
  """The unit's progress line, with its headline figures."""
  figures = ""
  if unit.part == "train_step" and record.get("step_seconds"):
    peak = record.get("program_peak_bytes" if unit.name == "prediction" else "peak_bytes")
    figures = f": peak {_f(peak, 2, 1 / GIB)} GiB, step {record['step_seconds'] * 1e3:.2f} ms"
  elif unit.part == "moe_layer" and record.get("fastest"):
    figures = ": fastest of ours " + ", ".join(
        f"E={e} {f['ours']}" for e, f in record["fastest"].items()
    )
  elif unit.part == "input_pipeline" and record.get("rows"):
    figures = ": " + ", ".join(
        f"{r['workers']} workers {r['images_per_s']:.0f} images/s" for r in record["rows"]
    )
  elif unit.part == "quickstart" and record.get("test_accuracy") is not None:
    figures = f": test accuracy {record['test_accuracy']:.4f}"
  elif unit.part == "environment" and record.get("device_kind"):
    figures = f": {record['device_kind']} ({record['platform']}), JAX {record['jax']}"
  why = record.get("error") or record.get("reason")
  return (
      f"{unit.part}.{unit.name}: {record['status']} in {record.get('seconds', 0):.0f} s"
      f"{figures}{f' ({why})' if why else ''}"
  )


def _skip_or_reuse(unit: Unit, args: argparse.Namespace, result: dict, left: float) -> dict | None:
  """The record of a unit that is not run (not asked for, no time, given, or the same run as
  another); None if it is to be run."""
  size = SIZES[args.size]
  if unit.part != "environment" and unit.part not in args.part_list:
    return {"status": "skipped", "reason": f"not in --parts={args.parts}"}
  if left < max(unit.min_s if size.use_unit_minimum else 0.0, 1.0):
    budget = result["budget_s"]
    reason = f"time budget: {max(left, 0):.0f} of {budget:.0f} s left"
    return {"status": "skipped", "reason": reason}
  if unit.name == "prediction" and args.preflight_json:
    reasons = []
    for path in _paths(args.preflight_json):
      record = prediction_summary(_read_json(path))
      batch = (record["record"].get("batch") or {}).get("global")
      if record["target"] != args.target:
        reasons.append(f"{path} is for {record['target']}, not {args.target}")
      elif not record["step_seconds"] or batch != size.batch_size:
        reasons.append(
            f"{path} holds no preflight record with a step time of batch {size.batch_size} "
            f"(batch {batch})"
        )
      else:
        record.update(status="ok", seconds=0.0, source=f"--preflight_json={path}")
        return record
    # Compiled here instead; the run says why.
    result["parts"]["train_step"]["preflight_json_unusable"] = "; ".join(reasons)
  if (unit.part, unit.name) == ("quickstart", "cpu") and (
      result["environment"].get("platform") == "cpu"
  ):  # The device is this CPU: the device's run was the CPU's.
    return dict(result["parts"]["quickstart"].get("device") or {}, same_as_device=True)
  return None


def _paths(paths: str) -> list[str]:
  return [p.strip() for p in paths.split(",") if p.strip()]


def target_for_device(environment: dict) -> str:
  """The one-device preflight target of the chip the environment probe found: the one whose
  device kind starts the device's (or is started by it); `h100x1` where none is (a CPU, an
  unknown chip)."""
  from trainkit.preflight.targets import TARGETS

  kind = environment.get("device_kind")
  for name, target in TARGETS.items():
    if target.num_devices == 1 and _same_chip(kind, target.device_kind):
      return name
  return "h100x1"


def main_parent(args: argparse.Namespace) -> dict:
  """Runs the units within the budget; writes the JSON and the markdown after each."""
  size = SIZES[args.size]
  budget = size.budget_s if args.budget_s is None else args.budget_s
  start = time.perf_counter()
  now = datetime.datetime.now()
  result: dict[str, Any] = {
      "command": shlex.join(["python", "benchmarks/accelerator_check.py", *args.forwarded]),
      "date": now.date().isoformat(),
      "started": now.isoformat(timespec="seconds"),
      "size": args.size,
      "target": args.target,
      "budget_s": budget,
      "environment": {},
      "parts": {p: {} for p in PARTS},
  }
  md_path = os.path.splitext(args.out)[0] + ".md"

  def write() -> None:
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    for name, units in result["parts"].items():
      units.pop("status", None)
      result["parts"][name] = {"status": part_status(units), **units}
    # A record of a shape these functions did not expect must not cost the units still to run.
    try:
      derive(result)
    except Exception:  # pylint: disable=broad-except
      result["derive_error"] = traceback.format_exc()[-2000:]
    _write_json(args.out, result)
    try:
      text = markdown(result)
    except Exception:  # pylint: disable=broad-except
      text = f"(no markdown: {traceback.format_exc()[-2000:]})\n"
    with open(md_path, "w") as f:
      f.write(text)

  signal.signal(signal.SIGTERM, _on_signal)
  print(f"accelerator check, size {args.size}, budget {budget:.0f} s: {args.out}", flush=True)
  with tempfile.TemporaryDirectory(prefix="accelerator_check_") as scratch:
    for unit in UNITS:
      elapsed = time.perf_counter() - start
      record = _skip_or_reuse(unit, args, result, budget - elapsed)
      if record is None:
        timeout = min(unit.cap_s if args.size == "full" else budget, budget - elapsed)
        print(f"[{elapsed:4.0f} s] {unit.part}.{unit.name} on {unit.platform}, at most "
              f"{timeout:.0f} s", flush=True)
        run = {"quickstart": run_quickstart, "tests": run_device_tests}.get(unit.part, run_child)
        record = run(unit, args, scratch, timeout)
      if unit.part == "environment":
        result["environment"] = record
        args.device_platform = record.get("platform") or "cpu"
        if args.target == "auto":  # The children are given the target this chip resolves to.
          args.target = result["target"] = target_for_device(record)
          args.forwarded = [a for a in args.forwarded if not a.startswith("--target")]
          args.forwarded.append(f"--target={args.target}")
      else:
        result["parts"][unit.part][unit.name] = record
      if unit.name == "prediction" and record["status"] != "ok" and args.size == "full":
        recorded = recorded_prediction(args.target)
        if recorded:
          result["parts"]["train_step"]["recorded_prediction"] = recorded
      print(f"[{time.perf_counter() - start:4.0f} s] {_summary_line(unit, record)}", flush=True)
      write()
  missing = [k for k, v in (result["environment"].get("packages") or {}).items() if v is None]
  if missing:
    print(f"missing here: {', '.join(missing)} (docs/benchmarks.md, \"Accelerator check\", says "
          "how to carry them)", flush=True)
  with open(md_path) as f:
    print(f"\nwrote {args.out} and {md_path}\n\n{f.read()}", flush=True)
  return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", default=DEFAULT_OUT, help="the JSON; the markdown goes beside it")
  parser.add_argument("--size", default="full", choices=sorted(SIZES))
  parser.add_argument(
      "--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS)
  )
  parser.add_argument(
      "--budget_s",
      type=float,
      default=None,
      help="seconds for all units (default 480 at full size, 900 at tiny); a unit that the rest "
      "cannot start is skipped, the reason recorded",
  )
  parser.add_argument(
      "--target",
      default="auto",
      help="the one-device preflight target of the prediction; auto: the one of the chip found "
      "(h200x1 on an H200), h100x1 where no target has its device kind",
  )
  parser.add_argument(
      "--preflight_json",
      default="",
      help="comma-separated preflight.json files that the prediction's --mode=compile command "
      "wrote beforehand (on any CPU host), one per target; the one for --target is used instead "
      "of compiling the prediction in this run",
  )
  parser.add_argument(
      "--peer-vmoe",
      dest="peer_vmoe",
      default="",
      metavar="PATH",
      help="a google-research/vmoe checkout (the folder holding vmoe/); by default the first of "
      + ", ".join(os.path.relpath(p, ROOT) for p in PEER_CANDIDATES) + " that holds one",
  )
  parser.add_argument(
      "--data_root",
      default="",
      help="a folder holding img_align_celeba/*.jpg for the input pipeline; by default the first "
      "of " + ", ".join(os.path.relpath(p, ROOT) for p in CELEBA_CANDIDATES) + " that does, "
      "else synthetic JPEGs of CelebA's size",
  )
  parser.add_argument(
      "--inject_failure",
      default="",
      metavar="PART",
      help="for the test: that part's units (train_step, moe_layer or input_pipeline) raise "
      "after saving their figures",
  )
  parser.add_argument(
      "--from_result",
      default="",
      metavar="JSON",
      help="a check's JSON from a device: compare its measured step again with --preflight_json "
      "(the one for the chip it ran on), here, without a device; writes --out and its markdown",
  )
  parser.add_argument("--run_unit", default="", help=argparse.SUPPRESS)  # A child's unit.
  parser.add_argument("--unit_out", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.part_list = [p.strip() for p in args.parts.split(",") if p.strip()]
  args.device_platform = "cpu"  # The environment probe's, once it has run.
  unknown = sorted(set(args.part_list) - set(PARTS))
  if unknown:
    parser.error(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(PARTS)}")
  # What a child is given: this process's own arguments (the child's two follow them).
  given = sys.argv[1:] if argv is None else argv
  args.forwarded = [a for a in given if not a.startswith(("--run_unit", "--unit_out"))]
  return args


def compare_again(args: argparse.Namespace) -> dict:
  """A device's recorded check (`--from_result`) compared with the prediction of
  `--preflight_json` for the chip it ran on (or `--target`): nothing is measured or compiled."""
  result = _read_json(args.from_result)
  if args.target == "auto":
    args.target = target_for_device(result.get("environment") or {})
  size = SIZES[result.get("size", "full")]
  args.size = result.get("size", "full")
  train = result["parts"]["train_step"]
  train.pop("recorded_prediction", None)
  train.pop("preflight_json_unusable", None)
  [unit] = [u for u in UNITS if u.name == "prediction"]
  record = _skip_or_reuse(unit, args, result, float("inf")) if args.preflight_json else None
  if record is None:
    raise SystemExit(
        f"--from_result: no --preflight_json for {args.target} with batch {size.batch_size}: "
        f"{train.get('preflight_json_unusable', 'none given')}"
    )
  train["prediction"] = record
  result["target"] = args.target
  result["compared_again"] = shlex.join(
      ["python", "benchmarks/accelerator_check.py", *args.forwarded]
  )
  derive(result)
  _write_json(args.out, result)
  md_path = os.path.splitext(args.out)[0] + ".md"
  with open(md_path, "w") as f:
    f.write(markdown(result))
  with open(md_path) as f:
    print(f"wrote {args.out} and {md_path}\n\n{f.read()}", flush=True)
  return result


def main() -> None:
  args = parse_args()
  if args.run_unit:
    sys.exit(run_unit(args))
  if args.from_result:
    compare_again(args)
    return
  main_parent(args)


if __name__ == "__main__":
  main()
