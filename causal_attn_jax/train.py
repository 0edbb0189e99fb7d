"""Training and evaluation of the Causal Transformer and its attention baselines.

`train_and_evaluate` is the whole recipe, top to bottom, on the shared kit (`trainkit.recipe`
holds the skeleton both packages share): data and tokenizer, model, state (with the Lagrange
multipliers in `TrainState.extra`), resume, the loop, then the report (`report.json`) and the attention heatmaps (paper Fig. 8). What differs
between pair classification and translation is the task object's (`tasks.py`); the data
loading and training iterator are in `data/`, beam search in `decoding.py` and the report in
`report.py`, so this module reads as the recipe and the constrained objective only.

Loss (Eq. 6): task cross-entropy (label-smoothed for NMT) plus, for attention="causal", the
Lagrangian `sum_l gamma_l . v_l + penalty/2 |v|^2` of the Markov-blanket violations v of every
encoder and decoder self-attention layer. The multipliers gamma [L_total, H, terms] are updated by
projected dual ascent inside the jitted step (`update_extra`). Baselines log the same
constraint statistics but do not add the term.
"""

from __future__ import annotations

import dataclasses
import functools
import csv
import io
import os
from typing import Any, Callable

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax import models
from causal_attn_jax import report as report_lib
from causal_attn_jax import run_info as run_info_lib
from causal_attn_jax import tasks
from causal_attn_jax.data import tokenizer as tokenizer_lib
from causal_attn_jax.data.iterator import TrainIterator, device_batches
from causal_attn_jax.data.loading import TaskData
from causal_attn_jax.metrics import attention_sparsity
from trainkit import recipe, storage
from trainkit.checkpoint import restore_trained
from trainkit.errors import ConfigError, UserError
from trainkit.fits import check_eval_step
from trainkit.mesh import place, replicated, to_host
from trainkit.metric_writers import write_atomically
from trainkit.train_state import LossFn, TrainState, UpdateExtraFn, create_train_state
from trainkit.workdir import require_checkpoint

# eval_step(state, batch) -> loss, constraint fractions, attention maps and the task's outputs.
EvalStep = Callable[[TrainState, dict[str, jax.Array]], dict[str, Any]]

# --- Model and loss -------------------------------------------------------------------------------


def attention_stats(
    records: list[models.SelfAttentionRecord],
    spec: constraints_lib.ConstraintSpec,
    example_mask: jax.Array | None = None,
) -> list[constraints_lib.ConstraintStats]:
  """constraint_violations of every self-attention layer (examples with mask False ignored)."""
  stats = []
  for record in records:
    valid = _valid_tokens(record, example_mask)
    stats.append(
        constraints_lib.constraint_violations(
            record.probs,
            record.mask,
            decoder=record.decoder,
            valid_q=valid,
            valid_k=valid,
            spec=spec,
        )
    )
  return stats


def _valid_tokens(record: models.SelfAttentionRecord, example_mask: jax.Array | None) -> jax.Array:
  return record.valid if example_mask is None else record.valid & example_mask[:, None]


def make_loss_fn(config: ml_collections.ConfigDict) -> LossFn:
  """loss_fn(model, batch, rng, step, extra) -> (loss, metrics) of Eq. 6."""
  task = tasks.get_task(config)
  applied = config_lib.constraint_applied(config)
  names = task.layer_names(config)
  spec = config_lib.constraint_spec(config)

  def loss_fn(model, batch, rng, step, extra):
    task_loss, metrics, records, _ = task.loss(
        config, model, batch, train=True, rngs=nnx.Rngs(dropout=rng)
    )
    stats = attention_stats(records, spec)
    violations = jnp.stack([s.violations for s in stats])  # [L_total, H, len(spec.names)]
    term = constraints_lib.lagrangian_term(
        violations, extra["multipliers"], penalty=extra["penalty"]
    )
    loss = task_loss + term if applied else task_loss
    metrics = dict(metrics, task_loss=task_loss, _violations=violations, _step=step)
    metrics["constraints/lagrangian"] = term
    metrics["constraints/violation"] = violations.sum()
    for name, s in zip(names, stats):
      metrics[f"constraints/{name}/rows_within"] = s.rows_within
      metrics[f"constraints/{name}/cols_within"] = s.cols_within
      metrics[f"constraints/{name}/nodes_within"] = s.nodes_within
    return loss, metrics

  return loss_fn


