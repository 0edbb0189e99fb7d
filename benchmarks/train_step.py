r"""The fairmoe_jax train step against the same ViT with a dense MLP, on this machine.

  python benchmarks/train_step.py                                   # quickstart + CelebA small
  python benchmarks/train_step.py --configs quickstart --experts 4 32 --dispatch sort dropless
  python benchmarks/train_step.py --configs deit_small --batch_size 256 --compute_dtype bfloat16

Each row times the jitted train step of a config's model on random inputs (median of `--steps`
steps after compilation), beside `dense`: the MoE layers replaced by GELU MLPs of hidden
top_k * mlp_dim, the same active FLOPs (target: `vs_dense` at most 1.2x at E=4 and E=32); model
FLOP/s and their share of this machine's float32 matmul peak (2048^2); `--methods` adds other
methods' steps. Prints a table and writes JSON (default benchmarks/results/train_step.json).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import statistics
import time
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import bench_utils
from bench_utils import cost, write_results
from fairmoe_jax import config as fairmoe_config
from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.methods import METHODS
from fairmoe_jax.models.vit import Mlp
from fairmoe_jax.preflight import dataset_info, preflight_program
from fairmoe_jax.train import create_state, make_loss_fn
from trainkit.mesh import make_mesh, shard_batch
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.preflight.targets import TARGETS
from trainkit.train_state import compute_dtype, create_train_state, jit_train_step, make_train_step

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The run configs whose step is measured.
CONFIGS = {
    "quickstart": "configs/quickstart.py",
    "celeba_small": "configs/celeba.py:size=small",
    "deit_small": "configs/celeba.py:size=full",
}


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`FILE[:ARG]` (relative to the project root) -> its `get_config(ARG)`."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("bench_config", os.path.join(_ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def matmul_peak(size: int = 2048, repeats: int = 10) -> float:
  """FLOP/s of a float32 [size, size] @ [size, size] matmul here (best of `repeats`)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), jnp.float32)
  matmul = jax.jit(lambda x: x @ x).lower(a).compile()
  _, [times] = bench_utils.time_interleaved([lambda: matmul(a)], repeats)
  return 2 * size**3 / min(times)


def _dense_equivalent(build: Any, hidden: int, config: ml_collections.ConfigDict) -> nnx.Module:
  """The model of `build()` with every MoE block's layer replaced by a dense MLP of `hidden`."""
  model = build()
  for block in model.blocks:
    if block.is_moe:
      block.mlp = Mlp(
          config.model.dim,
          hidden,
          dropout_rate=config.model.dropout_rate,
          dtype=compute_dtype(config.compute_dtype),
          param_dtype=jnp.float32,
          rngs=nnx.Rngs(1),
      )
      block.is_moe = False
  return model


def benchmark(
    config_name: str,
    *,
    num_experts: int,
    top_k: int,
    dispatch: str,
    method: str,
    dense: bool,
    batch_size: int | None = None,
    compute_dtype: str | None = None,
) -> tuple[dict, "_Step"]:
  """One row's compile-time figures and its compiled step, ready to time."""
  config = load_config(CONFIGS[config_name])
  config.method = method
  config.moe.update(num_experts=num_experts, top_k=top_k, dispatch=dispatch)
  if batch_size:
    config.batch_size = batch_size
  if compute_dtype:
    config.compute_dtype = compute_dtype
  config.mesh.data = 1  # One device; the benchmark measures the step, not the mesh.
  fairmoe_config.validate(config, num_devices=jax.device_count(), check_data=False)
  image_size, batch, info = config.data.image_size, config.batch_size, dataset_info(config)
  mesh = make_mesh(config.mesh)
  tx = make_optimizer(config.optimizer, 1000)

  def build():  # The Rngs are made inside: create_train_state traces this function.
    return METHODS[config.method].build_model(config, info, nnx.Rngs(0), None)

  if dense:
    build = functools.partial(_dense_equivalent, build, top_k * config.model.mlp_dim, config)
  graphdef, state = create_train_state(build, tx, mesh, 0)
  step_fn = jit_train_step(make_train_step(graphdef, make_loss_fn(config, info), tx), state, mesh)
  specs = dict(image=((batch, image_size, image_size, 3), np.float32), label=((batch,), np.int32))
  specs.update(attributes=((batch, len(info.group_names)), np.int32), mask=((batch,), np.float32))
  specs = {k: jax.ShapeDtypeStruct(*v) for k, v in specs.items()}
  inputs = shard_batch(random_batch(specs, info), mesh)
  row = dict(config=config_name, method="dense" if dense else method, image_size=image_size)
  row.update(batch_size=batch, num_experts=None if dense else num_experts, top_k=top_k)
  row.update(dispatch="-" if dense else dispatch, compute_dtype=config.compute_dtype)
  step = _Step(step_fn, state, inputs)
  row.update(compile_s=round(step.compile_s, 2), xla_flops=cost(step.compiled, "flops"))
  return row, step


