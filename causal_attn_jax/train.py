"""Training of the Causal Transformer and its attention baselines.

`train_and_evaluate` is the whole recipe on `trainkit.recipe`: data and tokenizer, model, state
(the Lagrange multipliers in `TrainState.extra`), resume, loop, report and attention heatmaps
(Fig. 8); task differences live in `tasks.py` (docs/design.md, "Module layout").

Loss (Eq. 6): task cross-entropy (label-smoothed for NMT) plus, for attention="causal", the
Lagrangian `sum_l gamma_l . v_l + penalty/2 |v|^2` of the Markov-blanket violations v of every
encoder and decoder self-attention layer. The multipliers gamma [L_total, H, terms] are updated
by projected dual ascent inside the jitted step (`update_extra`). Baselines log the same
statistics without the term.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax import evaluation, models, tasks
from causal_attn_jax import report as report_lib
from causal_attn_jax import run_info as run_info_lib
from causal_attn_jax.data.iterator import TrainIterator
from causal_attn_jax.data.loading import TaskData
from trainkit import recipe, storage
from trainkit.checkpoint import restore_trained
from trainkit.errors import UserError
from trainkit.mesh import place, replicated
from trainkit.train_state import LossFn, TrainState, UpdateExtraFn, create_train_state
from trainkit.workdir import has_checkpoint


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
    stats = evaluation.attention_stats(records, spec)
    violations = jnp.stack([s.violations for s in stats])  # [L_total, H, len(spec.names)]
    term = constraints_lib.lagrangian_term(
        violations, extra["multipliers"], penalty=extra["penalty"]
    )
    loss = task_loss + term if applied else task_loss
    metrics = dict(metrics, task_loss=task_loss, _violations=violations, _step=step)
    metrics["constraints/lagrangian"] = term
    metrics["constraints/violation"] = violations.sum()
    for name, s in zip(names, stats):
      metrics.update({f"constraints/{name}/{key}": getattr(s, key) for key in evaluation.WITHIN})
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
      # Delayed and ramped so the task learns before the constraint pulls at full strength
      # (docs/design.md, "Constraint strength").
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
  """The initial train state, multipliers replicated in `extra`; `pretrained=False` skips
  the GloVe init (a checkpoint's restore overwrites it anyway).
  """

  def load_glove(model: nnx.Module) -> None:
    embedding = model.embed.tokens.embedding
    table, data.glove_matched = models.glove_embedding(
        data.tokenizer.pieces(), config.model.glove_path, embedding.shape[-1]
    )
    embedding[...] = jnp.asarray(table, embedding.dtype)
    print(
        f"GloVe init: {data.glove_matched} of {data.tokenizer.vocab_size} pieces matched in "
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


def _setup(
    config: ml_collections.ConfigDict, workdir: str, training: bool = True
) -> tuple[TaskData, recipe.Run]:
  if not training or has_checkpoint(workdir):
    # A trained run needs its own tokenizer: a new one would change the vocabulary.
    require_tokenizer(workdir)
  data = tasks.get_task(config).load_data(config, workdir)
  run = recipe.setup(
      config,
      workdir,
      train_examples=len(next(iter(data.train.values()))),
      create_state=lambda tx, mesh: create_state(config, data, tx, mesh),
      training=training,
  )
  return data, run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (resuming from `workdir`'s latest checkpoint), then writes report.json (SIGTERM:
  `recipe.train` checkpoints and exits)."""
  task = tasks.get_task(config)
  data, run = _setup(config, workdir)
  eval_step = evaluation.make_eval_step(run.graphdef, config)

  def evaluate(state: TrainState) -> dict[str, float]:
    return report_lib.summary_scalars(
        evaluation.run_eval(eval_step, state, data.eval, config, run.mesh), data, "eval"
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
      run_info=run_info_lib.RunMetadata(config.task, tuple(data.label_names)).to_json(),
  )
  report = report_lib.final_report(
      config, run.graphdef, eval_step, trained.state, data, run.mesh, workdir
  )
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


def require_tokenizer(workdir: str) -> None:
  """Raises UserError when the workdir's tokenizer (spm.model) is missing."""
  tokenizer_path = storage.join(workdir, "spm.model")
  if not storage.path(tokenizer_path).is_file():
    # Training a new one on the given text would silently change the checkpoint's vocabulary.
    raise UserError(
        f"{tokenizer_path} is missing, and the checkpoint's token ids mean nothing without it; "
        "restore it, or train a new run (--mode=train in a new workdir)"
    )


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir`; writes report.json."""
  data, run = _setup(config, workdir, training=False)
  state, _ = restore_trained(run.checkpointer, run.state)
  eval_step = evaluation.make_eval_step(run.graphdef, config)
  report = report_lib.final_report(config, run.graphdef, eval_step, state, data, run.mesh, workdir)
  return recipe.finish(
      run, state, report, write_report=lambda report: report_lib.write_report(report, workdir)
  )