def make_update_extra(config: ml_collections.ConfigDict) -> UpdateExtraFn:
  """Projected dual ascent on the multipliers (and the augmented penalty's growth)."""
  applied = config_lib.constraint_applied(config)
  c = config.constraints
  names = tasks.get_task(config).layer_names(config)

  def update_extra(extra, metrics):
    multipliers, penalty = extra["multipliers"], extra["penalty"]
    if applied:
      # The multipliers stay put before constraints.dual_start_step and the step then grows
      # linearly over constraints.dual_ramp_steps, so that the task can learn before the
      # constraint pulls at full strength: the full step from step 0 left small models at
      # chance on some data and seeds (docs/design.md, "Constraint strength", has which
      # schedule each config uses).
      ramp = (metrics["_step"] - c.dual_start_step + 1) / max(c.dual_ramp_steps, 1)
      step_size = c.step_size * jnp.clip(ramp, 0.0, 1.0)
      multipliers = constraints_lib.dual_update(
          multipliers,
          metrics["_violations"],
          step_size=step_size,
          penalty_cap=c.multiplier_cap or None,
      )
      penalty = constraints_lib.grow_penalty(penalty, factor=c.penalty_growth, cap=c.penalty_max)
    scalars = {
        f"constraints/{name}/multiplier": multipliers[l].mean() for l, name in enumerate(names)
    }
    if c.penalty > 0:
      scalars["constraints/penalty"] = penalty
    return dict(extra, multipliers=multipliers, penalty=penalty), scalars

  return update_extra


def initial_extra(config: ml_collections.ConfigDict) -> dict[str, jax.Array]:
  """TrainState.extra of a fresh run: one multiplier per (layer, head, term) and the penalty."""
  num_layers = len(tasks.get_task(config).layer_names(config))
  return {
      "multipliers": constraints_lib.init_multipliers(
          num_layers,
          config.model.num_heads,
          config.constraints.init_multiplier,
          spec=config_lib.constraint_spec(config),
      ),
      "penalty": jnp.asarray(min(config.constraints.penalty, config.constraints.penalty_max)),
  }


def create_state(
    config: ml_collections.ConfigDict,
    data: TaskData,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    pretrained: bool = True,
) -> tuple[nnx.GraphDef, TrainState]:
  """The initial train state; the multipliers live in `extra`, replicated.

  `pretrained=False` skips the GloVe init of `model.glove_path`, for a state that a
  checkpoint's restore overwrites anyway (predict: the GloVe file need not be there).
  """

  def load_glove(model: nnx.Module) -> None:
    matched = models.init_from_glove(model, data.tokenizer.pieces(), config.model.glove_path)
    data.glove_matched = matched
    print(
        f"GloVe init: {matched} of {data.tokenizer.vocab_size} pieces matched in "
        f"{config.model.glove_path}",
        flush=True,
    )

  task = tasks.get_task(config)
  graphdef, state = create_train_state(
      lambda: task.build_model(config, data, nnx.Rngs(params=config.seed)),
      tx,
      mesh,
      config.seed,
      load_weights=load_glove if pretrained and config.model.glove_path else None,
  )
  state = state.replace(extra=place(initial_extra(config), replicated(mesh)))
  return graphdef, state


# --- Evaluation -----------------------------------------------------------------------------------


def make_eval_step(graphdef: nnx.GraphDef, config: ml_collections.ConfigDict) -> EvalStep:
  """Jitted `eval_step(state, batch)`: predictions, loss sums and per-layer constraint stats."""
  task = tasks.get_task(config)
  spec = config_lib.constraint_spec(config)

  @jax.jit
  def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
    model = nnx.merge(graphdef, state.params, state.model_state)
    loss, metrics, records, logits = task.loss(config, model, batch, train=False, rngs=None)
    stats = attention_stats(records, spec, batch["mask"])
    sparsity = [attention_sparsity(r.probs, _valid_tokens(r, batch["mask"])) for r in records]
    return {
        "loss": loss,
        "rows_within": jnp.stack([s.rows_within for s in stats]),
        "cols_within": jnp.stack([s.cols_within for s in stats]),
        "nodes_within": jnp.stack([s.nodes_within for s in stats]),
        "violation": jnp.stack([s.violations.mean() for s in stats]),
        "effective_keys": jnp.stack([k for k, _ in sparsity]),
        "top1_mass": jnp.stack([m for _, m in sparsity]),
        "attention": [r.probs for r in records],  # Every head of every layer (Fig. 8).
        **metrics,
        **task.eval_outputs(logits),
    }

  return eval_step


# Per-layer statistics of an eval pass, averaged over batches weighted by their examples.
_LAYER_STATS = (
    "rows_within",
    "cols_within",
    "nodes_within",
    "violation",
    "effective_keys",
    "top1_mass",
)


