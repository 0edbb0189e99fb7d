"""The causal_attn_jax preflight (`--mode=compile`): its batches are those the real pipeline
yields, and a small run compiles for a TPU slice with the parameters of the real model."""

import importlib.util
import math

import flax.nnx as nnx
import jax
import numpy as np
import pytest

from causal_attn_jax import tasks
from causal_attn_jax.data.iterator import TrainIterator, device_batches
from causal_attn_jax.preflight import preflight_program
from conftest import ENDE, ENDE_TINY_DATA, REPO_ROOT
from trainkit.mesh import make_mesh
from trainkit.preflight.compile import preflight

# A tiny model: the compile for the TPU slice takes seconds.
TINY_MODEL = {
    "model.dim": 16,
    "model.num_layers": 1,
    "model.num_decoder_layers": 1,
    "model.num_heads": 2,
    "model.mlp_dim": 32,
}
CASES = {
    # The generated testbed (2 classes, no data files), at its own vocabulary and lengths.
    "classification": (
        "spurious_pairs.py",
        "size=small,attention=causal",
        {"batch_size": 32, "eval_batch_size": 24},
    ),
    # The OpenNMT En-De sample, cut short as tests/e2e/test_causal_cli.py cuts it.
    "translation": (
        "wmt14_ende.py",
        "size=small,attention=causal",
        {
            **ENDE_TINY_DATA,
            "data.max_source_len": 12,
            "data.max_target_len": 10,
            "nmt.max_decode_len": 8,
            "batch_size": 16,
            "eval_batch_size": 8,
        },
    ),
}


def _config(case):
  name, arg, overrides = CASES[case]
  spec = importlib.util.spec_from_file_location(name[:-3], REPO_ROOT / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  config.update_from_flattened_dict({**TINY_MODEL, **overrides})
  return config


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  """(config, TaskData) of a case, its data read and its tokenizer trained as a run does."""
  cache = {}

  def load(case):
    if case == "translation" and not ENDE.is_dir():
      pytest.skip("needs ../shared/data/translation")
    if case not in cache:
      config = _config(case)
      workdir = tmp_path_factory.mktemp(case)
      cache[case] = config, tasks.get_task(config).load_data(config, str(workdir))
    return cache[case]

  return load


def _shapes(batch):
  return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_batches_are_the_pipelines(case, loaded):
  config, data = loaded(case)
  mesh = make_mesh(config.mesh, jax.devices())
  program = preflight_program(config, mesh)
  task = tasks.get_task(config)
  # What recipe.train gets from the real iterator, and run_eval from device_batches.
  train_iterator = TrainIterator(
      data.train, config.batch_size, seed=config.seed, seq_keys=task.seq_keys
  )
  assert _shapes(program.train_batch) == _shapes(next(train_iterator))
  splits = [data.eval] + ([data.challenge] if data.challenge is not None else [])
  for split in splits:
    host_batch, batch = next(device_batches(split, config.eval_batch_size, mesh))
    assert _shapes(program.eval_batch) == _shapes(batch) == _shapes(host_batch)


def test_small_run_compiles_for_v5e_8_with_the_real_models_parameters(loaded):
  config, data = loaded("classification")
  config = config.copy_and_resolve_references()
  config.preflight.target = "v5e-8"
  record = preflight(config, preflight_program)
  assert record["target"]["name"] == "v5e-8" and record["mesh"] == {"data": 8, "expert": 1}
  assert record["fits"] and record["train_step"]["fits"] and record["eval_step"]["fits"]
  assert record["run"]["num_train_steps"] == config.num_train_steps
  # The model of a real run: its vocabulary and classes from the trained tokenizer and the
  # generated data. Data parallel, so every device holds every parameter.
  model = tasks.get_task(config).build_model(config, data, nnx.Rngs(params=config.seed))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  expected = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params)
  assert record["train_step"]["memory"]["parameters"] == expected
  assert record["train_step"]["flops_per_device"] > 0
