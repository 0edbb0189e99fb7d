"""The training loop shared by every model: steps, logging, evaluation, checkpoints, preemption."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import posixpath
import shutil
import tempfile
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import optax
from jax.sharding import Mesh

from trainkit import storage
from trainkit.checkpoint import Checkpointer
from trainkit.errors import UserError, is_out_of_space
from trainkit.fits import require_fits
from trainkit.mesh import shard_batch
from trainkit.metric_writers import MetricWriter
from trainkit.preemption import PreemptionGuard
from trainkit.prefetch import DEFAULT_PREFETCH, DevicePrefetch
from trainkit.progress import ProgressBar
from trainkit.throughput import compile_ahead, flops_of, peak_flops_per_device, throughput_scalars
from trainkit.train_state import TrainState
from trainkit.workdir import save_config

_log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
  """The loss or gradient norm became NaN or infinite, or exploded past the run's baseline."""


# Multiples of the first step's values that are divergence (the slow parameter norm: tighter).
DIVERGENCE_FACTORS = {"loss": 1e4, "grad_norm": 1e4, "param_norm": 1e2}


def _divergence(scalars: Mapping[str, float], baseline: Mapping[str, float]) -> str:
  """Why these scalars show divergence ("" when they do not)."""
  for key, factor in DIVERGENCE_FACTORS.items():
    if key not in scalars:
      continue
    value = scalars[key]
    if not math.isfinite(value):
      return f"the {key} became {value}"
    reference = baseline.get(key)
    if reference is not None and abs(value) > factor * max(abs(reference), 1e-2):
      return (
          f"the {key} exploded to {value:.3g} (over {factor:g}x its starting value, "
          f"{reference:.3g})"
      )
  return ""


# Jitted: eagerly, optax.tree.norm compiles small ops for every parameter shape (seconds).
_tree_norm = jax.jit(optax.tree.norm)


def _starting_param_norm(state: Any) -> dict[str, float]:
  """The parameter norm before this segment's first update (the first step's is after it)."""
  params = getattr(state, "params", None)
  if params is None or not jax.tree.leaves(params):
    return {}
  return {"param_norm": float(jax.device_get(_tree_norm(params)))}


class CheckpointableIterator(Protocol):

  def __next__(self) -> Mapping[str, Any]:
    ...

  def get_state(self) -> dict:
    ...

  def set_state(self, state: dict) -> None:
    ...


def _due(step: int, every: int, last: int) -> bool:
  return step == last or (every > 0 and step % every == 0)


class _StepTrace:
  """A `jax.profiler` trace of a range of training steps (`train_loop`'s `profile_steps`)."""

  def __init__(self, steps: tuple[int, int] | None, directory: str):
    self.steps = steps
    # Each process traces its own host; one folder each, so their files never collide.
    if jax.process_count() > 1:
      directory = storage.join(directory, f"process_{jax.process_index()}")
    self.directory = directory
    # XLA's profiler has no gs://: a remote workdir's trace is written locally, then copied.
    self._local: str | None = None
    self.active = False

  def before_step(self, step: int, state: Any) -> None:
    if self.steps is None or self.active or not self.steps[0] <= step < self.steps[1]:
      return
    jax.block_until_ready(state)  # Earlier steps' asynchronous work stays out of the trace.
    if storage.is_remote(self.directory):
      self._local = tempfile.mkdtemp(prefix="trainkit_profile_")
    jax.profiler.start_trace(self._local or self.directory)
    self.active = True
    _log.warning("profiling steps %d-%d into %s", step + 1, self.steps[1], self.directory)

  def after_step(self, step: int, state: Any) -> None:
    if self.active and step >= self.steps[1]:
      self.stop(state)

  def stop(self, state: Any) -> None:
    if self.active:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
      if self._local is not None:
        for name in storage.walk_files(self._local):
          data = storage.path(os.path.join(self._local, name)).read_bytes()
          storage.makedirs(storage.join(self.directory, posixpath.dirname(name)))
          storage.path(storage.join(self.directory, name)).write_bytes(data)
        shutil.rmtree(self._local, ignore_errors=True)
        self._local = None


# The progress line: the total loss (every `loss/<term>` summed), the task's own loss, the rate.
PROGRESS_KEYS = {
    "loss": "total loss",
    "loss/cross_entropy": "task loss",
    "task_loss": "task loss",
    "learning_rate": "lr",
}