def run_eval(
    eval_step: EvalStep,
    state: TrainState,
    arrays: dict[str, np.ndarray],
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    *,
    keep_attention: int = 0,
) -> dict[str, Any]:
  """One pass: mean loss, per-layer constraint fractions, predictions, a few attention maps."""
  totals: dict[str, Any] = {"loss": 0.0, "weight": 0.0}
  totals.update({key: 0.0 for key in _LAYER_STATS})
  predictions, attention, inputs = [], [], []
  for host_batch, batch in device_batches(arrays, config.eval_batch_size, mesh):
    if not totals["weight"]:  # Before the first batch runs: refuse a step that cannot fit.
      check_eval_step(eval_step, state, batch, config.eval_batch_size)
    out = eval_step(state, batch)
    weight = float(host_batch["mask"].sum())
    totals["loss"] += float(out["loss"]) * weight
    for key in _LAYER_STATS:
      totals[key] += to_host(out[key]) * weight
    totals["weight"] += weight
    if "predictions" in out:
      predictions.append(to_host(out["predictions"])[host_batch["mask"]])
    if len(attention) < keep_attention:
      take = keep_attention - len(attention)
      maps = [to_host(a)[:take] for a in out["attention"]]
      for i in range(min(take, int(weight))):
        attention.append([m[i] for m in maps])
        inputs.append({k: v[i] for k, v in host_batch.items()})
  n = max(totals["weight"], 1.0)
  return {
      "loss": totals["loss"] / n,
      **{key: np.asarray(totals[key]) / n for key in _LAYER_STATS},
      "predictions": np.concatenate(predictions) if predictions else None,
      "attention": attention,
      "inputs": inputs,
  }


def _final_report(
    config: ml_collections.ConfigDict,
    graphdef: nnx.GraphDef,
    eval_step: EvalStep,
    state: TrainState,
    data: TaskData,
    mesh: Mesh,
    workdir: str,
) -> dict[str, Any]:
  return report_lib.final_report(
      tasks.get_task(config),
      state,
      data,
      config,
      workdir,
      evaluate=functools.partial(run_eval, eval_step, state, config=config, mesh=mesh),
      graphdef=graphdef,
      mesh=mesh,
  )


# --- Recipe ---------------------------------------------------------------------------------------


def _setup(
    config: ml_collections.ConfigDict, workdir: str, training: bool = True
) -> tuple[TaskData, recipe.Run]:
  data = tasks.get_task(config).load_data(config, workdir)
  run = recipe.setup(
      config,
      workdir,
      train_examples=len(next(iter(data.train.values()))),
      create_state=lambda tx, mesh: create_state(config, data, tx, mesh),
      training=training,
  )
  return data, run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Trains (resuming from the latest checkpoint in `workdir`), then writes report.json.

  Returns the report, or None when the run was stopped by SIGTERM.
  """
  task = tasks.get_task(config)
  if _has_checkpoint(workdir):
    # A resume: the checkpoint's token ids need the tokenizer it was trained with; building a
    # new one from the (maybe other) training text would silently change the vocabulary.
    _require_tokenizer(workdir)
  data, run = _setup(config, workdir)
  eval_step = make_eval_step(run.graphdef, config)

  def evaluate(state: TrainState) -> dict[str, float]:
    return report_lib.summary_scalars(
        run_eval(eval_step, state, data.eval, config, run.mesh), data, "eval"
    )

  trained = recipe.train(
      run,
      train_iterator=TrainIterator(
          data.train, config.batch_size, seed=config.seed, seq_keys=task.seq_keys
      ),
      loss_fn=make_loss_fn(config),
      update_extra=make_update_extra(config),
      tokens_per_example=task.tokens_per_example(config),
      evaluate=evaluate,
      # Label names beside the tokenizer: predict then needs the workdir alone.
      run_info=run_info_lib.RunMetadata.from_data(config, data).to_json(),
  )
  if trained is None:
    return None
  report = _final_report(config, run.graphdef, eval_step, trained.state, data, run.mesh, workdir)
  scalars = {f"final/{k}": report[k] for k in ("accuracy", "macro_f1", "bleu") if k in report}
  if "challenge" in report:
    scalars["final/challenge_accuracy"] = report["challenge"]["accuracy"]
  return recipe.finish(
      run,
      trained.state,
      report,
      writer=trained.writer,
      scalars=scalars,
      write_report=lambda report: report_lib.write_report(report, workdir),
  )


def _has_checkpoint(workdir: str) -> bool:
  try:
    require_checkpoint(workdir)
  except UserError:
    return False
  return True


def _require_tokenizer(workdir: str) -> None:
  tokenizer_path = storage.join(workdir, "spm.model")
  if not storage.path(tokenizer_path).is_file():
    # Training a new one on the given text would silently change the checkpoint's vocabulary.
    raise UserError(
        f"{tokenizer_path} is missing, and the checkpoint's token ids mean nothing without it; "
        "restore it, or train a new run (--mode=train in a new workdir)"
    )


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir`; writes report.json."""
  _require_tokenizer(workdir)
  data, run = _setup(config, workdir, training=False)
  state, _ = restore_trained(run.checkpointer, run.state)
  if run_info_lib.load(workdir) is None:  # A run trained before run_info.json was written.
    run_info_lib.RunMetadata.from_data(config, data).save(workdir)
  eval_step = make_eval_step(run.graphdef, config)
  report = _final_report(config, run.graphdef, eval_step, state, data, run.mesh, workdir)
  return recipe.finish(
      run, state, report, write_report=lambda report: report_lib.write_report(report, workdir)
  )