def random_batch(specs: dict[str, Any], info: DatasetInfo) -> dict[str, np.ndarray]:
  """Random inputs of the shapes and dtypes of `specs`: images (uint8 0-255, else normal), labels
  and attributes in their ranges, and the mask: every example counts."""
  rng, batch = np.random.default_rng(0), {}
  for key, s in specs.items():
    if key == "image" and s.dtype == np.uint8:
      batch[key] = rng.integers(0, 256, s.shape, dtype=np.uint8)
    elif key == "image":
      batch[key] = rng.normal(size=s.shape).astype(s.dtype)
    elif key == "label":
      batch[key] = rng.integers(0, info.num_classes, s.shape[0]).astype(s.dtype)
    elif key == "attributes":
      columns = [rng.integers(0, len(groups), s.shape[0]) for groups in info.group_names]
      batch[key] = np.stack(columns, axis=1).astype(s.dtype)
    else:
      batch[key] = np.ones(s.shape, s.dtype)
  return batch


class _Step:
  """A compiled train step with its (donated, so replaced every call) state, and the seconds
  its compilation took (`compile_s`)."""

  def __init__(self, step_fn: Any, state: Any, inputs: Any):
    t0 = time.perf_counter()
    self.compiled = step_fn.lower(state, inputs).compile()
    self.compile_s, self.state, self.inputs = time.perf_counter() - t0, state, inputs

  def __call__(self) -> Any:
    """Runs one step; returns its metrics (to wait for)."""
    self.state, metrics = self.compiled(self.state, self.inputs)
    return metrics


def time_interleaved(rows: list[dict], steps: list[_Step], repeats: int) -> None:
  """Median step time of every row, the steps alternated round by round after a warm-up
  (`bench_utils.time_interleaved`)."""
  _, times = bench_utils.time_interleaved(steps, repeats)
  for row, t in zip(rows, times):
    step_s = statistics.median(t)
    row.update(step_ms=round(1e3 * step_s, 2), step_min_ms=round(1e3 * min(t), 2))
    row.update(images_per_s=round(row["batch_size"] / step_s, 1))


def add_ratios(rows: list[dict], peak: float) -> None:
  """vs_dense, and model FLOP/s (the dense step's FLOPs over each step's time) vs the peak."""
  dense = {(r["config"], r["top_k"]): r for r in rows if r["method"] == "dense"}
  for r in rows:
    d = dense.get((r["config"], r["top_k"]))
    r["vs_dense"] = round(r["step_ms"] / d["step_ms"], 3) if d else None
    flops_per_s = d["xla_flops"] / r["step_ms"] * 1e3 if d and d["xla_flops"] else None
    r["model_gflops_per_s"] = round(flops_per_s / 1e9, 2) if flops_per_s else None
    r["share_of_peak"] = round(flops_per_s / peak, 3) if flops_per_s else None


def measure_program(config: ml_collections.ConfigDict, warmup_steps: int, timed_steps: int) -> dict:
  """The preflight's train-step program (`fairmoe_jax.preflight`'s Program: same model, loss,
  optimiser, schedule and uint8 batch) built for real on one device and run on random inputs:
  compile time, median step time after `warmup_steps`, and the device's peak memory."""
  config.mesh.data, config.mesh.expert = 1, 1
  fairmoe_config.validate(config, num_devices=1, check_data=False)
  device = jax.devices()[0]
  mesh = make_mesh(config.mesh, [device])
  info = dataset_info(config)
  program = preflight_program(config, mesh)
  # The step count sets the schedule's values only; counted as the preflight counts it.
  steps = config.num_train_steps
  examples = config.preflight.train_examples or program.train_examples
  if config.num_epochs > 0 and examples:
    steps = max(1, int(np.ceil(config.num_epochs * examples / config.batch_size)))
  tx = make_optimizer(config.optimizer, steps, config.batch_size)
  schedule = learning_rate_schedule(config.optimizer, steps, config.batch_size)
  graphdef, state = create_state(config, info, tx, mesh, pretrained=False)
  train = make_train_step(graphdef, program.loss_fn, tx, schedule, program.update_extra)
  inputs = shard_batch(random_batch(program.train_batch, info), mesh)
  step = _Step(jit_train_step(train, state, mesh), state, inputs)
  compiled = step.compiled
  for _ in range(warmup_steps):
    jax.block_until_ready(step())
  # bench_utils' timing runs one more warm-up call, then times each step to its end.
  _, [times] = bench_utils.time_interleaved([step], timed_steps)
  step_s = statistics.median(times)
  stats = device.memory_stats() or {}
  row = dict(method=config.method, backbone=config.model.backbone, batch_size=config.batch_size)
  row.update(compute_dtype=config.compute_dtype, image_size=config.data.image_size)
  row.update(dispatch=program.settings.get("moe.dispatch"), device_kind=str(device.device_kind))
  row.update(compile_seconds=step.compile_s, compiled_memory=bench_utils.memory_analysis(compiled))
  # Whether cuDNN's fused attention took the backbone's shapes (fairmoe_jax/models/vit.py).
  row.update(cudnn_attention="__cudnn$fmha" in compiled.as_text())
  row.update(warmup_steps=warmup_steps + 1, timed_steps=len(times), step_seconds=step_s)
  row.update(step_min_seconds=min(times), step_max_seconds=max(times))
  row.update(images_per_s=config.batch_size / step_s)
  # The process's peak: the measurement's alone when it has a process of its own.
  return dict(row, peak_bytes=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))