def progress_scalars(scalars: Mapping[str, float]) -> dict[str, float]:
  """The logged scalars the progress line shows, under their short names."""
  return {label: scalars[key] for key, label in PROGRESS_KEYS.items() if key in scalars}


def loss_terms_note(scalars: Mapping[str, float]) -> str | None:
  """What the progress line's total loss sums (`loss/<term>`); None without named terms."""
  terms = [key.split("/", 1)[1] for key in scalars if key.startswith("loss/")]
  terms.sort(key=lambda t: t != "cross_entropy")  # The task loss first, the rest as logged.
  if not [t for t in terms if t != "cross_entropy"]:
    return None
  named = [f"{t} (the task loss)" if t == "cross_entropy" else t for t in terms]
  return (
      f"total loss = {' + '.join(named)}; each term is logged as loss/<term> in metrics.jsonl, "
      "and the total can rise while the task loss falls (a term's weight or assignment changes)"
  )


def evaluation_summary(step: int, scalars: Mapping[str, float]) -> str:
  """One console line per evaluation: its split-level scalars ("val/accuracy"), not the
  per-attribute or per-layer ones (metrics.jsonl)."""
  top = {k: v for k, v in scalars.items() if k.count("/") == 1 and isinstance(v, (int, float))}
  prefix = next(iter(top), "eval/").split("/")[0]
  values = ", ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in top.items())
  return f"step {step} {prefix}: {values}"


@contextlib.contextmanager
def _full_disk_names_the_resume_step(checkpointer: Checkpointer):
  """A full disk in the loop's own writes becomes one OutOfSpace naming the resume step."""
  try:
    yield
  except OSError as e:
    if not is_out_of_space(e):
      raise
    raise checkpointer.out_of_space(f"writing '{e.filename}'" if e.filename else "") from e