@dataclasses.dataclass
class Restored:
  """A trained run's latest checkpoint, ready for inference (`restore_run`).

  Attributes:
    metadata: The run's task and label names (run_info.json).
    data: The tokenizer and label names as TaskData, with no examples.
    graphdef: The model's graph.
    state: The restored train state (params, model state, optimizer state, multipliers).
    mesh: The device mesh of `config.mesh` the state is placed on.
    step: The checkpoint's step.
  """

  metadata: run_info_lib.RunMetadata
  data: TaskData
  graphdef: nnx.GraphDef
  state: TrainState
  mesh: Mesh
  step: int

  @property
  def model(self) -> nnx.Module:
    """The model with the restored parameters."""
    return nnx.merge(self.graphdef, self.state.params, self.state.model_state)


def inference_data(
    config: ml_collections.ConfigDict, workdir: str
) -> tuple[run_info_lib.RunMetadata, TaskData]:
  """The run's metadata and its tokenizer and label names, from the workdir alone.

  A run trained before run_info.json was written reads its label names from the data (which
  must then be where `data.*` says).
  """
  _require_tokenizer(workdir)
  metadata = run_info_lib.load(workdir)
  if metadata is None:
    try:
      data = tasks.get_task(config).load_data(config, workdir)
    except UserError as e:
      raise UserError(
          f"{workdir} has no {run_info_lib.RUN_INFO_FILE} (trained before it was written), so "
          f"the label names are read from the data, which failed: {e}"
      ) from None
    return run_info_lib.RunMetadata.from_data(config, data), data
  if metadata.task != config.task:
    raise UserError(
        f"{workdir}/{run_info_lib.RUN_INFO_FILE} is a {metadata.task} run's, but the config "
        f"says task={config.task!r}"
    )
  # The saved vocabulary; load_or_train checks it has the config's settings and never retrains.
  tokenizer = tokenizer_lib.load_or_train(
      workdir,
      (),
      config.data.vocab_size,
      model_type=config.data.tokenizer_type,
      name=os.path.splitext(metadata.tokenizer)[0],
      seed=config.seed,
  )
  data = TaskData(
      tokenizer=tokenizer,
      train={},
      eval={},
      num_classes=len(metadata.label_names),
      label_names=metadata.label_names,
  )
  return metadata, data


def restore_run(config: ml_collections.ConfigDict, workdir: str) -> Restored:
  """The latest readable checkpoint of `workdir`, from the workdir alone: config, tokenizer,
  run_info.json and checkpoints (no data file). No readable checkpoint is a UserError."""
  metadata, data = inference_data(config, workdir)
  run = recipe.setup(
      config,
      workdir,
      train_examples=0,  # num_train_steps is config.json's, resolved at training time.
      create_state=lambda tx, mesh: create_state(config, data, tx, mesh, pretrained=False),
      training=False,
  )
  state, step = restore_trained(run.checkpointer, run.state)
  return Restored(metadata, data, run.graphdef, state, run.mesh, step)


PREDICT_FILE = os.path.join("predict", "predictions.tsv")


def predict_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Runs the latest checkpoint on `predict.input` and writes `<workdir>/predict/predictions.tsv`.

  Pair classification reads a TSV of `premise<TAB>hypothesis` lines and writes the predicted
  label and each label's probability; translation reads one source sentence per line and
  writes its beam-search translation (config.nmt). Blank lines and, for pairs, lines starting
  with # are skipped. Reads the workdir alone (config, tokenizer, run_info.json, checkpoint),
  not the data files.
  """
  if not config.predict.input:
    raise ConfigError("predict.input", "--mode=predict needs --config.predict.input=FILE")
  restored = restore_run(config, workdir)
  columns = tasks.get_task(config).predict(
      config,
      restored.data,
      restored.state,
      graphdef=restored.graphdef,
      mesh=restored.mesh,
      path=config.predict.input,
  )
  path = storage.join(workdir, PREDICT_FILE)
  if jax.process_index() == 0:
    storage.makedirs(storage.join(workdir, os.path.dirname(PREDICT_FILE)))
    names = list(columns)
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t", quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
    writer.writerow(names)
    writer.writerows(zip(*(columns[name] for name in names)))
    write_atomically(path, text.getvalue())
    rows = len(columns[names[0]])
    print(f"Predicted {rows} inputs with the checkpoint of step {restored.step}: {path}")
  return path
