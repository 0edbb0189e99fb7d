"""Training and evaluation of a fair sparse-MoE image classifier.

`train_and_evaluate` is the whole recipe, top to bottom: data, model, state,
resume, the loop (trainkit), then the fairness report on the test split.
"""

from __future__ import annotations

import json
import os
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from fairmoe_jax import data as data_lib
from fairmoe_jax.metrics import attribute_counts, fairness_report, format_report, overall_counts
from fairmoe_jax.models.vit import VisionTransformer
from trainkit.checkpoint import Checkpointer
from trainkit.errors import UserError
from trainkit.loop import train_loop
from trainkit.mesh import make_mesh, shard_batch
from trainkit.metric_writers import MetricWriter
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.train_state import TrainState, compute_dtype, create_train_state, jit_train_step, make_train_step
from trainkit.workdir import save_config


def load_data(
    config: ml_collections.ConfigDict,
) -> tuple[data_lib.DatasetInfo, dict[str, dict[str, np.ndarray]]]:
  d = config.data
  return data_lib.get_dataset(
      d.name,
      image_size=d.image_size,
      num_classes=d.num_classes,
      seed=d.seed,
      sizes={"train": d.train_size, "val": d.val_size, "test": d.test_size},
  )


def build_model(
    config: ml_collections.ConfigDict,
    info: data_lib.DatasetInfo,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
) -> VisionTransformer:
  """The ViT of `config`; with a mesh whose expert axis is > 1, its MoE is expert-parallel."""
  m, moe = config.model, config.moe
  expert_parallel = mesh is not None and mesh.shape["expert"] > 1
  return VisionTransformer(
      num_classes=info.num_classes,
      image_size=config.data.image_size,
      patch_size=m.patch_size,
      dim=m.dim,
      depth=m.depth,
      num_heads=m.num_heads,
      mlp_dim=m.mlp_dim,
      moe_blocks=tuple(moe.blocks),
      moe=dict(
          num_experts=moe.num_experts,
          top_k=moe.top_k,
          dispatch=moe.dispatch,
          capacity_factor=moe.capacity_factor,
          eval_capacity_factor=moe.eval_capacity_factor,
          router=moe.router,
          batch_priority=moe.batch_priority,
          mesh=mesh if expert_parallel else None,
      ),
      dropout_rate=m.dropout_rate,
      dtype=compute_dtype(config.compute_dtype),
      rngs=rngs,
  )


