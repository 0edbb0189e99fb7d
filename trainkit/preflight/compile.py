"""`--mode=compile`: a run's train and eval steps compiled for an accelerator it does not have.

The package says what its run is made of (`Program`); the optimiser, mesh, sharded state and
jitted step are `--mode=train`'s, lowered on ShapeDtypeStructs as MaxText's `train_compile.py`
does. docs/design.md, "Preflight", says what `<workdir>/preflight.json` holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any, Callable, Mapping

import flax.nnx as nnx
import jax
import ml_collections
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh

from trainkit.config import get as config_get
from trainkit.config import require_choice, require_float, require_int
from trainkit.errors import ConfigError, UserError
from trainkit.mesh import batch_sharding, make_mesh, require_all_devices
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.prefetch import DEFAULT_PREFETCH, resident_batches
from trainkit.preflight import analysis, hlo
from trainkit.preflight.calibration import CALIBRATION
from trainkit.preflight.targets import GIB, TARGETS, Target, devices, get_target
from trainkit.remat import MOST_AGGRESSIVE_REMAT, REMAT_CHOICES, validate_remat
from trainkit.storage import write_atomically
from trainkit.train_state import (
    LossFn,
    UpdateExtraFn,
    abstract_train_state,
    jit_train_step,
    make_train_step,
)

PREFLIGHT_FILE = "preflight.json"
# Checkpoints are saved asynchronously (trainkit.checkpoint): the devices wait only while the
# state is copied to the host, taken at PCIe 4.0 x16's 25 GB/s per device, one way.
HOST_COPY_BYTES_PER_S = 25e9
# An eval step is the forward pass alone: about a third of a training step's work per example.
EVAL_SHARE_OF_TRAIN_STEP = 1 / 3
_GPU_TILING_ERROR = "Couldn't find output tile sizes"
# What can change a step's memory per device (`memory_keys` names those that help).
MEMORY_KEYS = ("batch_size", "eval_batch_size", "model.remat", "compute_dtype", "mesh.expert")


def preflight_config() -> ml_collections.ConfigDict:
  """The `preflight` keys of both packages' configs."""
  return ml_collections.ConfigDict(
      dict(
          # --mode=compile: the accelerator to compile for (trainkit/preflight/targets.py).
          target="",
          # Share of the roofline bound a real step reaches, for the time estimate; 0 = the
          # target platform's calibrated share (docs/scaling.md, "Calibration").
          utilization=0.0,
          # Training examples per epoch when num_epochs > 0; 0 = the dataset's known size.
          train_examples=0,
          # Compile the eval step too (False: the train step only, e.g. for a table of runs).
          eval_step=True,
      )
  )


def validate_preflight(config: ml_collections.ConfigDict) -> Target | None:
  """Checks the preflight keys; returns the target (None when none is named)."""
  require_float(config, "preflight.utilization", minimum=0.0, maximum=1.0)  # NaN refused too.
  require_int(config, "preflight.train_examples", minimum=0)
  require_choice(config, "preflight.eval_step", (True, False))
  name = config.preflight.target
  if not name:
    return None
  if name not in TARGETS:
    raise ConfigError("preflight.target", f"unknown target {name!r}; known: {', '.join(TARGETS)}")
  return get_target(name)


@dataclasses.dataclass
class Program:
  """What a package's run is made of: the model (traced only), the loss, the unsharded global
  batches, the dataset's size and its validation split's (0: unknown), `settings`, the choices
  the config left open (`moe.dispatch="auto"`), and `input_pipeline`: the examples/s one host
  core prepares (`examples_per_s_per_core`, measured) and the cores the config gives it per
  process (`cores`, named by `cores_from`)."""

  make_model: Callable[[], nnx.Module]
  loss_fn: LossFn
  train_batch: Mapping[str, jax.ShapeDtypeStruct]
  make_eval_step: Callable[[nnx.GraphDef], Any]
  eval_batch: Mapping[str, jax.ShapeDtypeStruct]
  train_examples: int = 0
  train_examples_source: str = ""
  update_extra: UpdateExtraFn | None = None
  initial_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_examples: int = 0
  input_pipeline: Mapping[str, Any] = dataclasses.field(default_factory=dict)