def prediction_summary(record: dict) -> dict:
  """A preflight record's (`--mode=compile`'s preflight.json) figures that `measure_program`'s
  can check, and the record itself. The fit's peak adds the batches the input pipeline places
  ahead of the step; the program's is the step's own, what one step on random inputs reaches."""
  target, run, train = (record.get(k) or {} for k in ("target", "run", "train_step"))
  memory, roofline = train.get("memory") or {}, train.get("roofline") or {}
  summary = dict(target=target.get("name"), target_device_kind=target.get("device_kind"))
  summary.update(usable_bytes=target.get("usable_bytes"), fits=record.get("fits"))
  summary.update(peak_bytes=memory.get("peak"), program_peak_bytes=memory.get("program_peak"))
  summary.update(step_seconds=run.get("step_seconds"), utilization=run.get("utilization"))
  summary.update(roofline_seconds=roofline.get("bound_s"), bound_by=roofline.get("bound_by"))
  summary.update(flops_per_step=train.get("flops_per_device"))
  summary.update(bytes_accessed_per_step=train.get("bytes_accessed_per_device"))
  summary.update(dispatch=(record.get("settings") or {}).get("moe.dispatch"))
  summary.update(compile_seconds=train.get("compile_seconds"), provenance=record.get("provenance"))
  return dict(summary, record=record)


def same_chip(a: str | None, b: str | None) -> bool | None:
  """Whether two device kinds name one chip ("NVIDIA H100 80GB HBM3", "NVIDIA H100")."""
  return a.startswith(b) or b.startswith(a) if a and b else None


def find_prediction(paths: list[str], target: str, batch_size: int) -> dict | None:
  """`prediction_summary` of the first preflight.json of `paths` for `target` and `batch_size`
  (a prediction made beforehand, on any host), with its path as `source`; None if none is."""
  for path in paths:
    with open(path) as f:
      record = prediction_summary(json.load(f))
    batch = (record["record"].get("batch") or {}).get("global")
    if record["target"] == target and batch == batch_size:
      return dict(record, source=f"--preflight_json={path}")
  return None


def one_device_target(device_kind: str | None) -> str:
  """The one-device preflight target of a chip (`h200x1` for "NVIDIA H200"), `h100x1` if none."""
  chips = {name: t.device_kind for name, t in TARGETS.items() if t.num_devices == 1}
  return next((name for name, kind in chips.items() if same_chip(device_kind, kind)), "h100x1")


def compare_with_prediction(measured: dict, predicted: dict) -> dict:
  """`measure_program`'s figures over `prediction_summary`'s."""
  step_s, peak, ratio = measured["step_seconds"], measured.get("peak_bytes"), bench_utils.ratio
  return dict(
      source=predicted.get("source"),
      peak_over_program_peak=ratio(peak, predicted.get("program_peak_bytes")),
      peak_over_fit_peak=ratio(peak, predicted.get("peak_bytes")),
      step_over_predicted_step=ratio(step_s, predicted["step_seconds"]),
      step_over_roofline=ratio(step_s, predicted.get("roofline_seconds")),
      # The share of the roofline bound this device reached: the preflight's `utilization`.
      implied_utilization=ratio(predicted.get("roofline_seconds"), step_s),
      same_dispatch=measured.get("dispatch") == predicted.get("dispatch"),
      # A prediction for another chip (an explicit --target) compares different hardware.
      same_chip=same_chip(measured.get("device_kind"), predicted.get("target_device_kind")),
  )


GIB = 2**-30
TRAIN_ROWS = {  # label: measured, predicted and ratio keys, scale.
    "peak memory (GiB), the step's program": (
        "peak_bytes",
        "program_peak_bytes",
        "peak_over_program_peak",
        GIB,
    ),
    "peak memory (GiB), with the batches ahead": ("", "peak_bytes", "peak_over_fit_peak", GIB),
    "step time (ms)": ("step_seconds", "step_seconds", "step_over_predicted_step", 1e3),
    "roofline bound (ms)": ("", "roofline_seconds", "step_over_roofline", 1e3),
    "share of the roofline bound reached": ("implied_utilization", "utilization", "", 1),
    "images/s": ("images_per_s", "", "", 1),
}


