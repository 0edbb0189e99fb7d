"""What a causal_attn_jax run is made of, for `--mode=compile` (`trainkit.preflight`): `train.py`'s
model, loss and multiplier update, `evaluation.py`'s eval step, and the data described from the
config alone (no tokenizer trained), so a run compiles on a machine without the data.
"""

from __future__ import annotations

import types

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import tasks
from causal_attn_jax.data import nli
from causal_attn_jax.data.batching import MASK_KEY
from causal_attn_jax.data.loading import TaskData
from causal_attn_jax.evaluation import make_eval_step
from causal_attn_jax.train import initial_extra, make_loss_fn, make_update_extra
from trainkit.preflight.compile import Program


def num_classes(config: ml_collections.ConfigDict) -> int:
  """Labels of a pair-classification run, as `data.loading.load_pairs` would find them: the
  testbeds are 2-way, a tfds dataset's task is its name's, files follow `data.pair_task`.
  """
  d = config.data
  if d.generator:
    return len(nli.HANS_LABELS)
  task = d.pair_task
  if config_lib.uses_tfds(config) and d.tfds_name in nli.TFDS_PAIR_DATASETS:
    task = nli.TFDS_PAIR_DATASETS[d.tfds_name][0]
  return len(nli.NLI_LABELS if task == "nli" else nli.PARAPHRASE_LABELS)


def batch_spec(
    config: ml_collections.ConfigDict, batch_size: int, *, eval: bool
) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch `TrainIterator` (train) or `device_batches` (eval, with `mask`) yields:
  the int32 arrays of `data.loading` (`_encode_pairs`, `_encode_parallel`)."""
  d = config.data
  ids = lambda length: jax.ShapeDtypeStruct((batch_size, length), np.int32)
  if config.task == "classification":
    spec = {
        "ids": ids(d.max_len),
        "segment_ids": ids(d.max_len),
        "label": jax.ShapeDtypeStruct((batch_size,), np.int32),
    }
  else:
    spec = {
        "src": ids(d.max_source_len),
        "tgt_in": ids(d.max_target_len),
        "tgt_out": ids(d.max_target_len),
    }
  if eval:
    spec[MASK_KEY] = jax.ShapeDtypeStruct((batch_size,), np.bool_)
  return spec


def preflight_program(config: ml_collections.ConfigDict, mesh: Mesh) -> Program:
  """The run of `config` as `trainkit.preflight` compiles it."""
  del mesh  # build_model takes none: the recipe's shardings are abstract_train_state's.
  task = tasks.get_task(config)
  # What build_model reads of the data: of the tokenizer, its size alone (SentencePiece makes
  # data.vocab_size pieces or refuses the corpus: at worst an upper bound).
  tokenizer = types.SimpleNamespace(vocab_size=config.data.vocab_size)
  classes = num_classes(config) if config.task == "classification" else 0
  data = TaskData(tokenizer=tokenizer, train={}, eval={}, num_classes=classes)
  # A generated testbed is generated in full; the size of data read from files or tfds is not
  # read here (a run that counts epochs gives `preflight.train_examples`).
  examples, source = 0, ""
  if config.data.generator:
    key = config_lib.GENERATORS[config.data.generator][0]
    examples, source = config.data[key].num_train, f"data.{key}.num_train"
  return Program(
      make_model=lambda: task.build_model(config, data, nnx.Rngs(params=config.seed)),
      loss_fn=make_loss_fn(config),
      train_batch=batch_spec(config, config.batch_size, eval=False),
      make_eval_step=lambda graphdef: make_eval_step(graphdef, config),
      eval_batch=batch_spec(config, config.eval_batch_size, eval=True),
      train_examples=examples,
      train_examples_source=source,
      update_extra=make_update_extra(config),
      initial_extra=initial_extra(config),
  )
