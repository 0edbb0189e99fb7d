"""Training and evaluation of the Causal Transformer (paper 001) and its attention baselines.

`train_and_evaluate` is the whole recipe, top to bottom, on the shared kit (`trainkit`): data
and tokenizer, model, state (with the Lagrange multipliers in `TrainState.extra`), resume, the
loop, then the report (`report.json`) and the attention heatmaps (paper Fig. 8).

Loss (Eq. 6): task cross-entropy (label-smoothed for NMT) plus, for attention="causal", the
Lagrangian `sum_l gamma_l . v_l + penalty/2 |v|^2` of the Markov-blanket violations v of every
encoder and decoder self-attention layer. The multipliers gamma [L_total, H, 4] are updated by
projected dual ascent inside the jitted step (`update_extra`). Baselines log the same
constraint statistics but do not add the term.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax import decoding
from causal_attn_jax import models
from causal_attn_jax import plots
from causal_attn_jax.data import batching, nli, tokenizer as tokenizer_lib, translation
from causal_attn_jax.metrics import accuracy, corpus_bleu, macro_f1
from trainkit.checkpoint import Checkpointer
from trainkit.config import resolve_train_steps
from trainkit.errors import UserError
from trainkit.loop import loop_settings, stop_after_preemption, train_loop
from trainkit.distributed import main_process_first
from trainkit.mesh import make_mesh, place, process_block, replicated, shard_batch, to_host
from trainkit.metric_writers import MetricWriter
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.train_state import (
    TrainState,
    compute_dtype,
    create_train_state,
    jit_train_step,
    make_train_step,
)
from trainkit.workdir import save_config

# --- Data -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class TaskData:
  """Tokenised splits as numpy arrays plus what the report needs."""

  tokenizer: tokenizer_lib.Tokenizer
  train: dict[str, np.ndarray]
  eval: dict[str, np.ndarray]
  num_classes: int = 0  # Classification.
  label_names: tuple[str, ...] = ()
  challenge: dict[str, np.ndarray] | None = None
  challenge_hans: bool = False  # 3-way predictions scored on 2-way HANS labels.
  challenge_heuristics: list[str] | None = None
  eval_references: list[str] = dataclasses.field(default_factory=list)  # Translation.
  glove_matched: int | None = None  # Pieces initialised from model.glove_path.


def _subset(pairs: nli.PairData, indices: np.ndarray) -> nli.PairData:
  pick = lambda xs: None if xs is None else [xs[i] for i in indices]
  return dataclasses.replace(
      pairs,
      premises=pick(pairs.premises),
      hypotheses=pick(pairs.hypotheses),
      labels=pairs.labels[indices],
      heuristics=pick(pairs.heuristics),
      subcases=pick(pairs.subcases),
  )


def _truncate(pairs: nli.PairData, limit: int) -> nli.PairData:
  return _subset(pairs, np.arange(min(limit, len(pairs)))) if limit > 0 else pairs


def _load_pairs(config: ml_collections.ConfigDict):
  d = config.data
  if config_lib.uses_tfds(config):
    train = nli.load_tfds_pairs(
        d.tfds_name,
        split=d.tfds_train_split,
        data_dir=d.tfds_data_dir,
        max_examples=d.max_train_examples,
    )
    evaluation = nli.load_tfds_pairs(
        d.tfds_name,
        split=d.tfds_eval_split,
        data_dir=d.tfds_data_dir,
        max_examples=d.max_eval_examples,
    )
  else:
    train = nli.read_pairs(d.train_file, task=d.pair_task)
    if d.eval_file:
      evaluation = nli.read_pairs(d.eval_file, task=d.pair_task)
    else:
      # Carve a fixed random eval set out of the train file.
      order = np.random.default_rng(config.seed).permutation(len(train))
      num_eval = max(1, int(round(d.eval_fraction * len(train))))
      evaluation = _subset(train, np.sort(order[:num_eval]))
      train = _subset(train, np.sort(order[num_eval:]))
      print(f"eval set: {num_eval} pairs carved from {d.train_file} (data.eval_fraction)")
    train = _truncate(train, d.max_train_examples)
  evaluation = _truncate(evaluation, d.max_eval_examples)
  if evaluation.label_names != train.label_names:
    raise UserError(
        f"{evaluation.source} has labels {evaluation.label_names} but the training data "
        f"{train.source} has {train.label_names}; data.eval_file must be the same task"
    )
  challenge = None
  if d.challenge_file:
    challenge = _truncate(nli.read_pairs(d.challenge_file, task=d.pair_task), d.max_eval_examples)
    if challenge.label_names not in (train.label_names, nli.HANS_LABELS):
      raise UserError(
          f"data.challenge_file {d.challenge_file} has labels {challenge.label_names}, which "
          f"cannot score a model trained on {train.label_names}"
      )
  return train, evaluation, challenge


def _encode_pairs(tok, pairs: nli.PairData, max_len: int) -> dict[str, np.ndarray]:
  ids, segments = tok.encode_pair(pairs.premises, pairs.hypotheses, max_len)
  return {"ids": ids, "segment_ids": segments, "label": pairs.labels.astype(np.int32)}


def _load_classification(config, workdir: str) -> TaskData:
  train, evaluation, challenge = _load_pairs(config)
  # Process 0 trains and saves it; the others load it.
  tok = main_process_first(
      "tokenizer",
      lambda: tokenizer_lib.load_or_train(
          workdir,
          lambda: train.premises + train.hypotheses,
          config.data.vocab_size,
          model_type=config.data.tokenizer_type,
          seed=config.seed,
      ),
  )
  max_len = config.data.max_len
  data = TaskData(
      tokenizer=tok,
      train=_encode_pairs(tok, train, max_len),
      eval=_encode_pairs(tok, evaluation, max_len),
      num_classes=train.num_classes,
      label_names=train.label_names,
  )
  if challenge is not None:
    data.challenge = _encode_pairs(tok, challenge, max_len)
    data.challenge_hans = (
        challenge.label_names == nli.HANS_LABELS and train.label_names != nli.HANS_LABELS
    )
    data.challenge_heuristics = challenge.heuristics
  return data


def _load_parallel(config):
  d = config.data
  if config_lib.uses_tfds(config):
    load = lambda split, limit: translation.load_tfds_translation(
        d.tfds_name,
        split=split,
        data_dir=d.tfds_data_dir,
        source_lang=d.source_lang,
        target_lang=d.target_lang,
        max_examples=limit,
    )
    return load(d.tfds_train_split, d.max_train_examples), load(
        d.tfds_eval_split, d.max_eval_examples
    )
  train = translation.read_parallel(d.train_source, d.train_target, unescape=d.unescape)
  evaluation = translation.read_parallel(d.eval_source, d.eval_target, unescape=d.unescape)
  cut = lambda pair, n: (pair[0][:n], pair[1][:n]) if n > 0 else pair
  return cut(train, d.max_train_examples), cut(evaluation, d.max_eval_examples)


def _encode_parallel(tok, sources, targets, config) -> dict[str, np.ndarray]:
  src = tok.encode(sources, config.data.max_source_len, add_bos=False, add_eos=True)
  tgt = tok.encode(targets, config.data.max_target_len + 1, add_bos=True, add_eos=True)
  return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def _load_translation(config, workdir: str) -> TaskData:
  (train_src, train_tgt), (eval_src, eval_tgt) = _load_parallel(config)
  keep = [i for i, (s, t) in enumerate(zip(train_src, train_tgt)) if s.strip() and t.strip()]
  train_src, train_tgt = [train_src[i] for i in keep], [train_tgt[i] for i in keep]
  # Process 0 trains and saves it; the others load it.
  tok = main_process_first(
      "tokenizer",
      lambda: tokenizer_lib.load_or_train(
          workdir,
          lambda: train_src + train_tgt,  # A joint vocabulary: the embeddings are tied.
          config.data.vocab_size,
          model_type=config.data.tokenizer_type,
          seed=config.seed,
      ),
  )
  return TaskData(
      tokenizer=tok,
      train=_encode_parallel(tok, train_src, train_tgt, config),
      eval=_encode_parallel(tok, eval_src, eval_tgt, config),
      eval_references=list(eval_tgt),
  )


def load_data(config: ml_collections.ConfigDict, workdir: str) -> TaskData:
  if config.task == "classification":
    return _load_classification(config, workdir)
  return _load_translation(config, workdir)


class TrainIterator:
  """Endless fixed-shape, length-bucketed training batches; its state is {"epoch", "index"}.

  Each epoch's order depends only on (seed, epoch) (`batching.bucketed_batches`), so the
  state of two integers restores the exact position after a resume.
  """

  def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, *, seed: int, seq_keys):
    self.arrays = arrays
    self.batch_size = batch_size
    self.seed = seed
    self.lengths = np.max([batching.sequence_lengths(arrays[k]) for k in seq_keys], axis=0)
    self.epoch, self.index = 0, 0
    self._order: list[np.ndarray] | None = None

  def _batches(self) -> list[np.ndarray]:
    if self._order is None:
      self._order = batching.bucketed_batches(
          self.lengths, self.batch_size, seed=self.seed, epoch=self.epoch
      )
      if not self._order:
        raise UserError(f"fewer training examples than one batch (batch_size={self.batch_size})")
    return self._order

  def __next__(self) -> dict[str, np.ndarray]:
    while self.index >= len(self._batches()):
      self.epoch, self.index, self._order = self.epoch + 1, 0, None
    # Every process orders the epoch the same way and reads only its block of the batch.
    indices = process_block(self._batches()[self.index])
    self.index += 1
    return {k: v[indices] for k, v in self.arrays.items()}

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index}

  def set_state(self, state: dict) -> None:
    self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))
    self._order = None


# --- Model and loss -------------------------------------------------------------------------------


def _max_positions(config) -> int:
  if config.task == "classification":
    return config.data.max_len
  return max(config.data.max_source_len, config.data.max_target_len, config.nmt.max_decode_len) + 1


def build_model(config: ml_collections.ConfigDict, data: TaskData, rngs: nnx.Rngs) -> nnx.Module:
  spec = models.TransformerSpec.from_config(config.model, _max_positions(config))
  dtype = compute_dtype(config.compute_dtype)
  vocab = data.tokenizer.vocab_size
  if config.task == "classification":
    return models.PairClassifier(vocab, data.num_classes, spec, dtype=dtype, rngs=rngs)
  return models.Seq2Seq(vocab, spec, dtype=dtype, rngs=rngs)


def layer_names(config: ml_collections.ConfigDict) -> list[str]:
  """Names of the constrained self-attention layers, in the order of the multipliers."""
  names = [f"enc{l}" for l in range(config.model.num_layers)]
  if config.task == "translation":
    names += [f"dec{l}" for l in range(config.model.num_decoder_layers)]
  return names


def constraint_applied(config: ml_collections.ConfigDict) -> bool:
  """Eq. 6's Lagrangian is added only to causal runs (and constraints.weight = 1)."""
  return config.model.attention == "causal" and float(config.constraints.weight) > 0


