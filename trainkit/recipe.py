"""The skeleton every model's recipe shares: set a run up, train it, and finish it.

A package's `train.py` stays the readable, linear recipe of its model (its data, its state,
its loss, its report); what every recipe does alike lives here once:

  run = setup(config, workdir, train_examples=n, create_state=...)   # mesh, optimizer, state,
                                                                     # checkpointer
  trained = train(run, train_iterator=..., loss_fn=..., ...)         # resume, jit, the loop
  if trained is None: return None                                    # preempted: checkpointed
  finish(run, trained.state, report, writer=trained.writer, ...)     # report, close, write

and for a trained workdir (`--mode=eval`, `predict`, `export`):

  run = setup(config, workdir, ..., training=False)
  state, step = restore_trained(run.checkpointer, run.state)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Sequence

import flax.nnx as nnx
import jax
import ml_collections
import optax
from jax.sharding import Mesh

from trainkit import storage
from trainkit.checkpoint import Checkpointer, checkpoint_report
from trainkit.config import resolve_train_steps
from trainkit.loop import (
    CheckpointableIterator,
    loop_settings,
    resume_training,
    stop_after_preemption,
    train_loop,
)
from trainkit.mesh import make_mesh
from trainkit.metric_writers import MetricWriter
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.train_state import (
    LossFn,
    TrainState,
    UpdateExtraFn,
    jit_train_step,
    make_train_step,
)
from trainkit.workdir import save_run_info

# create_state(tx, mesh) -> (graphdef, initial state placed on the mesh).
CreateState = Callable[[optax.GradientTransformation, Mesh], tuple[nnx.GraphDef, TrainState]]
Review = tuple[int, Callable[[TrainState], tuple[TrainState, Mapping[str, Any]]]]


@dataclasses.dataclass
class Run:
  """What a run is made of before any step: its config (with the step count resolved), mesh,
  optimizer, the model's graph, the initial state and the workdir's checkpointer."""

  config: ml_collections.ConfigDict
  workdir: str
  mesh: Mesh
  tx: optax.GradientTransformation
  graphdef: nnx.GraphDef
  state: TrainState
  checkpointer: Checkpointer


@dataclasses.dataclass
class Trained:
  """The state `train` ended with and the open metrics writer (the final report logs to it)."""

  state: TrainState
  writer: MetricWriter


def setup(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    train_examples: int,
    create_state: CreateState,
    training: bool = True,
) -> Run:
  """Resolves the step count (epochs need the train split's size), builds the optimizer and
  the initial state on the config's mesh, and opens `<workdir>/checkpoints`."""
  mesh = make_mesh(config.mesh)
  resolve_train_steps(config, train_examples, training=training)
  tx = make_optimizer(config.optimizer, config.num_train_steps, config.batch_size)
  graphdef, state = create_state(tx, mesh)
  checkpointer = Checkpointer(
      storage.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints
  )
  return Run(config, workdir, mesh, tx, graphdef, state, checkpointer)


def train(
    run: Run,
    *,
    train_iterator: CheckpointableIterator,
    loss_fn: LossFn,
    update_extra: UpdateExtraFn | None = None,
    tokens_per_example: int = 0,
    evaluate: Callable[[TrainState], Mapping[str, Any]] | None = None,
    reviews: Sequence[Review] = (),
    run_info: Mapping[str, Any] | None = None,
) -> Trained | None:
  """Trains `run` to `config.num_train_steps`, resuming from its latest checkpoint.

  `run_info`, what inference needs besides config.json and the checkpoints (class names,
  preprocessing, ...), is written to `<workdir>/run_info.json` beside config.json once the
  checkpoints accepted the config, so that a trained workdir predicts without its dataset.

  Returns None when SIGTERM stopped the run (its checkpoint is saved and the writers closed;
  the same command resumes it). Otherwise the metrics log is flushed, so the final report may
  read it.
  """
  config = run.config
  is_main = jax.process_index() == 0
  writer = MetricWriter(run.workdir, enabled=is_main)
  state = resume_training(config, run.workdir, run.state, run.checkpointer, train_iterator, writer)
  if run_info is not None:
    save_run_info(dict(run_info), run.workdir)
  schedule = learning_rate_schedule(config.optimizer, config.num_train_steps, config.batch_size)
  train_step = jit_train_step(
      make_train_step(run.graphdef, loss_fn, run.tx, schedule, update_extra=update_extra),
      state,
      run.mesh,
  )
  state, preempted = train_loop(
      state=state,
      train_step=train_step,
      train_iterator=train_iterator,
      mesh=run.mesh,
      checkpointer=run.checkpointer,
      writer=writer,
      **loop_settings(config),
      tokens_per_example=tokens_per_example,
      evaluate=evaluate if config.eval_every_steps > 0 else None,
      reviews=reviews,
      show_progress=is_main,
  )
  if preempted:
    stop_after_preemption(state, run.checkpointer, writer)
    return None
  writer.flush()
  return Trained(state, writer)


# What a run's final evaluation writes in its workdir: one record of one step.
RECORD_FILES = ("report.json", "predictions.csv")


def keep_earlier_record(workdir: str, step: int) -> str | None:
  """Moves a report of another step (and its predictions) aside before a new one is written.

  An evaluation that fell back to an older checkpoint (the newest was corrupt) must not
  destroy the record of the step it could not read: `report.json` of step N becomes
  `report.step-N.json` (likewise `predictions.csv`). Returns the kept report's name, or None
  when there was none or it was of the same step (a rerun of the same evaluation).
  """
  path = storage.join(workdir, RECORD_FILES[0])
  try:
    earlier = json.loads(storage.read_text(path)).get("step")
  except (OSError, ValueError, AttributeError):
    return None
  if not isinstance(earlier, int) or earlier == step:
    return None
  for name in RECORD_FILES:
    stem, suffix = os.path.splitext(name)
    record = storage.path(storage.join(workdir, name))
    if record.exists():
      record.replace(storage.join(workdir, f"{stem}.step-{earlier}{suffix}"))
  return f"report.step-{earlier}.json"


def finish(
    run: Run,
    state: TrainState,
    report: dict[str, Any],
    *,
    write_report: Callable[[dict[str, Any]], None],
    writer: MetricWriter | None = None,
    scalars: Mapping[str, float] | None = None,
) -> dict[str, Any]:
  """Adds the checkpoints' provenance to `report`, logs `scalars` at the final step, closes the
  writer and the checkpointer, and has process 0 write the report (`write_report(report)`)."""
  report.update(checkpoint_report(run.checkpointer))
  if jax.process_index() == 0:
    kept = keep_earlier_record(run.workdir, int(report.get("step", state.step)))
    if kept:
      report["earlier_report"] = kept
  if writer is not None:
    if scalars:
      writer.write_scalars(int(state.step), dict(scalars))
    writer.close()
  run.checkpointer.close()
  if jax.process_index() == 0:
    write_report(report)
  return report
