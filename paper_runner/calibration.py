r"""The preflight's step time against public training throughputs: the calibration of docs/scaling.md.

  python -m paper_runner.calibration --compile                # compile the missing rows (minutes)
  python -m paper_runner.calibration --compile --only=h100    # rows whose name matches
  python -m paper_runner.tables --write=docs/scaling.md       # render its table (and --check)

`--mode=compile` turns a compiled step into a time: its roofline bound divided by a
utilisation, the share of that bound a real step reaches. Each row is a public training run and
our backbone of the same shape compiled for the same target, batch and mesh (in a process of
its own: `--row=NAME`, which prints it); utilisation = roofline bound / public step time.
`trainkit.preflight.calibration` keeps the per-platform figure (a test checks it against the
record); docs/scaling.md says what the public figures are and are not.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

import ml_collections
from absl import app, flags

from paper_runner import preflight_table
from paper_runner.spec import REPO_ROOT
from trainkit.config_files import resolve_config_path
from trainkit.distributed import child_environment
from trainkit.errors import UserError, exit_on_user_error
from trainkit.preflight.targets import TARGETS

NAME = "calibration"
RECORD = os.path.join("results", "records", f"{NAME}.json")
IMAGENET_TRAIN_IMAGES = 1_281_167

# Public training throughputs. images_per_s is a (low, high) range where the source gives one.
PUBLIC_RUNS: tuple[dict[str, Any], ...] = (
    dict(
        name="vit_s16@v3-8",
        model="ViT-S/16",
        backbone="deit_s",
        target="v3-8",
        batch=1024,
        # "This should take 6-7h to finish 90ep on a TPU-v3-8": 90 epochs of its split,
        # train[:99%], in 7 h (low) to 6 h (high), evaluation and input included.
        images_per_s=(
            90 * 0.99 * IMAGENET_TRAIN_IMAGES / (7 * 3600),
            90 * 0.99 * IMAGENET_TRAIN_IMAGES / (6 * 3600),
        ),
        # models/vit.py's dtype_mm defaults to float32 and the config does not set it.
        compute_dtype="float32",
        framework="big_vision (JAX), float32",
        source="google-research/big_vision, big_vision/configs/vit_s16_i1k.py (docstring: "
        "90 epochs in 6-7 h on a TPU v3-8; config: batch 1024, split train[:99%], 224 px, "
        "dtype_mm unset, so float32)",
    ),
    dict(
        name="vit_s16_300ep@v3-8",
        model="ViT-S/16, 300 epochs",
        backbone="deit_s",
        target="v3-8",
        batch=1024,
        # "300 epochs of training reach 80% in less than one day": a bound on the time, so the
        # rate (and the utilisation) is a floor.
        images_per_s=(300 * 0.99 * IMAGENET_TRAIN_IMAGES / (24 * 3600),) * 2,
        compute_dtype="float32",
        framework="big_vision (JAX), float32",
        source="Beyer, Zhai, Kolesnikov, Better plain ViT baselines for ImageNet-1k "
        "(arXiv:2205.01580), abstract: 300 epochs in under a day on the TPU v3-8 of its 90-epoch "
        "figure; vit_s16_i1k.py with --config.total_epochs 300, as its docstring says",
    ),
    # DeiT's recipe reproduced in JAX on a v4-64 (32 chips), 300 epochs of all of ImageNet-1k,
    # evaluation every epoch included; the model and its loss run in float32 (no dtype set).
    *(
        dict(
            name=f"deit_{size.lower()}16@v4-64",
            model=f"DeiT-{size}/16, 300 epochs",
            backbone=f"deit_{size.lower()}",
            target="v4-64",
            batch=1024,
            images_per_s=(300 * IMAGENET_TRAIN_IMAGES / seconds,) * 2,
            compute_dtype="float32",
            framework="deit3-jax (JAX), float32, pure data parallel, 32 per chip",
            source=f"affjljoo3581/deit3-jax, README.md (DeiT Reproduction, {size}/16, 300 epochs: "
            f"{took} on a v4-64) and config/deit/deit-{size.lower()}16-224-in1k-300ep.sh (batch "
            "1024, 224 px); src/modeling.py and src/training.py set no dtype",
        )
        for size, took, seconds in (
            ("S", "2h 43m", 2 * 3600 + 43 * 60),
            ("B", "4h 40m", 4 * 3600 + 40 * 60),
        )
    ),
    *(
        dict(
            name=f"vit_b16@{gpu.lower()}x8",
            model="ViT-B/16",
            backbone="deit_b",
            target=f"{gpu.lower()}x8",
            batch=4096,
            images_per_s=(samples_per_s, samples_per_s),
            compute_dtype="bfloat16",
            framework="t5x (JAX), bfloat16, pure data parallel, 512 per GPU",
            source="NVIDIA/JAX-Toolbox, rosetta/rosetta/projects/vit/README.md (Pre-training "
            f"Performance Results, ViT-B/16, 8 GPUs: {samples_per_s} samples/s on {gpu})",
        )
        for gpu, samples_per_s in (("A100", 7200.38), ("H100", 11669.52))
    ),
)

# Our own steps measured on a lent GPU (benchmarks/accelerator_check.py), each beside the
# preflight of its chip compiled beforehand with the pinned jax.
MEASURED = tuple(
    (f"benchmarks/results/{lease}/device.json", f"benchmarks/results/{lease}/preflight_h200x1.json")
    for lease in ("h200_2026-11-27", "h200_2026-11-28")
)
# One program compiled deviceless by each tested jax (0.10.2, 0.11.2); `record#cell` is a cell
# of the paper table's record.
JAX_PAIRS = (
    (
        "benchmarks/results/h200_2026-11-27/preflight_h200x1.json",
        "benchmarks/results/h200_2026-11-27/preflight_h200x1_jax0.11.2.json",
    ),
    *(
        (
            f"{preflight_table.RECORD}#{method}/{backbone}@h100x1",
            f"benchmarks/results/h100x1_jax0.11.2_2026-11-27/{method}_{backbone}.json",
        )
        for method in ("muffin", "multifair")
        for backbone in ("deit_b", "swin_s", "swin_b")
    ),
)

# --compile, --only, --write and --check are preflight_table's (one flag of each name).
_ROW = flags.DEFINE_string("row", "", "compile this public run alone and print its row's JSON")


def _load() -> dict[str, Any]:
  return preflight_table.load(RECORD, "rows")


def compile_missing(pattern: str) -> None:
  for run in PUBLIC_RUNS:
    row = _load()["rows"].get(run["name"])
    # A row recorded without `compute_dtype` was compiled in bfloat16.
    done = row is not None and row.get("compute_dtype", "bfloat16") == run["compute_dtype"]
    if pattern not in run["name"] or done:
      continue
    print(f"compiling {run['name']} ...", flush=True)
    command = [sys.executable, "-m", "paper_runner.calibration", f"--row={run['name']}"]
    env = child_environment({"TF_CPP_MIN_LOG_LEVEL": "1", "JAX_PLATFORMS": "cpu"})
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
      raise UserError(f"{run['name']} failed:\n{result.stderr[-3000:]}")
    row = json.loads(result.stdout.splitlines()[-1])  # The row is the child's last line.
    row.update(
        command=f"python -m paper_runner.calibration --row={run['name']}",
        date=datetime.date.today().isoformat(),
    )
    preflight_table.save(run["name"], row, RECORD, "rows")
    print(f"  roofline {row['roofline_s'] * 1e3:.1f} ms ({row['bound_by']}-bound)", flush=True)


def _config(run: dict[str, Any]) -> ml_collections.ConfigDict:
  """The paper's CelebA config with the row's backbone, batch, compute dtype and target."""
  spec = importlib.util.spec_from_file_location("celeba", resolve_config_path("configs/celeba.py"))
  celeba = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(celeba)
  config = celeba.get_config(f"method=multifair,backbone={run['backbone']}")
  config.batch_size = run["batch"]
  config.compute_dtype = run["compute_dtype"]
  config.num_epochs = 0
  config.num_train_steps = 1
  config.preflight.target = run["target"]
  config.preflight.eval_step = False
  config.preflight.utilization = 1.0  # The bound itself: the utilisation is what we measure.
  return config


def _plain_classifier_program(config: ml_collections.ConfigDict, mesh: Any) -> Any:
  """Our backbone as the public runs train it: softmax cross-entropy on 1000 classes, no MoE
  block, no fairness term."""
  # Imported here: rendering and checking the table need no jax.
  # pylint: disable=import-outside-toplevel
  import flax.nnx as nnx
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from fairmoe_jax.data.augment import normalize_on_device
  from fairmoe_jax.models.backbones import build_backbone
  from trainkit.preflight.compile import Program

  del mesh
  size, batch = config.data.image_size, config.batch_size

  def loss_fn(model, batch, rng, step, extra):
    del step, extra
    logits, _ = model(normalize_on_device(batch["image"]), train=True, rngs=nnx.Rngs(dropout=rng))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}

  images = {
      "image": jax.ShapeDtypeStruct((batch, size, size, 3), np.uint8),
      "label": jax.ShapeDtypeStruct((batch,), np.int32),
  }
  return Program(
      make_model=lambda: build_backbone(config, 1000, None, nnx.Rngs(params=0)),
      loss_fn=loss_fn,
      train_batch=images,
      make_eval_step=lambda graphdef: None,
      eval_batch=images,
  )


def compile_row(name: str) -> dict[str, Any]:
  """The preflight of public run `name`'s shape: its roofline bound and what it rests on."""
  from trainkit.preflight.compile import preflight  # pylint: disable=import-outside-toplevel

  runs = {run["name"]: run for run in PUBLIC_RUNS}
  if name not in runs:
    raise UserError(f"--row: no public run named {name!r}; known: {', '.join(runs)}")
  start = time.perf_counter()
  record = preflight(_config(runs[name]), _plain_classifier_program)
  seconds = round(time.perf_counter() - start)
  return dict(
      preflight_table.brief(record), compute_dtype=runs[name]["compute_dtype"], seconds=seconds
  )


