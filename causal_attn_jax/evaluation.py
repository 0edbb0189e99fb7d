"""Evaluation of the Causal Transformer: the jitted eval step and one pass over a split
(`run_eval`); `attention_stats` is shared with training, whose loss (Eq. 6) adds the violations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax import models, tasks
from causal_attn_jax.data.iterator import device_batches
from causal_attn_jax.metrics import attention_sparsity
from trainkit.fits import check_eval_step
from trainkit.mesh import to_host
from trainkit.train_state import TrainState

# eval_step(state, batch) -> loss, constraint fractions, attention maps and the task's outputs.
EvalStep = Callable[[TrainState, dict[str, jax.Array]], dict[str, Any]]
WITHIN = ("rows_within", "cols_within", "nodes_within")
# Per-layer statistics of an eval pass, averaged over batches weighted by their examples.
LAYER_STATS = (*WITHIN, "violation", "effective_keys", "top1_mass")


def attention_stats(
    records: list[models.SelfAttentionRecord],
    spec: constraints_lib.ConstraintSpec,
    example_mask: jax.Array | None = None,
) -> list[constraints_lib.ConstraintStats]:
  """constraint_violations of every self-attention layer (examples with mask False ignored)."""
  stats = []
  for record in records:
    valid = valid_tokens(record, example_mask)
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


def valid_tokens(record: models.SelfAttentionRecord, example_mask: jax.Array | None) -> jax.Array:
  """The record's real tokens [B, S], less those of examples whose mask is False."""
  return record.valid if example_mask is None else record.valid & example_mask[:, None]


def make_eval_step(graphdef: nnx.GraphDef, config: ml_collections.ConfigDict) -> EvalStep:
  """Jitted `eval_step(state, batch)`: predictions, loss sums and per-layer constraint stats."""
  task = tasks.get_task(config)
  spec = config_lib.constraint_spec(config)

  @jax.jit
  def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
    model = nnx.merge(graphdef, state.params, state.model_state)
    loss, metrics, records, logits = task.loss(config, model, batch, train=False, rngs=None)
    stats = attention_stats(records, spec, batch["mask"])
    sparsity = [attention_sparsity(r.probs, valid_tokens(r, batch["mask"])) for r in records]
    return {
        "loss": loss,
        **{key: jnp.stack([getattr(s, key) for s in stats]) for key in WITHIN},
        "violation": jnp.stack([s.violations.mean() for s in stats]),
        "effective_keys": jnp.stack([k for k, _ in sparsity]),
        "top1_mass": jnp.stack([m for _, m in sparsity]),
        "attention": [r.probs for r in records],  # Every head of every layer (Fig. 8).
        **metrics,
        **task.eval_outputs(logits),
    }

  return eval_step


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
  totals.update({key: 0.0 for key in LAYER_STATS})
  predictions, attention, inputs = [], [], []
  for host_batch, batch in device_batches(arrays, config.eval_batch_size, mesh):
    if not totals["weight"]:  # Before the first batch runs: refuse a step that cannot fit.
      check_eval_step(eval_step, state, batch, config.eval_batch_size)
    out = eval_step(state, batch)
    weight = float(host_batch["mask"].sum())
    totals["loss"] += float(out["loss"]) * weight
    for key in LAYER_STATS:
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
      **{key: np.asarray(totals[key]) / n for key in LAYER_STATS},
      "predictions": np.concatenate(predictions) if predictions else None,
      "attention": attention,
      "inputs": inputs,
  }