def train_loop(
    *,
    state: TrainState,
    train_step: Callable,
    train_iterator: CheckpointableIterator,
    mesh: Mesh,
    checkpointer: Checkpointer,
    writer: MetricWriter,
    num_train_steps: int,
    log_every_steps: int,
    eval_every_steps: int,
    checkpoint_every_steps: int,
    examples_per_step: int,
    tokens_per_example: int = 0,
    peak_flops: float = 0.0,
    evaluate: Callable[[TrainState], Mapping[str, Any]] | None = None,
    reviews: Sequence[
        tuple[int, Callable[[TrainState], tuple[TrainState, Mapping[str, Any]]]]
    ] = (),
    show_progress: bool = True,
    profile_steps: tuple[int, int] | None = None,
    device_prefetch: int = DEFAULT_PREFETCH,
) -> tuple[TrainState, bool]:
  """Runs `train_step` from `state.step` to `num_train_steps`; returns (state, preempted).

  `reviews` are `(every_steps, review)` pairs: after step s with s % every_steps == 0 (not the
  last), `review(state) -> (state, scalars[, lines])` may change non-gradient state (e.g. an
  expert assignment), keeping every array's shape, dtype and sharding so nothing recompiles.
  `profile_steps` = (start, end) traces steps start+1 .. end to `<workdir>/profile`.
  """
  step = first_step = int(state.step)
  progress = ProgressBar(
      num_train_steps, initial=step, examples_per_step=examples_per_step, enabled=show_progress
  )
  preempted = False
  terms_named = False
  baseline: dict[str, float] | None = None
  starting_param_norm = _starting_param_norm(state)
  flops_per_step: float | None = None
  peak = peak_flops_per_device(jax.devices()[0], peak_flops)
  workdir = posixpath.dirname(writer.path)  # metrics.jsonl's directory, local or a URI.
  trace = _StepTrace(profile_steps, storage.join(workdir, "profile"))
  batches = DevicePrefetch(train_iterator, lambda b: shard_batch(b, mesh), device_prefetch)
  with (
      contextlib.closing(batches),
      _full_disk_names_the_resume_step(checkpointer),
      PreemptionGuard() as guard,
  ):
    while step < num_train_steps:
      checkpointer.poll()  # The save in flight: its manifest once finished, or its failure.
      trace.before_step(step, state)
      batch = next(batches)
      if flops_per_step is None and hasattr(train_step, "lower"):
        with guard.deferred():  # No step of this segment yet: nothing a signal would lose.
          compiled = compile_ahead(train_step, state, batch)
        require_fits(
            compiled,
            what="train step",
            batch_key="batch_size",
            batch_size=examples_per_step,
            batch=batch,
            prefetch=device_prefetch,
        )
        flops_per_step = flops_of(compiled) or 0.0
      if guard.requested and step == first_step:  # Nothing trained since the checkpoint.
        preempted = True
        _log.warning("%s received before the first step: stopping", guard.signal_name)
        break
      state, metrics = train_step(state, batch)
      step += 1
      trace.after_step(step, state)
      if baseline is None:
        # The segment's first step sets the divergence baseline (fetched, not logged).
        first = jax.device_get({k: v for k, v in metrics.items() if k in ("loss", "grad_norm")})
        baseline = {k: float(v) for k, v in first.items()}
        if _divergence(baseline, {}):
          baseline = {}
        baseline.update(starting_param_norm)
      # Read once: a later signal waits for the next step, never splits stop from save.
      stop_requested = guard.stop_requested(step)
      eval_due = evaluate is not None and _due(step, eval_every_steps, num_train_steps)
      checkpoint_due = _due(step, checkpoint_every_steps, num_train_steps) or stop_requested
      if _due(step, log_every_steps, num_train_steps) or eval_due or checkpoint_due:
        # The clock is read after the fetch: throughput counts finished steps, not dispatched.
        scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # Checkpoint steps are always logged: no checkpoint holds a diverged state.
        why = _divergence(scalars, baseline)
        if why:
          writer.write_scalars(step, scalars)
          writer.flush()
          checkpointer.wait()
          latest = checkpointer.latest_step()
          resume = (
              f"rerun to resume from the latest checkpoint, at step {latest}, which passed "
              "this check"
              if latest is not None
              else "rerun (no checkpoint was written yet, so it starts afresh)"
          )
          raise TrainingDiverged(
              f"{why} at step {step}; no checkpoint was written for it. Lower the learning "
              f"rate, clip gradients or use float32 compute, then {resume}"
          )
        steps_per_second = progress.rate(step)
        if steps_per_second > 0:
          scalars.update(
              throughput_scalars(
                  steps_per_second,
                  examples_per_step=examples_per_step,
                  tokens_per_example=tokens_per_example,
                  flops_per_step=flops_per_step,
                  peak_flops=peak,
              )
          )
        writer.write_scalars(step, scalars)
        if not terms_named:  # Once, before the first progress line: what its total sums.
          terms_named = True
          note = loss_terms_note(scalars)
          if note:
            progress.note(note)
        progress.update(step, steps_per_second, progress_scalars(scalars))
      if eval_due:
        eval_scalars = evaluate(state)
        writer.write_scalars(step, eval_scalars)
        progress.note(evaluation_summary(step, eval_scalars))
        progress.rate(step)  # Evaluation time is not training throughput.
      for every, review in reviews:
        if every > 0 and step % every == 0 and step < num_train_steps:
          state, review_scalars, *notes = review(state)
          writer.write_scalars(step, review_scalars)
          for line in notes[0] if notes else ():  # What the review changed, in words.
            progress.note(f"step {step}: {line}")
          progress.rate(step)
      if checkpoint_due:
        writer.flush()
        checkpointer.save(step, state, batches.get_state(), force=True)
      if stop_requested:
        preempted = True
        _log.warning(
            "%s received: saved a checkpoint at step %d; stopping", guard.signal_name, step
        )
        break
  trace.stop(state)
  progress.close()
  with _full_disk_names_the_resume_step(checkpointer):
    writer.flush()
  checkpointer.wait()
  return state, preempted


def resume_training(
    config: Any,
    workdir: str,
    state: TrainState,
    checkpointer: Checkpointer,
    train_iterator: CheckpointableIterator,
    writer: MetricWriter,
) -> TrainState:
  """The latest readable checkpoint's state (data iterator and metrics log put back to its step),
  or `state` for a fresh run; then saves `config.json`, once the checkpoint accepted it."""
  restored = checkpointer.restore(state, check_iterator_state=train_iterator.set_state)
  if restored is not None:
    state, iterator_state, step = restored
    train_iterator.set_state(iterator_state)
    writer.truncate_after(step)
    print(f"Resumed from the checkpoint at step {step} in {checkpointer.directory}", flush=True)
  else:
    # A fresh start retrains from step 0: an earlier attempt's lines would be duplicated.
    writer.truncate_after(int(state.step))
  save_config(config, workdir)
  return state
