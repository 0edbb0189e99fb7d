"""What every package's `train.py` does alike: `setup` a run, `train` it, `finish` it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Mapping, Sequence

import flax.nnx as nnx
import jax
import ml_collections
import optax
from jax.sharding import Mesh

from trainkit import storage
from trainkit.checkpoint import Checkpointer
from trainkit.config import parse_profile_steps, resolve_train_steps
from trainkit.distributed import wait_for_all_processes
from trainkit.loop import CheckpointableIterator, resume_training, train_loop
from trainkit.mesh import make_mesh
from trainkit.metric_writers import MetricWriter
from trainkit.optim import evaluation_state, learning_rate_schedule, make_optimizer
from trainkit.preemption import SIGTERM_EXIT_CODE
from trainkit.train_state import (
    LossFn,
    TrainState,
    UpdateExtraFn,
    jit_train_step,
    make_train_step,
)
from trainkit.workdir import CONFIG_FILE, save_run_info, trained_config_differences

# create_state(tx, mesh) -> (graphdef, initial state placed on the mesh).
CreateState = Callable[[optax.GradientTransformation, Mesh], tuple[nnx.GraphDef, TrainState]]
Review = tuple[int, Callable[[TrainState], tuple[TrainState, Mapping[str, Any]]]]


@dataclasses.dataclass
class Run:
  """What a run is made of before any step (its config with the step count resolved)."""

  config: ml_collections.ConfigDict
  workdir: str
  mesh: Mesh
  tx: optax.GradientTransformation
  graphdef: nnx.GraphDef
  state: TrainState
  checkpointer: Checkpointer


@dataclasses.dataclass
class Trained:
  """The state `train` ended with (its params the EMA's when the optimizer keeps one) and the open
  metrics writer (the final report logs to it)."""

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
  """Resolves the step count, builds the optimizer and the initial state on the config's mesh,
  and opens `<workdir>/checkpoints`."""
  # Processes drift apart while loading data; their first collectives must start together.
  wait_for_all_processes("the run's set-up")
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
) -> Trained:
  """Trains `run` to `config.num_train_steps`, resuming from its latest checkpoint; SIGTERM (or
  Ctrl-C) checkpoints the step reached, if any, and exits with SIGTERM_EXIT_CODE. `run_info` is
  saved once the checkpoints accept the config."""
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
      num_train_steps=config.num_train_steps,
      log_every_steps=config.log_every_steps,
      eval_every_steps=config.eval_every_steps,
      checkpoint_every_steps=config.checkpoint_every_steps,
      examples_per_step=config.batch_size,
      peak_flops=config.peak_flops_per_device,
      profile_steps=parse_profile_steps(config),
      tokens_per_example=tokens_per_example,
      # Evaluations read the parameter EMA when the optimizer keeps one (optimizer.ema_decay).
      evaluate=(lambda s: evaluate(evaluation_state(s)))
      if evaluate and config.eval_every_steps > 0
      else None,
      reviews=reviews,
      show_progress=is_main,
  )
  if preempted:  # Its checkpoint is saved; a scheduler reads the status as a pre-emption.
    run.checkpointer.close()
    writer.close()
    if is_main:
      print(f"Stopped at step {int(state.step)}; rerun the same command to resume.", flush=True)
    raise SystemExit(SIGTERM_EXIT_CODE)
  writer.flush()
  return Trained(evaluation_state(state), writer)


# What a run's final evaluation writes in its workdir: one record of one step.
RECORD_FILES = ("report.json", "predictions.csv")


def evaluated(config: ml_collections.ConfigDict, step: int) -> dict[str, Any]:
  """What an evaluation evaluated: the checkpoint's step, the data it read, a config fingerprint."""
  settings = json.dumps(config.to_dict(), sort_keys=True, default=str)
  return {
      "step": step,
      "data": json.loads(json.dumps(config.data.to_dict(), default=str))
      if "data" in config
      else {},
      "config_sha256": hashlib.sha256(settings.encode()).hexdigest(),
  }


def keep_earlier_record(workdir: str, evaluation: Mapping[str, Any]) -> str | None:
  """Moves an earlier report and predictions aside (`report.step-N[.config-SHA].json`) unless
  they record the same evaluation; returns the kept report's name, or None."""
  path = storage.join(workdir, RECORD_FILES[0])
  try:
    earlier = json.loads(storage.read_text(path))
    earlier_step = earlier.get("step")
  except (OSError, ValueError, AttributeError):
    return None
  if not isinstance(earlier_step, int):
    return None
  # A report from before reports named their config counts as another config: keep it.
  earlier_sha = (earlier.get("evaluated") or {}).get("config_sha256", "unknown")
  if earlier_step == evaluation["step"] and earlier_sha == evaluation["config_sha256"]:
    return None
  tag = f"step-{earlier_step}"
  if earlier_step == evaluation["step"]:
    tag += f".config-{earlier_sha[:12]}"
  taken = {entry.name for entry in storage.path(workdir).iterdir()}
  suffix, number = "", 1
  while any(
      f"{os.path.splitext(n)[0]}.{tag}{suffix}{os.path.splitext(n)[1]}" in taken
      for n in RECORD_FILES
  ):
    number += 1
    suffix = f".{number}"
  for name in RECORD_FILES:
    stem, extension = os.path.splitext(name)
    record = storage.path(storage.join(workdir, name))
    if record.exists():
      record.replace(storage.join(workdir, f"{stem}.{tag}{suffix}{extension}"))
  return f"report.{tag}{suffix}.json"


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
  writer and checkpointer; process 0 writes the report."""
  if run.checkpointer.skipped:  # The unreadable checkpoints the run skipped.
    report["checkpoint_fallback"] = {"skipped": list(run.checkpointer.skipped)}
  report["evaluated"] = evaluated(run.config, int(report.get("step", state.step)))
  # An evaluation's overrides (`--mode=eval --config.KEY=...`) by name, not only by fingerprint.
  trained = storage.path(storage.join(run.workdir, CONFIG_FILE)).exists()
  differences = trained_config_differences(run.workdir, run.config) if trained else []
  report["evaluated"]["differs_from_training"] = differences
  if jax.process_index() == 0:
    if differences:
      print(f"This evaluation differs from training in {'; '.join(differences)}", flush=True)
    kept = keep_earlier_record(run.workdir, report["evaluated"])
    if kept:
      report["earlier_report"] = kept
      print(
          f"Kept the earlier record as {kept} (its predictions beside it); this evaluation's "
          "is written to report.json",
          flush=True,
      )
  if writer is not None:
    if scalars:
      writer.write_scalars(int(state.step), dict(scalars))
    writer.close()
  run.checkpointer.close()
  if jax.process_index() == 0:
    write_report(report)
  return report
