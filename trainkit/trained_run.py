"""A trained run restored from its workdir alone (config, run_info.json, latest checkpoint) for
inference: what each package's `inference.py` builds `--mode=predict` and `load_run` on."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Self

import flax.nnx as nnx
import ml_collections
from jax.sharding import Mesh

from trainkit import recipe
from trainkit.checkpoint import restore_trained
from trainkit.train_state import TrainState


@dataclasses.dataclass(eq=False)
class TrainedRun:
  """A trained run's latest checkpoint, ready for inference (`restore`): its workdir, config
  (with `load_run`'s overrides), run_info.json `metadata`, step, and `data`: what the package
  builds the model from without a dataset (the dataset's names, or the tokenizer and label names).
  """

  workdir: str
  config: ml_collections.ConfigDict
  metadata: Any
  data: Any
  graphdef: nnx.GraphDef
  state: TrainState
  mesh: Mesh
  step: int

  @classmethod
  def restore(
      cls,
      config: ml_collections.ConfigDict,
      workdir: str,
      metadata: Any,
      data: Any,
      create_state: Callable[..., tuple[nnx.GraphDef, TrainState]],
  ) -> Self:
    """The latest readable checkpoint of `workdir` (UserError if none); `create_state` is the
    package's `train.create_state(config, data, tx, mesh, *, pretrained)`."""
    run = recipe.setup(
        config,
        workdir,
        train_examples=0,  # num_train_steps is config.json's, resolved at training time.
        create_state=lambda tx, mesh: create_state(config, data, tx, mesh, pretrained=False),
        training=False,
    )
    state, step = restore_trained(run.checkpointer, run.state)
    return cls(workdir, config, metadata, data, run.graphdef, state, run.mesh, step)

  @functools.cached_property
  def model(self) -> nnx.Module:
    """The Flax NNX model with the checkpoint's parameters."""
    return nnx.merge(self.graphdef, self.state.params, self.state.model_state)