BuildProgram = Callable[[ml_collections.ConfigDict, Mesh], Program]


def host_rows(mesh: Mesh, batch_size: int) -> list[list[int]]:
  """[first, end) of the batch rows each host's devices hold: host i's block [i * B/n, (i + 1) *
  B/n) as `trainkit.mesh.process_block` feeds it, or a RuntimeError naming the host."""
  rows: dict[int, set[int]] = {}
  for device, index in batch_sharding(mesh).devices_indices_map((batch_size,)).items():
    start, stop, _ = index[0].indices(batch_size)
    rows.setdefault(device.process_index, set()).update(range(start, stop))
  hosts = sorted(rows)
  block = batch_size // len(hosts)
  blocks = []
  for i, host in enumerate(hosts):
    expected = set(range(i * block, (i + 1) * block))
    if rows[host] != expected:
      raise RuntimeError(
          f"host {host}'s devices hold batch rows other than its block [{i * block}, "
          f"{(i + 1) * block}): the mesh does not match the multi-process input pipeline"
      )
    blocks.append([i * block, (i + 1) * block])
  return blocks


def _sharded_batch(batch: Mapping[str, jax.ShapeDtypeStruct], mesh: Mesh) -> dict[str, Any]:
  sharding = batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


def _out_of_memory(error: Exception) -> dict[str, Any] | None:
  """What a TPU compiler's RESOURCE_EXHAUSTED says (message, bytes used); None otherwise."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  found: dict[str, Any] = {"message": text.strip().splitlines()[0][:500]}
  # "Used 20.5G of 15.75G hbm", or "... HLO temporaries (148.76G) exceeds available HBM
  # (15.75G)" (binary units; temporaries only: the peak is at least that).
  scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  for pattern in (
      r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm",
      r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)",
  ):
    used = re.search(pattern, text)
    if used:
      found["peak"] = int(float(used.group(1)) * scale[used.group(2)])
      break
  return found


def compile_step(
    jitted: Any, args: tuple[Any, ...], mesh: Mesh, target: Target, beside: int = 0
) -> tuple[Any | None, dict[str, Any]]:
  """(compiled or None, what was learnt) for `jitted(*args)` on `target`; `beside` bytes per
  device (prefetched batches) count in `peak`. A refusal for memory is `fits: false`."""
  start = time.perf_counter()
  options: dict[str, Any] = {}
  with jax.set_mesh(mesh):
    lowered = jitted.lower(*args)
    try:
      try:
        compiled = lowered.compile()
      except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError and kin.
        if target.platform != "gpu" or _GPU_TILING_ERROR not in str(e):
          raise
        # Without the GPU, XLA cannot autotune and its default Triton GEMM tiling fails on
        # some dots (jax 0.10.2); cuBLAS GEMMs compile, as a real run may also choose.
        options = {"xla_gpu_enable_triton_gemm": False}
        compiled = lowered.compile(options)
    except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError and kin.
      refused = _out_of_memory(e)
      if refused is None:
        raise
      peak = refused.get("peak")
      return None, {
          "compile_seconds": round(time.perf_counter() - start, 1),
          "fits": False,
          "refused_by_compiler": refused["message"],
          "memory": {"peak": None if peak is None else peak + beside, "program_peak": peak},
      }
  record: dict[str, Any] = {"compile_seconds": round(time.perf_counter() - start, 1)}
  if options:
    record["compiler_options"] = options
  memory = analysis.memory(compiled)
  memory.update(program_peak=memory["peak"], peak=memory["peak"] + beside)
  record["memory"] = memory
  record["fits"] = memory["peak"] <= target.usable_bytes
  text = compiled.as_text()
  record["collectives"] = analysis.collectives(text)
  record["cost_by_part"] = analysis.cost_by_part(text, target.platform == "gpu")
  # The HLO's device ids index the mesh's devices in row-major order.
  hosts = [d.process_index for d in mesh.devices.flat]
  pricing = analysis.collective_seconds(
      text, hosts, target.interconnect_bandwidth, target.inter_host_bandwidth
  )
  if pricing is not None:
    record["collective_seconds"] = pricing.pop("seconds")
    record["collective_pricing"] = pricing
  cost = analysis.cost(compiled)
  if not cost and target.platform == "gpu":
    record["optimized_hlo_cost"] = analysis.optimized_hlo_cost(text)
    # cuBLAS/cuDNN calls, which the HLO cost analysis does not count.
    record["library_calls"] = analysis.library_call_cost(text)
  if target.platform == "gpu":
    record["gemm_backend"] = gemm_backend(text, options)
  if cost:
    # A negative optimal_seconds is XLA's "no estimate" (seen with collectives in the program).
    record["xla_cost"] = {
        k: float(cost[k])
        for k in ("flops", "bytes accessed", "optimal_seconds")
        if k in cost and float(cost[k]) > 0
    }
  return compiled, record


_TRITON_GEMM = re.compile(r'"kind":\s*"__triton[\w]*gemm')


def gemm_backend(hlo_text: str, options: Mapping[str, Any]) -> str:
  """Which library a GPU program's GEMMs compiled to: its cuBLAS calls and Triton GEMM fusions."""
  cublas = sum(1 for _ in hlo._GEMM_TARGET.finditer(hlo_text))
  triton = len(_TRITON_GEMM.findall(hlo_text))
  off = " (Triton GEMMs off: this jax cannot tile them without the GPU)" if options else ""
  return f"{cublas} cuBLAS calls, {triton} Triton GEMM fusions{off}"


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
  """JAX's persistent compilation cache off inside the block (a deviceless executable has no
  client to load into); JAX decides at its first compile, hence the resets."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def step_estimate(
    bound_seconds: float | None, utilization: float, collective_seconds: float | None
) -> dict[str, float | None]:
  """A step's seconds (None: unknown): roofline at `utilization`, collectives (not derated),
  their sum (the run's figure) and their max (all overlapped)."""
  compute = None if bound_seconds is None else bound_seconds / utilization
  collectives = collective_seconds or 0.0
  return {
      "compute_step_seconds": compute,
      "collective_seconds": collective_seconds,
      "step_seconds_no_overlap": None if compute is None else compute + collectives,
      "step_seconds_full_overlap": None if compute is None else max(compute, collectives),
  }


def band_seconds(
    bound_seconds: float, collective_seconds: float | None, utilization_range: list[float]
) -> list[float]:
  """[fastest, slowest] step without overlap: the roofline bound at the highest and the lowest
  utilisation of the calibration's band."""
  return [
      step_estimate(bound_seconds, u, collective_seconds)["step_seconds_no_overlap"]
      for u in sorted(utilization_range, reverse=True)
  ]


@persistent_cache_off()
def preflight(config: ml_collections.ConfigDict, build_program: BuildProgram) -> dict[str, Any]:
  """Compiles the run of `config` for `config.preflight.target`; returns the preflight record."""
  target = validate_preflight(config)
  if target is None:
    raise ConfigError(
        "preflight.target", f"name the target to compile for; known: {', '.join(TARGETS)}"
    )
  require_all_devices(
      config.mesh, target.num_devices, f"the {target.num_devices} devices of {target.name}"
  )
  mesh = make_mesh(config.mesh, list(devices(target)))
  program = build_program(config, mesh)
  train_examples = config.preflight.train_examples or program.train_examples
  steps = config.num_train_steps
  if config.num_epochs > 0:
    if not train_examples:
      raise ConfigError(
          "preflight.train_examples",
          "num_epochs is set but the dataset's size is not known without reading it; give "
          "the number of training examples",
      )
    steps = max(1, math.ceil(config.num_epochs * train_examples / config.batch_size))
  tx = make_optimizer(config.optimizer, steps, config.batch_size)
  schedule = learning_rate_schedule(config.optimizer, steps, config.batch_size)
  graphdef, state = abstract_train_state(
      program.make_model, tx, mesh, extra=dict(program.initial_extra)
  )
  step_fn = make_train_step(graphdef, program.loss_fn, tx, schedule, program.update_extra)
  batch = _sharded_batch(program.train_batch, mesh)
  batch_bytes = analysis.bytes_per_device(batch)
  # The step's own batch is an argument; those `DevicePrefetch` places ahead lie beside it.
  resident = resident_batches(DEFAULT_PREFETCH)
  prefetched = (resident - 1) * batch_bytes
  _, train = compile_step(
      jit_train_step(step_fn, state, mesh), (state, batch), mesh, target, beside=prefetched
  )
  with jax.set_mesh(mesh):
    counted = analysis.matmul_flops(jax.make_jaxpr(step_fn)(state, batch))
  if config.preflight.eval_step:
    eval_batch = _sharded_batch(program.eval_batch, mesh)
    _, evaluation = compile_step(
        program.make_eval_step(graphdef), (state, eval_batch), mesh, target
    )
  else:
    evaluation = {"skipped": True, "fits": True, "memory": {}, "compile_seconds": 0.0}

  train["memory"].update(
      parameters=analysis.bytes_per_device(state.params),
      optimizer_state=analysis.bytes_per_device(state.opt_state),
      model_state=analysis.bytes_per_device(state.model_state),
      batch=batch_bytes,
      resident_batches=resident,
      prefetched=prefetched,
  )
  n = target.num_devices
  flops, flops_source, bytes_accessed, bytes_source = _step_cost(train, counted["flops"] / n)
  peak_flops = target.peak_flops(config.compute_dtype)
  roofline = None
  if bytes_accessed is not None:
    roofline = analysis.roofline_seconds(flops, bytes_accessed, peak_flops, target.memory_bandwidth)
  train.update(
      flops_per_device=flops,
      flops_per_example=flops * n / config.batch_size,
      flops_source=flops_source,
      matmul_flops_per_step=counted["flops"],
      matmul_flops_per_example=counted["flops"] / config.batch_size,
      uncounted_loops=counted["uncounted_loops"],
      bytes_accessed_per_device=bytes_accessed,
      bytes_accessed_source=bytes_source,
      roofline=roofline,
      xla_estimate_seconds=train.get("xla_cost", {}).get("optimal_seconds"),
  )
  utilization, utilization_source, utilization_range = _utilization(config, target)
  bound = roofline["bound_s"] if roofline else None
  estimate = step_estimate(bound, utilization, train.get("collective_seconds"))
  step_range = None
  if roofline and utilization_range:
    step_range = band_seconds(bound, train.get("collective_seconds"), utilization_range)
  step_seconds = estimate["step_seconds_no_overlap"]
  full_overlap = estimate["step_seconds_full_overlap"]
  outside = outside_steps(config, program, steps, train["memory"])

  def hours(step: float | None) -> float | None:
    """Wall hours of the run: its steps, its evaluations and its checkpoint saves."""
    if not step:
      return None
    return (steps * step * (1 + outside["eval_share"]) + outside["checkpoint_seconds"]) / 3600

  wall, wall_full = hours(step_seconds), hours(full_overlap)
  given = {}
  for key in program.settings:
    with contextlib.suppress(ConfigError):  # A key the config lacks: nothing was asked.
      given[key] = config_get(config, key)
  return {
      "target": {
          "name": target.name,
          "platform": target.platform,
          "device_kind": target.device_kind,
          "devices": n,
          "hosts": target.num_hosts,
          "memory_bytes": target.memory_bytes,
          "usable_bytes": target.usable_bytes,
          "peak_flops_per_s": peak_flops,
          "memory_bandwidth": target.memory_bandwidth,
          "interconnect": target.interconnect,
          "interconnect_bandwidth": target.interconnect_bandwidth,
          "inter_host_bandwidth": target.inter_host_bandwidth,
      },
      "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
      "compute_dtype": config.compute_dtype,
      "remat": validate_remat(config),
      "settings": dict(program.settings),
      # What the config said of each (e.g. moe.dispatch "auto"), printed beside the choice.
      "settings_given": {key: value for key, value in given.items() if value is not None},
      "batch": {
          "global": config.batch_size,
          "per_host": config.batch_size // target.num_hosts,
          "per_device": config.batch_size // n,
          "eval_global": config.eval_batch_size,
          "host_rows": host_rows(mesh, config.batch_size),
      },
      "fits": bool(train["fits"] and evaluation["fits"]),
      "train_step": train,
      "eval_step": evaluation,
      "run": {
          "num_train_steps": steps,
          "num_epochs": config.num_epochs,
          "train_examples": train_examples,
          "train_examples_source": (
              "preflight.train_examples"
              if config.preflight.train_examples
              else program.train_examples_source
          ),
          "utilization": utilization,
          "utilization_source": utilization_source,
          "utilization_range": utilization_range,
          **estimate,
          "step_seconds_range": step_range,
          "step_seconds": step_seconds,
          **outside,
          "wall_hours": wall,
          "device_hours": wall * n if wall else None,
          "device_hours_range": [hours(s) * n for s in step_range] if step_range else None,
          "wall_hours_full_overlap": wall_full,
          "device_hours_full_overlap": wall_full * n if wall_full else None,
      },
      "input": input_cores(program, target, config.batch_size, (step_range or [step_seconds])[0]),
      "provenance": {
          "date": datetime.date.today().isoformat(),
          "jax": jax.__version__,
          "libtpu": _version("libtpu"),
          "jax_cuda12_plugin": _version("jax-cuda12-plugin"),
          "gemm_backend": train.get("gemm_backend", f"XLA ({target.platform.upper()})"),
      },
  }


def outside_steps(
    config: ml_collections.ConfigDict, program: Program, steps: int, memory: Mapping[str, Any]
) -> dict[str, Any]:
  """What a run spends beside its training steps: evaluations of the validation split every
  `eval_every_steps` (as a share of the steps' time) and checkpoint saves every
  `checkpoint_every_steps` (seconds), as the training loop schedules them."""
  every_eval = config.get("eval_every_steps", 0) if program.eval_examples else 0
  every_save = config.get("checkpoint_every_steps", 0)
  evaluations = math.ceil(steps / every_eval) if every_eval > 0 else 0
  saves = math.ceil(steps / every_save) if every_save > 0 else 0
  state = sum(memory.get(k) or 0 for k in ("parameters", "optimizer_state", "model_state"))
  evaluated = evaluations * program.eval_examples * EVAL_SHARE_OF_TRAIN_STEP
  return {
      "evaluations": evaluations,
      "eval_examples": program.eval_examples,
      "eval_share": evaluated / (steps * config.batch_size),  # Of the training steps' time.
      "checkpoints": saves,
      "checkpoint_seconds": saves * state / HOST_COPY_BYTES_PER_S,
  }


def input_cores(
    program: Program, target: Target, batch_size: int, step_seconds: float | None
) -> dict[str, Any] | None:
  """Host cores per process that prepare the batches as fast as `step_seconds` consumes them, at
  the program's measured rate per core; one process per host on a TPU, per GPU on a GPU node
  (launch/slurm.sh). None where the rate is not known."""
  rate = program.input_pipeline.get("examples_per_s_per_core")
  if not rate or not step_seconds:
    return None
  processes = target.num_hosts if target.platform == "tpu" else target.num_devices
  needed = math.ceil(batch_size / processes / step_seconds / rate)
  return dict(
      program.input_pipeline, processes_per_host=processes // target.num_hosts, cores_needed=needed
  )


def _step_cost(
    train: dict[str, Any], matmul_per_device: float
) -> tuple[float, str, float | None, str]:
  """(FLOPs, their source, bytes accessed or None, their source) of one device's step: XLA's
  cost analysis (TPU), else the optimised program's count with its library calls (GPU)."""
  xla, hlo, with_calls = train.get("xla_cost", {}), train.get("optimized_hlo_cost") or {}, ""
  if hlo:  # A GPU program: XLA's fusions and the cuBLAS/cuDNN calls its cost analysis skips.
    hlo = analysis.with_library_calls(hlo, train["library_calls"])
    train["cost_split"] = {"fusions": hlo["fusions"], "library_calls": hlo["library_calls"]}
    with_calls = " + its library calls (cuBLAS/cuDNN custom calls)"
  if "flops" in xla:
    flops, flops_source = xla["flops"], "xla cost analysis"
  elif hlo.get("flops", 0.0) > matmul_per_device:
    flops, flops_source = hlo["flops"], "hlo cost analysis of the optimised program" + with_calls
  else:
    flops, flops_source = matmul_per_device, "matmul count of the jaxpr"
  m = train["memory"]
  if "bytes accessed" in xla:
    accessed, accessed_source = xla["bytes accessed"], "xla cost analysis"
  elif hlo.get("bytes accessed"):
    accessed = hlo["bytes accessed"]
    accessed_source = "hlo cost analysis of the optimised program (counted from its text)" + (
        with_calls and with_calls + ": operands and results, workspace not counted"
    )
  elif m.get("arguments") is not None:
    accessed = m["arguments"] + m["outputs"] + 2 * m["temporaries"]
    accessed_source = (
        "lower bound: arguments read, outputs written, temporaries written and read once"
    )
  else:
    accessed, accessed_source = None, "unknown (the compiler refused the program)"
  return flops, flops_source, accessed, accessed_source


def _utilization(
    config: ml_collections.ConfigDict, target: Target
) -> tuple[float, str, list[float] | None]:
  """(utilisation, where it comes from, the range the calibration allows or None)."""
  if config.preflight.utilization > 0:
    return float(config.preflight.utilization), "preflight.utilization", None
  calibrated = CALIBRATION[target.platform]  # Every platform with a target is calibrated.
  source = (
      f"calibrated on {target.platform.upper()}: {calibrated.source} (paper_runner/calibration.py)"
  )
  return calibrated.utilization, source, list(calibrated.band)


def _version(package: str) -> str | None:
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def _gib(n: float | None) -> str:
  return "?" if n is None else f"{n / GIB:.2f} GiB"


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f} ms"


