"""Training of a fair sparse-MoE image classifier.

`train_and_evaluate` is the whole recipe: data, model, state, `trainkit.recipe`'s resume and
loop, then the fairness report on the test split (other jobs: docs/design.md, "Module layout").
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from fairmoe_jax import data as data_lib
from fairmoe_jax import evaluation
from fairmoe_jax import report as report_lib
from fairmoe_jax import run_info as run_info_lib
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.methods import METHODS
from fairmoe_jax.methods import make_loss_fn as method_loss_fn
from fairmoe_jax.metrics import intersections as intersections_lib
from fairmoe_jax.models.convert_timm import load_timm_checkpoint
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.moe.dispatch import spmd
from trainkit import recipe, storage
from trainkit.checkpoint import restore_trained
from trainkit.errors import ConfigError, UserError
from trainkit.mesh import place, replicated
from trainkit.optim import evaluation_state
from trainkit.train_state import TrainState, create_train_state
from trainkit.workdir import save_run_info

_DATA_LOCATION_KEYS = {"celeba": "root", "isic2019": "root", "celeba_tfds": "tfds_data_dir"}


def load_data(
    config: ml_collections.ConfigDict,
) -> tuple[data_lib.DatasetInfo, dict[str, dict[str, np.ndarray]]]:
  """The dataset of `config.data`: its DatasetInfo and splits; a missing data directory (a
  workdir's config.json names where the data was) is a ConfigError naming the key.
  """
  key = _DATA_LOCATION_KEYS.get(config.data.name)
  location = config.data[key] if key else ""
  if location and storage.is_remote(location) and config.data.name != "celeba_tfds":
    raise ConfigError(
        f"data.{key}",
        f"{location!r} is not on the local disk; the {config.data.name} reader reads a local "
        "directory (the workdir may be on gs://, the data is copied to each host)",
    )
  if location and not storage.is_remote(location) and not os.path.isdir(location):
    raise ConfigError(
        f"data.{key}",
        f"directory {location!r} does not exist; set --config.data.{key}=DIR to where the "
        f"{config.data.name} data is",
    )
  return data_lib.dataset_from_config(config.data)


def load_pretrained(config: ml_collections.ConfigDict, model: nnx.Module) -> None:
  """Loads `model.pretrained` (a timm checkpoint) into the backbone, keeping the shardings."""
  # Muffin's backbones each start from the checkpoint.
  for backbone in model.backbones if isinstance(model, Muffin) else [model]:
    for note in load_timm_checkpoint(backbone, config.model.pretrained):
      logging.info("%s", note)


def make_loss_fn(config: ml_collections.ConfigDict, info: data_lib.DatasetInfo):
  return method_loss_fn(METHODS[config.method], config, info)


def create_state(
    config: ml_collections.ConfigDict,
    info: data_lib.DatasetInfo,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    pretrained: bool = True,
) -> tuple[nnx.GraphDef, TrainState]:
  """The initial train state of `config.method` on `mesh`; `pretrained=False` skips
  `model.pretrained` (a checkpoint's restore overwrites it anyway).
  """
  load_weights = None
  if pretrained and config.model.pretrained:
    load_weights = functools.partial(load_pretrained, config)
  graphdef, state = create_train_state(
      lambda: METHODS[config.method].build_model(config, info, nnx.Rngs(params=config.seed), mesh),
      tx,
      mesh,
      config.seed,
      load_weights=load_weights,
  )
  extra = METHODS[config.method].initial_extra(config, info)
  if extra:  # Checkpointed with the run (e.g. FEM's allocator state).
    state = state.replace(extra=place(extra, replicated(mesh)))
  return graphdef, state


def _setup(
    config: ml_collections.ConfigDict, workdir: str, training: bool = True
) -> tuple[data_lib.DatasetInfo, dict[str, dict[str, np.ndarray]], recipe.Run]:
  info, splits = load_data(config)
  # Empty validation or test splits found only after training would cost the whole run.
  needed = ("train", "val", "test") if training else ("test",)  # --mode=eval scores test only.
  empty = [name for name in needed if not len(splits[name]["label"])]
  if empty:
    raise UserError(
        f"data.name={config.data.name}: the {' and '.join(empty)} split(s) are empty "
        f"(load statistics: {info.load_stats}); check the partition/split file"
    )
  try:  # Checked before training: a wrong name would otherwise cost the whole run.
    intersections_lib.check_attributes(
        intersections_lib.parse_intersections(config.eval.intersections), info.attribute_names
    )
  except ValueError as e:
    raise ConfigError("eval.intersections", str(e)) from None
  run = recipe.setup(
      config,
      workdir,
      train_examples=len(splits["train"]["label"]),
      create_state=lambda tx, mesh: create_state(config, info, tx, mesh),
      training=training,
  )
  return info, splits, run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (resuming from `workdir`'s latest checkpoint), then evaluates on the test split
  (SIGTERM: `recipe.train` checkpoints and exits)."""
  info, splits, run = _setup(config, workdir)
  mesh = run.mesh
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
      num_workers=config.data.num_workers,
      resampling=config.data.train_resampling,
  )
  if config.data.cache_eval_images:
    # Validated every eval_every_steps (and at each FEM review): decoded once here, not each time.
    splits["val"] = images_lib.preload_images(
        splits["val"], config.data.image_size, max(1, config.data.num_threads)
    )
  eval_step = evaluation.make_eval_step(run.graphdef, info, config)
  last_validation: dict[int, dict[str, Any]] = {}

  def validate(state: TrainState) -> dict[str, Any]:
    # A step that is due for both evaluation and an expert review validates once, on the
    # parameter EMA when the optimizer keeps one (FEM's reviews as the evaluations).
    step = int(state.step)
    if step not in last_validation:
      last_validation.clear()
      last_validation[step], _ = evaluation.evaluate(
          eval_step, evaluation_state(state), splits["val"], info, config, mesh
      )
    return last_validation[step]

  review = METHODS[config.method].review(
      config, info, graphdef=run.graphdef, mesh=mesh, validate=validate
  )
  # Class names and preprocessing: predict and export then need the workdir alone.
  run_info = run_info_lib.RunMetadata.from_dataset(info, config).to_json()
  trained = recipe.train(
      run,
      train_iterator=train_iterator,
      loss_fn=make_loss_fn(config, info),
      # Patch tokens per image, the sequence the transformer (and the MoE) processes.
      tokens_per_example=(config.data.image_size // config.model.patch_size) ** 2,
      evaluate=lambda state: report_lib.summary_scalars(validate(state), "val"),
      reviews=[review] if review else [],
      run_info=run_info,
  )
  if spmd.FALLBACKS:  # Known once the steps are traced: what ran in place of a dispatch.
    save_run_info({**run_info, "fallbacks": list(spmd.FALLBACKS)}, workdir)
  report, predictions = report_lib.final_report(
      eval_step, run.graphdef, trained.state, splits, info, config, mesh, workdir, validate
  )
  return recipe.finish(
      run,
      trained.state,
      report,
      writer=trained.writer,
      scalars=report_lib.summary_scalars(report, "test"),
      write_report=lambda r: report_lib.write_report(r, predictions, workdir, config.plots),
  )


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir` on the test split."""
  info, splits, run = _setup(config, workdir, training=False)
  state, _ = restore_trained(run.checkpointer, run.state)
  report, predictions = report_lib.final_report(
      evaluation.make_eval_step(run.graphdef, info, config),
      run.graphdef,
      state,
      splits,
      info,
      config,
      run.mesh,
      workdir,
  )
  return recipe.finish(
      run,
      state,
      report,
      write_report=lambda r: report_lib.write_report(r, predictions, workdir, config.plots),
  )