def make_loss_fn(config: ml_collections.ConfigDict):
  """Cross-entropy plus the weighted MoE auxiliary losses."""

  def loss_fn(model: VisionTransformer, batch: dict[str, jax.Array], rng: jax.Array):
    rngs = nnx.Rngs(dropout=rng, noise=jax.random.fold_in(rng, 1))
    logits, aux = model(batch["image"], train=True, rngs=rngs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    loss = ce + config.moe.aux_loss_weight * aux.loss + config.moe.z_loss_weight * aux.z_loss
    metrics = {
        "cross_entropy": ce,
        "moe_aux_loss": aux.loss,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
    }
    metrics.update({k: v for k, v in aux.metrics.items() if jnp.ndim(v) == 0})
    return loss, metrics

  return loss_fn


def make_eval_step(graphdef: nnx.GraphDef, info: data_lib.DatasetInfo):
  """Returns a jitted `eval_step(state, batch) -> counts`; counts add up over batches."""

  @jax.jit
  def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
    model = nnx.merge(graphdef, state.params, state.model_state)
    logits, _ = model(batch["image"], train=False)
    predictions = jnp.argmax(logits, -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return {
        "overall": overall_counts(
            batch["label"], predictions, batch["mask"], num_classes=info.num_classes
        ),
        "attributes": attribute_counts(
            batch["label"],
            predictions,
            batch["attributes"],
            batch["mask"],
            group_sizes=info.group_sizes,
            num_classes=info.num_classes,
        ),
        "loss_sum": jnp.sum(ce * batch["mask"]),
    }

  return eval_step


def evaluate(
    eval_step,
    state: TrainState,
    arrays: dict[str, np.ndarray],
    info: data_lib.DatasetInfo,
    config: ml_collections.ConfigDict,
    mesh: Mesh,
) -> dict[str, Any]:
  """Runs one pass over a split; returns the fairness report plus the mean loss."""
  totals = None
  for batch in data_lib.eval_batches(
      arrays,
      batch_size=config.eval_batch_size // jax.process_count(),
      image_size=config.data.image_size,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  ):
    counts = eval_step(state, shard_batch(batch, mesh))
    totals = counts if totals is None else jax.tree.map(jnp.add, totals, counts)
  totals = jax.device_get(totals)
  report = fairness_report(
      np.asarray(totals["overall"]),
      [np.asarray(c) for c in totals["attributes"]],
      info.attribute_names,
      info.group_names,
  )
  report["loss"] = float(totals["loss_sum"]) / max(report["num_examples"], 1)
  return report


def _summary_scalars(report: dict[str, Any], prefix: str) -> dict[str, float]:
  scalars = {f"{prefix}/accuracy": report["accuracy"], f"{prefix}/loss": report["loss"]}
  scalars.update({f"{prefix}/mf_{k}": v for k, v in report["mf"].items()})
  return scalars


def _write_report(report: dict[str, Any], workdir: str) -> None:
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  print(format_report(report), flush=True)


def _setup(config: ml_collections.ConfigDict, workdir: str):
  mesh = make_mesh(config.mesh)
  info, splits = load_data(config)
  tx = make_optimizer(config.optimizer, config.num_train_steps)
  graphdef, state = create_train_state(
      lambda: build_model(config, info, nnx.Rngs(params=config.seed), mesh), tx, mesh, config.seed
  )
  checkpointer = Checkpointer(
      os.path.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints
  )
  return mesh, info, splits, tx, graphdef, state, checkpointer


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Trains (resuming from the latest checkpoint in `workdir`), then evaluates on the test split.

  Returns the test report, or None when the run was stopped by SIGTERM.
  """
  mesh, info, splits, tx, graphdef, state, checkpointer = _setup(config, workdir)
  save_config(config, workdir)
  is_main = jax.process_index() == 0
  writer = MetricWriter(workdir, enabled=is_main)

  train_iterator = data_lib.train_iterator(
      splits["train"],
      global_batch_size=config.batch_size,
      image_size=config.data.image_size,
      seed=config.seed,
      augment=config.data.augment.to_dict(),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      num_threads=config.data.num_threads,
      prefetch_buffer_size=config.data.prefetch_buffer_size,
  )
  restored = checkpointer.restore(state)
  if restored is not None:
    state, iterator_state, step = restored
    train_iterator.set_state(iterator_state)
    writer.truncate_after(step)
    print(f"Resumed from the checkpoint at step {step} in {checkpointer.directory}", flush=True)

  schedule = learning_rate_schedule(config.optimizer, config.num_train_steps)
  train_step = jit_train_step(
      make_train_step(graphdef, make_loss_fn(config), tx, schedule), state, mesh
  )
  eval_step = make_eval_step(graphdef, info)

  def evaluate_val(state: TrainState) -> dict[str, float]:
    return _summary_scalars(evaluate(eval_step, state, splits["val"], info, config, mesh), "val")

  state, preempted = train_loop(
      state=state,
      train_step=train_step,
      train_iterator=train_iterator,
      mesh=mesh,
      checkpointer=checkpointer,
      writer=writer,
      num_train_steps=config.num_train_steps,
      log_every_steps=config.log_every_steps,
      eval_every_steps=config.eval_every_steps,
      checkpoint_every_steps=config.checkpoint_every_steps,
      examples_per_step=config.batch_size,
      evaluate=evaluate_val if config.eval_every_steps > 0 else None,
      show_progress=is_main,
  )
  if preempted:
    checkpointer.close()
    writer.close()
    print(f"Stopped at step {int(state.step)}; rerun the same command to resume.", flush=True)
    return None

  report = evaluate(eval_step, state, splits["test"], info, config, mesh)
  report["step"] = int(state.step)
  writer.write_scalars(int(state.step), _summary_scalars(report, "test"))
  writer.close()
  checkpointer.close()
  if is_main:
    _write_report(report, workdir)
  return report


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir` on the test split."""
  mesh, info, splits, _, graphdef, state, checkpointer = _setup(config, workdir)
  restored = checkpointer.restore(state)
  checkpointer.close()
  if restored is None:
    raise UserError(f"no checkpoint in '{checkpointer.directory}': train first (--mode=train)")
  state, _, step = restored
  report = evaluate(make_eval_step(graphdef, info), state, splits["test"], info, config, mesh)
  report["step"] = step
  if jax.process_index() == 0:
    _write_report(report, workdir)
  return report