def settings_text(record: Mapping[str, Any]) -> str:
  """The choices compiled, `key=value` or `key=given (compiled: value)` (`moe.dispatch=auto
  (compiled: sort)`); "" without any."""
  given = record.get("settings_given") or {}
  parts = []
  for key, value in (record.get("settings") or {}).items():
    asked = given.get(key, value)
    parts.append(f"{key}={value}" if asked == value else f"{key}={asked} (compiled: {value})")
  return ", ".join(parts)


# A device's temporaries over the cuBLAS fallback's, measured on an H200 (docs/scaling.md).
FALLBACK_TEMPORARIES_FACTOR = 19.63 / 17.72


def fallback_peak(record: Mapping[str, Any]) -> float | None:
  """The train step's peak, temporaries scaled as on a device, for a GPU fallback compile; else
  None."""
  train = record["train_step"]
  memory = train.get("memory") or {}
  if (train.get("compiler_options") or {}).get("xla_gpu_enable_triton_gemm") is not False:
    return None
  if memory.get("peak") is None or memory.get("temporaries") is None:
    return None
  return memory["peak"] + (FALLBACK_TEMPORARIES_FACTOR - 1) * memory["temporaries"]


def summary(record: Mapping[str, Any]) -> str:
  """The record as a few readable lines."""
  t, train, ev, run = record["target"], record["train_step"], record["eval_step"], record["run"]
  m, batch, settings = train["memory"], record["batch"], settings_text(record)
  if m.get("temporaries") is None:
    parts = f" (refused by the compiler: {train.get('refused_by_compiler')})"
  else:
    parts = (
        f" = parameters {_gib(m['parameters'])}, optimiser state {_gib(m['optimizer_state'])}, "
        f"batch {_gib(m['batch'])} and {m['resident_batches'] - 1} prefetched ahead of it "
        f"{_gib(m['prefetched'])}, other arguments and outputs, temporaries {_gib(m['temporaries'])}"
    )
  lines = [
      f"preflight for {t['name']}: {t['devices']} x {t['device_kind']} on {t['hosts']} host(s), "
      f"mesh {record['mesh']}, model.remat={record['remat']}, "
      + (f"{settings}, " if settings else "")
      + f"batch {batch['global']} ({batch['per_host']} per host, {batch['per_device']} per device)",
      f"  fits: {'yes' if record['fits'] else 'NO'} (usable {_gib(t['usable_bytes'])} per device)",
      f"  train step per device: peak {_gib(m.get('peak'))}{parts}",
      "  eval step: not compiled (preflight.eval_step=False)"
      if ev.get("skipped")
      else f"  eval step per device: peak {_gib(ev['memory'].get('peak'))}",
      f"  FLOPs per step per device: {train['flops_per_device']:.3e}, per example "
      f"{train['flops_per_example']:.3e} ({train['flops_source']}); matmul FLOPs per example "
      f"{train['matmul_flops_per_example']:.3e}",
  ]
  scaled = fallback_peak(record)
  if scaled is not None:
    lines.insert(
        3,
        (
            "  compiled with Triton GEMMs off (this jax cannot tile them without the GPU): a real "
            f"run's program differs; with its temporaries 10% larger, as measured once, the peak is "
            f"{_gib(scaled)}"
            + (
                ", over the usable memory: a real run may not fit, or XLA may recompute to stay "
                "under it (the six one-H100 paper cells in this case fit on jax 0.11.2); compile "
                "with the jax the run will use (docs/scaling.md)"
                if record["fits"] and scaled > t["usable_bytes"]
                else " (docs/scaling.md)"
            )
        ),
    )
  if train.get("bytes_accessed_per_device") is not None:
    split = train.get("cost_split")
    lines.append(
        f"  bytes accessed per device: {train['bytes_accessed_per_device']:.3e}"
        + (
            f" = fusions {split['fusions']['bytes accessed']:.3e} + library calls "
            f"{split['library_calls']['bytes accessed']:.3e}"
            if split
            else ""
        )
        + f" ({train['bytes_accessed_source']})"
    )
  if parts := train.get("cost_by_part"):
    b, f = (sum(p[k] for p in parts.values()) or 1.0 for k in ("bytes accessed", "flops"))
    shares = [f"{k} {p['bytes accessed'] / b:.0%} / {p['flops'] / f:.0%}" for k, p in parts.items()]
    lines.append(
        f"  bytes / FLOPs by part (of {b:.3e} / {f:.3e} counted from the optimised program's ops): "
        + ", ".join(shares)
    )
  collectives = train.get("collectives") or {}
  pricing = train.get("collective_pricing")
  kinds = [f"{k} x{v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in collectives.items()]
  priced = ""
  if collectives and pricing:
    across = pricing["inter_host_bandwidth"] != pricing["bandwidth"] and any(
        v["across_hosts"] for v in pricing["by_kind"].values()
    )
    priced = (
        f": {train['collective_seconds'] * 1e3:.3g} ms per step (ring model at "
        f"{pricing['bandwidth'] / 1e9:.0f} GB/s per device"
        + (f", {pricing['inter_host_bandwidth'] / 1e9:.0f} GB/s across hosts" if across else "")
        + ")"
    )
  lines.append(f"  collectives: {', '.join(kinds) or 'none'}{priced}")
  if train.get("roofline"):
    r, xla, spread = train["roofline"], train.get("xla_estimate_seconds"), run["step_seconds_range"]
    lines += [
        f"  step time: roofline {_ms(r['bound_s'])} ({r['bound_by']}-bound)"
        + (f", XLA's estimate {_ms(xla)}" if xla else "")
        + f"; at {run['utilization']:.0%} of the bound {_ms(run['compute_step_seconds'])}"
        f" ({run['utilization_source']})",
        f"  step with collectives: {_ms(run['step_seconds'])} without overlap"
        + (
            f" (band {spread[0] * 1e3:.2f}-{_ms(spread[1])}: every calibration point and the jax "
            "versions' spread, docs/scaling.md)"
            if spread
            else ""
        )
        + f", {_ms(run['step_seconds_full_overlap'])} with full overlap",
        f"  {run['num_train_steps']} steps, "
        + (
            f"{run['evaluations']} evaluations of {run['eval_examples']} examples"
            if run["eval_examples"]
            else "evaluations not counted (the validation split's size is not known)"
        )
        + f", {run['checkpoints']} checkpoint saves: "
        f"{run['wall_hours']:.2f} h wall, {run['device_hours']:.1f} device-hours without overlap"
        + (f" (band {hours[0]:.1f}-{hours[1]:.1f})" if (hours := run["device_hours_range"]) else "")
        + f"; {run['wall_hours_full_overlap']:.2f} h, "
        f"{run['device_hours_full_overlap']:.1f} device-hours with full overlap",
    ]
  lines.append(
      f"  compile time here: train {train['compile_seconds']} s, eval {ev['compile_seconds']} s"
  )
  p = record["provenance"]
  lines.append(f"  compiled by jax {p['jax']}; GEMMs: {p['gemm_backend']}")
  feed = record.get("input")
  if feed:
    per = "host" if feed["processes_per_host"] == 1 else "GPU (launch/slurm.sh --cpus-per-task)"
    lines.append(
        f"  input pipeline: {feed['cores_needed']} host cores per {per} feed the band's fastest "
        f"step at {feed['examples_per_s_per_core']:.0f} examples/s per core (measured)"
    )
    if feed["cores"] < feed["cores_needed"]:
      lines.append(
          f"  WARNING: {feed['cores_from']} gives the input pipeline {feed['cores']} core(s) per "
          f"process, fewer than the {feed['cores_needed']} that keep the step fed"
      )
  return "\n".join(lines)


def memory_keys(record: Mapping[str, Any]) -> list[str]:
  """The `MEMORY_KEYS` that can lower the run's memory per device on its target, each with how."""
  keys = []
  if not record["train_step"]["fits"]:
    keys.append("batch_size (activations scale with it)")
    remat = record.get("remat", "none")
    if remat in REMAT_CHOICES and remat != MOST_AGGRESSIVE_REMAT:
      stronger = REMAT_CHOICES[REMAT_CHOICES.index(remat) + 1 :]
      keys.append(
          f"model.remat (now {remat!r}; {' or '.join(map(repr, stronger))} keeps fewer "
          "activations for more FLOPs)"
      )
  if not record["eval_step"]["fits"]:
    keys.append("eval_batch_size (for the eval step)")
  if record.get("compute_dtype") != "bfloat16":
    keys.append("compute_dtype=bfloat16 (half the activation bytes)")
  devices = record["target"]["devices"]
  if devices > 1:
    keys.append(f"mesh.expert (the experts split over more of the {devices} devices)")
  return keys


def does_not_fit_message(record: Mapping[str, Any]) -> str:
  """One line: which step does not fit, by how much per device, and `memory_keys`."""
  t = record["target"]
  parts = []
  for name in ("train_step", "eval_step"):
    step = record[name]
    if not step["fits"]:
      peak = step["memory"].get("peak")
      short = f", {_gib(peak - t['usable_bytes'])} short" if peak else ""
      # The TPU compiler's refusal counts the temporaries alone: the peak is at least that.
      at_least = "at least " if step.get("refused_by_compiler") else ""
      parts.append(f"the {name.replace('_', ' ')} needs {at_least}{_gib(peak)} per device{short}")
  return (
      f"does not fit on {t['name']} ({_gib(t['usable_bytes'])} usable per device): "
      f"{'; '.join(parts)}. Change {', '.join(memory_keys(record))}"
  )


def compile_run(
    config: ml_collections.ConfigDict, workdir: str, build_program: BuildProgram
) -> dict[str, Any]:
  """`--mode=compile`: prints, writes `<workdir>/preflight.json`; a UserError if it does not fit."""
  record = preflight(config, build_program)
  path = os.path.join(workdir, PREFLIGHT_FILE)
  write_atomically(path, json.dumps(record, indent=2) + "\n")
  print(summary(record), flush=True)
  print(f"  written to {path}", flush=True)
  if not record["fits"]:
    raise UserError(does_not_fit_message(record))
  return record