def utilisation(run: dict[str, Any], row: dict[str, Any]) -> tuple[float, float]:
  """(low, high) roofline bound / public step time, from the public range of images/s."""
  low, high = run["images_per_s"]
  return row["roofline_s"] * low / run["batch"], row["roofline_s"] * high / run["batch"]


def mfu(run: dict[str, Any], row: dict[str, Any]) -> tuple[float, float]:
  """(low, high) model FLOPs (XLA's count of our compiled step) per second at the public rate,
  over the devices' peak in the run's dtype (float32 at JAX's default precision: TF32 on a GPU,
  one bfloat16 pass on a TPU)."""
  peak = TARGETS[run["target"]].peak_flops(run["compute_dtype"])
  steps_per_s = [rate / run["batch"] for rate in run["images_per_s"]]
  return tuple(row["flops_per_device"] * steps / peak for steps in steps_per_s)


def _public_ranges(record: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
  """Per platform, the utilisation range of each compiled public row."""
  found: dict[str, list[tuple[float, float]]] = {}
  for run in PUBLIC_RUNS:
    row = record["rows"].get(run["name"])
    if row is None or not row.get("roofline_s"):
      continue
    platform = "tpu" if run["target"].startswith("v") else "gpu"
    found.setdefault(platform, []).append(utilisation(run, row))
  return found


def calibrated_utilisation(record: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
  """Per platform: the mid-point of each row's utilisation range, averaged over the platform's
  rows, and the lowest and highest value any row allows."""
  found = _public_ranges(record if record is not None else _load())
  return {
      platform: dict(
          utilization=sum((lo + hi) / 2 for lo, hi in ranges) / len(ranges),
          low=min(lo for lo, _ in ranges),
          high=max(hi for _, hi in ranges),
          rows=len(ranges),
      )
      for platform, ranges in found.items()
  }


def _json(path: str) -> dict[str, Any]:
  with open(os.path.join(REPO_ROOT, path)) as f:
    return json.load(f)


def measured_utilisation() -> list[float]:
  """Roofline bound / measured step of each of our measured one-GPU steps (`MEASURED`)."""
  found = []
  for device, prediction in MEASURED:
    measured, compiled = _json(device)["parts"]["train_step"]["measured"], _json(prediction)
    if measured["device_kind"] != compiled["target"]["device_kind"]:
      raise ValueError(f"{device} measured another chip than {prediction} compiled for")
    found.append(compiled["train_step"]["roofline"]["bound_s"] / measured["step_seconds"])
  return found


def jax_spread() -> float:
  """The largest ratio between the roofline bounds the two tested jax versions compile for one
  program (`JAX_PAIRS`)."""

  def bound(path: str) -> float:
    file, _, cell = path.partition("#")
    record = _json(file)
    return (
        record["cells"][cell]["roofline_s"] if cell else record["train_step"]["roofline"]["bound_s"]
    )

  return max(max(a, b) / min(a, b) for a, b in ((bound(p), bound(q)) for p, q in JAX_PAIRS))


def band(record: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
  """Per platform, the utilisations bounding the step range the preflight prints: the lowest and
  highest of every calibration point (each public row's range; on GPU our measured steps too),
  divided and multiplied by `jax_spread` (recorded on GPU, applied to both)."""
  spread, measured = jax_spread(), {"gpu": measured_utilisation()}
  found = {}
  for platform, ranges in _public_ranges(record if record is not None else _load()).items():
    points = [u for r in ranges for u in r] + measured.get(platform, [])
    found[platform] = dict(
        low=min(points) / spread,
        high=max(points) * spread,
        measured=len(measured.get(platform, [])),
        spread=spread,
    )
  return found


def table(record: dict[str, Any] | None = None) -> str:
  record = record if record is not None else _load()
  lines = [
      "| Public run | Target | Global batch | Public images/s | Public step (ms) "
      "| Our roofline bound (ms) | Bound by | Utilisation (bound / public step) | MFU |",
      "|---|---|---:|---:|---:|---:|---|---:|---:|",
  ]
  for run in PUBLIC_RUNS:
    row = record["rows"].get(run["name"])
    low, high = run["images_per_s"]
    shown = f"{low:,.0f}" if low == high else f"{low:,.0f}-{high:,.0f}"
    step = run["batch"] / high * 1e3, run["batch"] / low * 1e3
    step_shown = f"{step[0]:.0f}" if low == high else f"{step[0]:.0f}-{step[1]:.0f}"
    head = f"| {run['model']}, {run['framework']} | {run['target']} | {run['batch']} | {shown} "
    if row is None:
      lines.append(f"{head}| {step_shown} | not compiled | | | |")
      continue
    u, m = utilisation(run, row), mfu(run, row)
    u_shown = f"{u[0]:.2f}" if low == high else f"{u[0]:.2f}-{u[1]:.2f}"
    m_shown = f"{m[0]:.0%}" if low == high else f"{m[0]:.0%}-{m[1]:.0%}"
    figures = f"{row['roofline_s'] * 1e3:.1f} | {row['bound_by']} | {u_shown} | {m_shown}"
    lines.append(f"{head}| {step_shown} | {figures} |")
  lines.append("")
  for platform, c in sorted(calibrated_utilisation(record).items()):
    lines.append(
        f"- **{platform.upper()}**: utilisation {c['utilization']:.2f} (rows allow "
        f"{c['low']:.2f}-{c['high']:.2f}; {c['rows']} row(s))."
    )
  for platform, b in sorted(band(record).items()):
    lines.append(
        f"- **{platform.upper()} band** (the printed step range): utilisation "
        f"{b['low']:.2f}-{b['high']:.2f}, every row's range and {b['measured']} measured step(s) "
        f"widened by the jax versions' spread of the roofline, {b['spread']:.2f}x."
    )
  lines.append("")
  lines.append("Sources:")
  for run in PUBLIC_RUNS:
    lines.append(f"- {run['name']}: {run['source']}.")
  dates = sorted({row.get("date", "?") for row in record["rows"].values()})
  versions = sorted({row["provenance"].get("jax", "?") for row in record["rows"].values()})
  lines.append("")
  lines.append(
      f"Compiled {', '.join(dates)} with jax {', '.join(versions)} on this CPU (deviceless), by "
      "`python -m paper_runner.calibration --compile`; record `results/records/calibration.json`."
  )
  return "\n".join(lines) + "\n"


@exit_on_user_error
def main(argv: list[str]) -> None:
  del argv
  if _ROW.value:
    print(json.dumps(compile_row(_ROW.value)), flush=True)
    return
  if preflight_table.COMPILE.value:
    compile_missing(preflight_table.ONLY.value)


if __name__ == "__main__":
  app.run(main)
