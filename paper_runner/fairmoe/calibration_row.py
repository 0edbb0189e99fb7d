r"""One row of the calibration of docs/scaling.md (`paper_runner.calibration`), compiled here.

  python -m paper_runner.fairmoe.calibration_row --row=vit_b16@a100x8 --out=/tmp/row.json

`python -m paper_runner.calibration --compile` runs it once per missing row, each in a fresh
process, and records what it writes to `--out`.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Sequence
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from fairmoe_jax.data.augment import normalize_on_device
from fairmoe_jax.models.backbones import build_backbone
from paper_runner.calibration import PUBLIC_RUNS
from trainkit.config_files import resolve_config_path
from trainkit.errors import UserError, exit_on_user_error
from trainkit.preflight.compile import Program, preflight

FLAGS = flags.FLAGS


def _run_named(name: str) -> dict[str, Any]:
  for run in PUBLIC_RUNS:
    if run["name"] == name:
      return run
  raise UserError(f"--row: no public run named {name!r}; known: {', '.join(r['name'] for r in PUBLIC_RUNS)}")


def calibration_config(run: dict[str, Any]):
  """The paper's CelebA config with the row's backbone, batch and target."""
  spec = importlib.util.spec_from_file_location("celeba_config", resolve_config_path("configs/celeba.py"))
  celeba = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(celeba)
  config = celeba.get_config(f"method=multifair,backbone={run['backbone']}")
  config.batch_size = run["batch"]
  config.compute_dtype = "bfloat16"
  config.num_epochs = 0
  config.num_train_steps = 1
  config.preflight.target = run["target"]
  config.preflight.eval_step = False
  config.preflight.utilization = 1.0  # The bound itself: the utilisation is what we measure.
  return config


def plain_classifier_program(config, mesh):
  """Our backbone as the public runs train it: softmax cross-entropy on 1000 classes, no MoE
  block, no fairness term."""
  del mesh
  num_classes, size, batch = 1000, config.data.image_size, config.batch_size

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
      make_model=lambda: build_backbone(config, num_classes, None, nnx.Rngs(params=0)),
      loss_fn=loss_fn,
      train_batch=images,
      make_eval_step=lambda graphdef: None,
      eval_batch=images,
  )


def compile_row(name: str) -> dict[str, Any]:
  run = _run_named(name)
  start = time.perf_counter()
  record = preflight(calibration_config(run), plain_classifier_program)
  train, run_record = record["train_step"], record["run"]
  roofline = train.get("roofline") or {}
  return dict(
      fits=record["fits"],
      peak=train["memory"].get("peak"),
      devices=record["target"]["devices"],
      mesh=record["mesh"],
      flops_per_device=train.get("flops_per_device"),
      flops_source=train.get("flops_source"),
      bytes_accessed_per_device=train.get("bytes_accessed_per_device"),
      bytes_accessed_source=train.get("bytes_accessed_source"),
      roofline_s=roofline.get("bound_s"),
      bound_by=roofline.get("bound_by"),
      collective_seconds=train.get("collective_seconds"),
      collectives={k: v["bytes"] for k, v in (train.get("collectives") or {}).items()},
      step_seconds=run_record.get("step_seconds"),
      seconds=round(time.perf_counter() - start),
      provenance=record["provenance"],
  )


@exit_on_user_error
def main(argv: Sequence[str]) -> None:
  del argv
  row = compile_row(FLAGS.row)
  with open(FLAGS.out, "w") as f:
    json.dump(row, f)


if __name__ == "__main__":
  flags.DEFINE_string("row", None, "the public run to compile (paper_runner.calibration)")
  flags.DEFINE_string("out", None, "where to write the row's JSON")
  flags.mark_flags_as_required(["row", "out"])
  app.run(main)
