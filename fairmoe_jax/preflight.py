"""What a fairmoe_jax run is made of, for `--mode=compile` (`trainkit.preflight`): `train.py`'s
model and loss, `evaluation.py`'s eval step, and the dataset described from the config alone,
so a run compiles for an accelerator on a machine without the data.
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from fairmoe_jax import data as data_lib
from fairmoe_jax.data.celeba import celeba_info
from fairmoe_jax.data.isic import isic2019_info
from fairmoe_jax.evaluation import make_eval_step
from fairmoe_jax.methods import METHODS
from fairmoe_jax.methods.base import resolve_dispatch
from fairmoe_jax.train import make_loss_fn
from trainkit.preflight.compile import Program

# Training examples of each dataset at full size: CelebA's official train partition
# (list_eval_partition.txt, 162,770 images); ISIC 2019's 25,331 training images less the
# random split's test and validation parts (fairmoe_jax/data/isic.py, random_split).
CELEBA_TRAIN_EXAMPLES = 162_770
CELEBA_VAL_EXAMPLES = 19_867
ISIC2019_IMAGES = 25_331
# Training images one host core decodes and augments per second (224 px CelebA JPEGs, the default
# uint8 pipeline): the lower of the two lent H200 hosts' rows with 15 grain workers on 16 cores
# (benchmarks/results/h200_2026-11-2*/device.json, input_pipeline; a test checks).
IMAGES_PER_S_PER_CORE = 440.0


def dataset_info(config: ml_collections.ConfigDict) -> data_lib.DatasetInfo:
  """The DatasetInfo a run of `config` would load, from the config alone."""
  d = config.data
  if d.name in data_lib.GENERATED_INFO:
    return data_lib.generated_info(d)[0]
  sensitive = data_lib.sensitive_names(d)
  if d.name in ("celeba", "celeba_tfds"):
    return celeba_info(d.target, sensitive, d.image_size)
  return isic2019_info(sensitive, d.missing, d.image_size)


def split_sizes(config: ml_collections.ConfigDict) -> tuple[int, str, int]:
  """(training examples per epoch at full size, where that number comes from, examples of the
  validation split each evaluation reads); 0 where the config alone does not tell."""
  d = config.data
  if d.name in data_lib.GENERATED_INFO:
    return d.train_size, "data.train_size", d.val_size
  if d.name in ("celeba", "celeba_tfds"):  # The official partition's (identity folds differ).
    return CELEBA_TRAIN_EXAMPLES, "CelebA's official train partition", CELEBA_VAL_EXAMPLES
  if d.split != "random":
    return 0, "", 0
  n_test = round(d.test_fraction * ISIC2019_IMAGES)
  n_val = round(d.val_fraction * (ISIC2019_IMAGES - n_test))
  source = "ISIC 2019's training images less the random split's test and val"
  return ISIC2019_IMAGES - n_test - n_val, source, n_val


def batch_spec(
    config: ml_collections.ConfigDict, info: data_lib.DatasetInfo, batch_size: int, *, eval: bool
) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch the input pipeline yields (`data.train_iterator`, `data.eval_batches`):
  uint8 pixels, normalised inside the compiled steps."""
  size = config.data.image_size
  spec = {
      "image": jax.ShapeDtypeStruct((batch_size, size, size, 3), np.uint8),
      "label": jax.ShapeDtypeStruct((batch_size,), np.int32),
      "attributes": jax.ShapeDtypeStruct((batch_size, info.num_attributes), np.int32),
      "mask": jax.ShapeDtypeStruct((batch_size,), np.float32),
  }
  if eval:
    spec["index"] = jax.ShapeDtypeStruct((batch_size,), np.int32)
  return spec


def preflight_program(config: ml_collections.ConfigDict, mesh: Mesh) -> Program:
  """The run of `config` as `trainkit.preflight` compiles it."""
  info = dataset_info(config)
  method = METHODS[config.method]
  examples, source, val_examples = split_sizes(config)
  return Program(
      make_model=lambda: method.build_model(config, info, nnx.Rngs(params=config.seed), mesh),
      loss_fn=make_loss_fn(config, info),
      train_batch=batch_spec(config, info, config.batch_size, eval=False),
      make_eval_step=lambda graphdef: make_eval_step(graphdef, info, config),
      eval_batch=batch_spec(config, info, config.eval_batch_size, eval=True),
      train_examples=examples,
      train_examples_source=source,
      initial_extra=method.initial_extra(config, info),
      settings={"moe.dispatch": resolve_dispatch(config.moe.dispatch, mesh)},
      eval_examples=val_examples,
      # The rate is of decoding JPEG files; a generated dataset is in memory already.
      input_pipeline={}
      if config.data.name in data_lib.GENERATED_INFO
      else dict(
          examples_per_s_per_core=IMAGES_PER_S_PER_CORE,
          cores=max(1, config.data.num_workers),
          cores_from=f"data.num_workers={config.data.num_workers}",
      ),
  )