def comparison_table(measured: dict, predicted: dict, ratios: dict) -> str:
  """`measure_program`'s figures beside `prediction_summary`'s, as a markdown table."""
  fmt = bench_utils.fmt
  return "| | measured | predicted | measured / predicted |\n|---|---:|---:|---:|\n" + "\n".join(
      f"| {label} | {fmt({**ratios, **measured}.get(a), 2, scale)} | "
      f"{fmt(predicted.get(b), 2, scale)} | {fmt(ratios.get(r))} |"
      for label, (a, b, r, scale) in TRAIN_ROWS.items()
  )


def evaluate_targets(rows: list[dict]) -> list[dict]:
  target, targets = "vanilla SMoE train step at most 1.2x the dense model's at E=4 and E=32", []
  for r in rows:
    if r["method"] in ("smoe", "vanilla_smoe") and r["num_experts"] in (4, 32) and r["vs_dense"]:
      case = f"{r['config']} E={r['num_experts']} {r['dispatch']}"
      detail = f"step/dense = {r['vs_dense']:.2f}x"
      targets.append(dict(target=target, case=case, passed=r["vs_dense"] <= 1.2, detail=detail))
  return targets


def main() -> None:
  parser = bench_utils.parser(__doc__, "train_step")
  parser.add_argument(
      "--configs", nargs="+", default=["quickstart", "celeba_small"], choices=sorted(CONFIGS)
  )
  parser.add_argument("--experts", type=int, nargs="+", default=[4, 32])
  parser.add_argument("--top_k", type=int, default=2)
  parser.add_argument(
      "--dispatch",
      nargs="+",
      default=["sort"],
      choices=["dense", "einsum", "sort", "sort_blocks", "dropless", "blocksparse"],
  )
  parser.add_argument(
      "--methods",
      nargs="+",
      default=["fairsmoe", "fairsmoe_no_fem"],
      help="methods timed besides vanilla SMoE (first --dispatch only); fairmoe_jax.methods "
      "keys. fairsmoe_no_fem isolates FGR: without FEM there is no specialization loss, whose "
      "default reading (expert_competence) runs every expert on every token",
  )
  parser.add_argument("--batch_size", type=int, default=0, help="0: the config's")
  parser.add_argument("--compute_dtype", default="", choices=["", "float32", "bfloat16"])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument(
      "--program",
      default="",
      metavar="FILE[:ARG]",
      help="instead of the rows above: the preflight's train-step program of this run config, "
      "timed on one device (measure_program) after --warmup steps, with --set's settings",
  )
  parser.add_argument("--set", default="{}", help='JSON settings of --program: {"batch_size": 8}')
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()
  if args.program:
    config = load_config(args.program)
    config.update_from_flattened_dict(json.loads(args.set))
    row = dict(config=args.program, **measure_program(config, args.warmup, args.steps))
    write_results(args.output, args, [row], [])
    return

  # 0 and "": the config's batch size and compute dtype.
  options = dict(top_k=args.top_k, batch_size=args.batch_size, compute_dtype=args.compute_dtype)
  # Per E: vanilla SMoE with each dispatch, then each other method with the first dispatch.
  pairs = [(d, "vanilla_smoe") for d in args.dispatch]
  pairs += [(args.dispatch[0], m) for m in args.methods]
  cases = [dict(num_experts=args.experts[0], dispatch="sort", method="vanilla_smoe", dense=True)]
  cases += [
      dict(num_experts=e, dispatch=d, method=m, dense=False) for e in args.experts for d, m in pairs
  ]
  rows = []
  for name in args.configs:
    # One config at a time, so only its states are held.
    compiled = [benchmark(name, **case, **options) for case in cases]
    print(f"  {name}: {len(cases)} steps compiled, timing", flush=True)
    time_interleaved([r for r, _ in compiled], [s for _, s in compiled], args.steps)
    rows += [r for r, _ in compiled]
    del compiled
  peak = matmul_peak()
  add_ratios(rows, peak)
  columns = "config method num_experts dispatch batch_size compile_s step_ms vs_dense images_per_s"
  columns = [(c, c, 3) for c in [*columns.split(), "model_gflops_per_s", "share_of_peak"]]
  args.peak_flops_per_s = peak
  how = f"float32 matmul peak (2048^2) {peak / 1e9:.1f} GFLOP/s, median of {args.steps} steps"
  bench_utils.finish(args, rows, columns, evaluate_targets(rows), how)


if __name__ == "__main__":
  main()