def attention_stats(
    records: list[models.SelfAttentionRecord], example_mask: jax.Array | None = None
) -> list[constraints_lib.ConstraintStats]:
  """constraint_violations of every self-attention layer (examples with mask False ignored)."""
  stats = []
  for record in records:
    valid = record.valid if example_mask is None else record.valid & example_mask[:, None]
    stats.append(
        constraints_lib.constraint_violations(
            record.probs,
            record.mask,
            self_attention=True,
            decoder=record.decoder,
            valid_q=valid,
            valid_k=valid,
        )
    )
  return stats


def _task_loss(config, model, batch, *, train: bool, rngs):
  """(mean loss, metrics, records, logits) of the classification or translation objective."""
  if config.task == "classification":
    logits, records = model(batch["ids"], batch["segment_ids"], train=train, rngs=rngs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    weights = batch.get("mask", jnp.ones_like(ce, bool)).astype(jnp.float32)
    denominator = jnp.maximum(weights.sum(), 1.0)
    metrics = {"accuracy": (correct * weights).sum() / denominator}
    return (ce * weights).sum() / denominator, metrics, records, logits
  logits, records = model(batch["src"], batch["tgt_in"], train=train, rngs=rngs)
  targets = batch["tgt_out"]
  weights = (targets != tokenizer_lib.PAD_ID).astype(jnp.float32)
  if "mask" in batch:
    weights = weights * batch["mask"][:, None]
  vocab = logits.shape[-1]
  smoothing = config.nmt.label_smoothing if train else 0.0
  labels = optax.smooth_labels(jax.nn.one_hot(targets, vocab), smoothing)
  ce = optax.softmax_cross_entropy(logits, labels)
  denominator = jnp.maximum(weights.sum(), 1.0)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  metrics = {"token_accuracy": (correct * weights).sum() / denominator}
  return (ce * weights).sum() / denominator, metrics, records, logits


def make_loss_fn(config: ml_collections.ConfigDict):
  """loss_fn(model, batch, rng, step, extra) -> (loss, metrics) of Eq. 6."""
  applied = constraint_applied(config)
  names = layer_names(config)

  def loss_fn(model, batch, rng, step, extra):
    del step
    task_loss, metrics, records, _ = _task_loss(
        config, model, batch, train=True, rngs=nnx.Rngs(dropout=rng)
    )
    stats = attention_stats(records)
    violations = jnp.stack([s.violations for s in stats])  # [L_total, H, 4]
    term = constraints_lib.lagrangian_term(
        violations, extra["multipliers"], penalty=extra["penalty"]
    )
    loss = task_loss + term if applied else task_loss
    metrics = dict(metrics, task_loss=task_loss, _violations=violations)
    metrics["constraints/lagrangian"] = term
    metrics["constraints/violation"] = violations.sum()
    for name, s in zip(names, stats):
      metrics[f"constraints/{name}/rows_within"] = s.rows_within
      metrics[f"constraints/{name}/cols_within"] = s.cols_within
    return loss, metrics

  return loss_fn


def make_update_extra(config: ml_collections.ConfigDict):
  """Projected dual ascent on the multipliers (and the augmented penalty's growth)."""
  applied = constraint_applied(config)
  c = config.constraints
  names = layer_names(config)

  def update_extra(extra, metrics):
    multipliers, penalty = extra["multipliers"], extra["penalty"]
    if applied:
      multipliers = constraints_lib.dual_update(
          multipliers,
          metrics["_violations"],
          step_size=c.step_size,
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
  return {
      "multipliers": constraints_lib.init_multipliers(
          len(layer_names(config)), config.model.num_heads, config.constraints.init_multiplier
      ),
      "penalty": jnp.asarray(min(config.constraints.penalty, config.constraints.penalty_max)),
  }


def create_state(config, data: TaskData, tx, mesh: Mesh) -> tuple[nnx.GraphDef, TrainState]:
  """The initial train state; the multipliers live in `extra`, replicated."""

  def load_glove(model: nnx.Module) -> None:
    matched = models.init_from_glove(model, _pieces(data.tokenizer), config.model.glove_path)
    data.glove_matched = matched
    print(
        f"GloVe init: {matched} of {data.tokenizer.vocab_size} pieces matched in "
        f"{config.model.glove_path}",
        flush=True,
    )

  graphdef, state = create_train_state(
      lambda: build_model(config, data, nnx.Rngs(params=config.seed)),
      tx,
      mesh,
      config.seed,
      load_weights=load_glove if config.model.glove_path else None,
  )
  state = state.replace(extra=place(initial_extra(config), replicated(mesh)))
  return graphdef, state


def _pieces(tok: tokenizer_lib.Tokenizer) -> list[str]:
  return [tok._sp.id_to_piece(i) for i in range(tok.vocab_size)]  # pylint: disable=protected-access


# --- Evaluation -----------------------------------------------------------------------------------


def make_eval_step(graphdef: nnx.GraphDef, config: ml_collections.ConfigDict):
  """Jitted `eval_step(state, batch)`: predictions, loss sums and per-layer constraint stats."""

  @jax.jit
  def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
    model = nnx.merge(graphdef, state.params, state.model_state)
    loss, metrics, records, logits = _task_loss(config, model, batch, train=False, rngs=None)
    stats = attention_stats(records, batch["mask"])
    out = {
        "loss": loss,
        "rows_within": jnp.stack([s.rows_within for s in stats]),
        "cols_within": jnp.stack([s.cols_within for s in stats]),
        "attention": [r.probs[:, 0] for r in records],  # Head 0 of every layer (Fig. 8).
        **metrics,
    }
    if config.task == "classification":
      out["predictions"] = jnp.argmax(logits, -1)
    return out

  return eval_step


def _batches(arrays, config, mesh):
  """(global host batch, its device array): each process puts only its block on the mesh."""
  for batch in batching.eval_batches(arrays, config.eval_batch_size):
    yield batch, shard_batch(process_block(batch), mesh)


def run_eval(eval_step, state, arrays, config, mesh, *, keep_attention: int = 0):
  """One pass: mean loss, per-layer constraint fractions, predictions, a few attention maps."""
  totals: dict[str, Any] = {"loss": 0.0, "rows": 0.0, "cols": 0.0, "weight": 0.0}
  predictions, attention, inputs = [], [], []
  for host_batch, batch in _batches(arrays, config, mesh):
    out = eval_step(state, batch)
    weight = float(host_batch["mask"].sum())
    totals["loss"] += float(out["loss"]) * weight
    totals["rows"] += to_host(out["rows_within"]) * weight
    totals["cols"] += to_host(out["cols_within"]) * weight
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
      "rows_within": np.asarray(totals["rows"]) / n,
      "cols_within": np.asarray(totals["cols"]) / n,
      "predictions": np.concatenate(predictions) if predictions else None,
      "attention": attention,
      "inputs": inputs,
  }


def _constraint_report(result, config) -> dict[str, Any]:
  names = layer_names(config)
  return {
      "rows_within": float(np.mean(result["rows_within"])),
      "cols_within": float(np.mean(result["cols_within"])),
      "per_layer": {
          name: {"rows_within": float(r), "cols_within": float(c)}
          for name, r, c in zip(names, result["rows_within"], result["cols_within"])
      },
  }


def _group_accuracy(labels, predictions, keep) -> float | None:
  return float(np.mean(labels[keep] == predictions[keep])) if keep.any() else None


def challenge_report(data: TaskData, predictions: np.ndarray) -> dict[str, Any]:
  """Challenge accuracy; for HANS, 3-way predictions collapsed and split by heuristic/label."""
  labels = data.challenge["label"]
  if data.challenge_hans:
    predictions = nli.nli_to_hans(predictions)
  report = {"accuracy": accuracy(labels, predictions), "by_heuristic": {}}
  if data.challenge_heuristics:
    heuristics = np.asarray(data.challenge_heuristics)
    for heuristic in sorted(set(data.challenge_heuristics)):
      in_group = heuristics == heuristic
      report["by_heuristic"][heuristic] = {
          name: _group_accuracy(labels, predictions, in_group & (labels == i))
          for i, name in enumerate(nli.HANS_LABELS)
      }
  return report


def decode_tokens(
    model: models.Seq2Seq,
    src: jax.Array,
    *,
    beam_size: int,
    max_len: int,
    alpha: float = 0.6,
    use_beam_search: bool | None = None,
) -> jax.Array:
  """Translations [B, max_len] of src [B, S] (traceable; call it under jit).

  Encodes once, tiles the encoder output per beam, and decodes with the decoder's KV caches
  (`Seq2Seq.init_cache`, `decode=True`); the scalar cache indices are kept out of the
  per-hypothesis cache that beam search reorders and rebuilt from the step's position.
  `use_beam_search` None = beam search when beam_size > 1, greedy otherwise.
  """
  batch = src.shape[0]
  beam = beam_size
  index_filter = nnx.All(nnx.Cache, nnx.PathContains("cache_index"))
  memory, src_valid, _ = model.encode(src)
  model.init_cache(batch * beam, max_len)
  memory, src_valid = jnp.repeat(memory, beam, 0), jnp.repeat(src_valid, beam, 0)
  cache_graph, indices, kv, rest = nnx.split(model, index_filter, nnx.Cache, ...)

  def step_fn(cache, tokens, position):
    kv, memory, src_valid = cache
    # Fresh index Variables of this trace (the ones split above belong to the outer trace).
    position_state = jax.tree.map(lambda _: jnp.asarray(position, jnp.int32), indices)
    m = nnx.merge(cache_graph, position_state, kv, rest)
    logits = m.decode_step(tokens, position, memory, src_valid)
    _, _, kv, _ = nnx.split(m, index_filter, nnx.Cache, ...)
    return jax.nn.log_softmax(logits.astype(jnp.float32)), (kv, memory, src_valid)

  common = dict(
      batch_size=batch, max_len=max_len, bos_id=tokenizer_lib.BOS_ID, eos_id=tokenizer_lib.EOS_ID
  )
  if use_beam_search is None:
    use_beam_search = beam > 1
  if not use_beam_search:
    if beam != 1:
      raise ValueError(f"greedy decoding needs beam_size=1, got {beam}")
    tokens, _ = decoding.greedy_search(step_fn, (kv, memory, src_valid), **common)
  else:
    tokens, _ = decoding.beam_search(
        step_fn, (kv, memory, src_valid), beam_size=beam, alpha=alpha, **common
    )
  return tokens


def make_translate_fn(graphdef: nnx.GraphDef, config: ml_collections.ConfigDict):
  """Jitted `translate(params, model_state, src [B, S]) -> tokens [B, nmt.max_decode_len]`."""

  @jax.jit
  def translate(params, model_state, src):
    model = nnx.merge(graphdef, params, model_state)
    return decode_tokens(
        model,
        src,
        beam_size=config.nmt.beam_size,
        max_len=config.nmt.max_decode_len,
        alpha=config.nmt.alpha,
    )

  return translate


def translate_eval(translate, state, data: TaskData, config, mesh) -> tuple[list[str], list[str]]:
  """Hypotheses and references of the eval set (first nmt.max_eval_sentences if > 0)."""
  limit = config.nmt.max_eval_sentences or len(data.eval_references)
  arrays = {"src": data.eval["src"][:limit]}
  hypotheses = []
  for host_batch, batch in _batches(arrays, config, mesh):
    tokens = to_host(translate(state.params, state.model_state, batch["src"]))
    hypotheses += data.tokenizer.decode_batch(tokens[host_batch["mask"]])
  return hypotheses, data.eval_references[:limit]


def _summary_scalars(result: dict[str, Any], data: TaskData, config, prefix: str):
  scalars = {f"{prefix}/loss": result["loss"]}
  if result["predictions"] is not None:
    labels = data.eval["label"]
    scalars[f"{prefix}/accuracy"] = accuracy(labels, result["predictions"])
  scalars[f"{prefix}/rows_within"] = float(np.mean(result["rows_within"]))
  scalars[f"{prefix}/cols_within"] = float(np.mean(result["cols_within"]))
  return scalars


def _heatmaps(result, data: TaskData, config, workdir: str) -> list[str]:
  """PNG heatmaps of head 0 of the first encoder (and decoder) layer for a few eval examples."""
  tok = data.tokenizer
  pieces = _pieces(tok)
  names = layer_names(config)
  first = [0] + ([config.model.num_layers] if config.task == "translation" else [])
  paths = []
  for i, (maps, inputs) in enumerate(zip(result["attention"], result["inputs"])):
    for layer in first:
      ids = (
          inputs["ids"]
          if config.task == "classification"
          else (inputs["src"] if layer == 0 else inputs["tgt_in"])
      )
      n = int(batching.sequence_lengths(ids[None])[0])
      labels = [pieces[t] for t in ids[:n]]
      paths.append(
          plots.save_attention_heatmap(
              os.path.join(workdir, "plots", f"attention_{names[layer]}_head0_ex{i}.png"),
              maps[layer][:n, :n],
              labels,
              title=f"{config.model.attention}: {names[layer]} head 0, eval example {i}",
          )
      )
  return paths


def final_report(eval_step, translate, state, data: TaskData, config, mesh, workdir):
  """report.json's content (module docstring of main) and the heatmaps."""
  result = run_eval(
      eval_step, state, data.eval, config, mesh, keep_attention=config.plots.num_examples
  )
  report: dict[str, Any] = {
      "task": config.task,
      "attention": config.model.attention,
      "step": int(state.step),
      "eval_loss": result["loss"],
  }
  if config.task == "classification":
    labels, predictions = data.eval["label"], result["predictions"]
    report["accuracy"] = accuracy(labels, predictions)
    report["macro_f1"] = macro_f1(labels, predictions, data.num_classes)
    report["num_examples"] = int(len(labels))
    if data.challenge is not None:
      challenge = run_eval(eval_step, state, data.challenge, config, mesh)
      report["challenge"] = challenge_report(data, challenge["predictions"])
      report["challenge"]["num_examples"] = int(len(data.challenge["label"]))
  else:
    hypotheses, references = translate_eval(translate, state, data, config, mesh)
    report["bleu"] = corpus_bleu(hypotheses, references)
    report["num_sentences"] = len(hypotheses)
    report["examples"] = [
        {"hypothesis": h, "reference": r} for h, r in list(zip(hypotheses, references))[:3]
    ]
  if data.glove_matched is not None:
    report["glove_matched_pieces"] = data.glove_matched
  report["constraints"] = _constraint_report(result, config)
  multipliers = np.asarray(jax.device_get(state.extra["multipliers"]))
  report["constraints"]["mean_multiplier"] = {
      name: float(multipliers[l].mean()) for l, name in enumerate(layer_names(config))
  }
  if jax.process_index() == 0:
    report["plots"] = [
        os.path.relpath(p, workdir) for p in _heatmaps(result, data, config, workdir)
    ]
  return report


def _write_report(report: dict[str, Any], workdir: str) -> None:
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  headline = {
      k: report[k] for k in ("accuracy", "macro_f1", "bleu", "num_sentences") if k in report
  }
  if "challenge" in report:
    headline["challenge_accuracy"] = report["challenge"]["accuracy"]
  headline.update(
      {f"constraints_{k}": report["constraints"][k] for k in ("rows_within", "cols_within")}
  )
  print(
      "report: "
      + ", ".join(
          f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()
      ),
      flush=True,
  )
  print(f"Wrote {os.path.join(workdir, 'report.json')}", flush=True)


# --- Recipe ---------------------------------------------------------------------------------------


def _setup(config: ml_collections.ConfigDict, workdir: str, training: bool = True):
  mesh = make_mesh(config.mesh)
  data = load_data(config, workdir)
  train_examples = len(next(iter(data.train.values())))
  resolve_train_steps(config, train_examples, training=training)
  tx = make_optimizer(config.optimizer, config.num_train_steps, config.batch_size)
  graphdef, state = create_state(config, data, tx, mesh)
  checkpointer = Checkpointer(
      os.path.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints
  )
  return mesh, data, tx, graphdef, state, checkpointer


def _seq_keys(config) -> tuple[str, ...]:
  return ("ids",) if config.task == "classification" else ("src", "tgt_in")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Trains (resuming from the latest checkpoint in `workdir`), then writes report.json.

  Returns the report, or None when the run was stopped by SIGTERM.
  """
  mesh, data, tx, graphdef, state, checkpointer = _setup(config, workdir)
  save_config(config, workdir)
  is_main = jax.process_index() == 0
  writer = MetricWriter(workdir, enabled=is_main)
  train_iterator = TrainIterator(
      data.train, config.batch_size, seed=config.seed, seq_keys=_seq_keys(config)
  )
  restored = checkpointer.restore(state)
  if restored is not None:
    state, iterator_state, step = restored
    train_iterator.set_state(iterator_state)
    writer.truncate_after(step)
    print(f"Resumed from the checkpoint at step {step} in {checkpointer.directory}", flush=True)

  schedule = learning_rate_schedule(config.optimizer, config.num_train_steps, config.batch_size)
  train_step = jit_train_step(
      make_train_step(
          graphdef, make_loss_fn(config), tx, schedule, update_extra=make_update_extra(config)
      ),
      state,
      mesh,
  )
  eval_step = make_eval_step(graphdef, config)
  translate = make_translate_fn(graphdef, config) if config.task == "translation" else None

  def evaluate(state: TrainState) -> dict[str, float]:
    return _summary_scalars(
        run_eval(eval_step, state, data.eval, config, mesh), data, config, "eval"
    )

  state, preempted = train_loop(
      state=state,
      train_step=train_step,
      train_iterator=train_iterator,
      mesh=mesh,
      checkpointer=checkpointer,
      writer=writer,
      **loop_settings(config),
      # Sequence positions per example as batched (fixed shapes, so padding included).
      tokens_per_example=(
          config.data.max_len
          if config.task == "classification"
          else config.data.max_source_len + config.data.max_target_len
      ),
      evaluate=evaluate if config.eval_every_steps > 0 else None,
      show_progress=is_main,
  )
  if preempted:
    stop_after_preemption(state, checkpointer, writer)
    return None

  report = final_report(eval_step, translate, state, data, config, mesh, workdir)
  scalars = {f"final/{k}": report[k] for k in ("accuracy", "macro_f1", "bleu") if k in report}
  if "challenge" in report:
    scalars["final/challenge_accuracy"] = report["challenge"]["accuracy"]
  writer.write_scalars(int(state.step), scalars)
  writer.close()
  checkpointer.close()
  if is_main:
    _write_report(report, workdir)
  return report


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir`; writes report.json."""
  mesh, data, _, graphdef, state, checkpointer = _setup(config, workdir, training=False)
  restored = checkpointer.restore(state)
  checkpointer.close()
  if restored is None:
    raise UserError(f"no checkpoint in '{checkpointer.directory}': train first (--mode=train)")
  state, _, _ = restored
  translate = make_translate_fn(graphdef, config) if config.task == "translation" else None
  report = final_report(
      make_eval_step(graphdef, config), translate, state, data, config, mesh, workdir
  )
  if jax.process_index() == 0:
    _write_report(report, workdir)
  return report
