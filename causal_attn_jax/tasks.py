"""The Causal Transformers paper's two kinds of run, pair classification and translation: what
differs between them lives on its task object (`get_task`), so `train` and `report` run one
recipe for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from ml_collections import ConfigDict

from causal_attn_jax import constraints, decoding, models
from causal_attn_jax.data import tokenizer as tokenizer_lib
from causal_attn_jax.data.iterator import device_batches
from causal_attn_jax.data.loading import TaskData, load_classification, load_translation
from causal_attn_jax.metrics import accuracy, bleu, macro_f1
from causal_attn_jax.metrics.challenge import challenge_report
from trainkit.errors import UserError
from trainkit.mesh import to_host
from trainkit.textfiles import iter_lines
from trainkit.train_state import TrainState, compute_dtype

Batch = dict[str, jax.Array]
# (mean loss, metrics, one record per self-attention layer, logits)
LossOutput = tuple[jax.Array, dict[str, jax.Array], list[models.SelfAttentionRecord], jax.Array]


def _encoder_names(config: ConfigDict) -> list[str]:
  return [f"enc{l}" for l in range(config.model.num_layers)]


class PairClassification:
  """Sentence-pair classification (NLI, paraphrase) with `models.PairClassifier`.

  `Translation` has the same methods: what `train` and `report` ask of a task.
  """

  name = "classification"
  seq_keys = ("ids",)  # Token-id arrays whose lengths bucket the training batches.

  def load_data(self, config: ConfigDict, workdir: str) -> TaskData:
    return load_classification(config, workdir)

  def max_positions(self, config: ConfigDict) -> int:
    return config.data.max_len

  def build_model(self, config: ConfigDict, data: TaskData, rngs: nnx.Rngs) -> nnx.Module:
    spec = models.TransformerSpec.from_config(config.model, self.max_positions(config))
    dtype = compute_dtype(config.compute_dtype)
    vocab = data.tokenizer.vocab_size
    return models.PairClassifier(vocab, data.num_classes, spec, dtype=dtype, rngs=rngs)

  def layer_names(self, config: ConfigDict) -> list[str]:
    """Names of the constrained self-attention layers, in the order of the multipliers."""
    return _encoder_names(config)

  def tokens_per_example(self, config: ConfigDict) -> int:
    """Sequence positions per example as batched (fixed shapes, so padding included)."""
    return config.data.max_len

  def heatmap_inputs(self, config: ConfigDict) -> list[tuple[int, str]]:
    """(layer index, batch key of its tokens) of each layer drawn in the report's heatmaps."""
    return [(l, "ids") for l in range(config.model.num_layers)]

  def loss(self, config, model, batch, *, train, rngs) -> LossOutput:
    """(mean loss, metrics, records, logits); examples with `mask` False weigh nothing."""
    del config
    logits, records = model(batch["ids"], batch["segment_ids"], train=train, rngs=rngs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    weights = batch.get("mask", jnp.ones_like(ce, bool)).astype(jnp.float32)
    metrics = {"accuracy": constraints.weighted_mean(correct, weights, None)}
    return constraints.weighted_mean(ce, weights, None), metrics, records, logits

  def eval_outputs(self, logits: jax.Array) -> dict[str, jax.Array]:
    return {"predictions": jnp.argmax(logits, -1)}

  def report(self, config, data, state, result, *, evaluate, graphdef, mesh) -> dict[str, Any]:
    del config, state, graphdef, mesh  # Everything comes from the eval passes.
    labels, predictions = data.eval["label"], result["predictions"]
    report = {
        "accuracy": accuracy(labels, predictions),
        "macro_f1": macro_f1(labels, predictions, data.num_classes),
        "num_examples": int(len(labels)),
    }
    if data.challenge is not None:
      challenge = evaluate(data.challenge)
      report["challenge"] = challenge_report(data, challenge["predictions"])
      report["challenge"]["num_examples"] = int(len(data.challenge["label"]))
    return report

  def predict(self, config, data, state, *, graphdef, mesh, path) -> dict[str, list[Any]]:
    premises, hypotheses = [], []
    for number, line in iter_lines(path, "predict.input"):
      if not line.strip() or line.startswith("#"):
        continue
      fields = line.split("\t")
      if len(fields) != 2:
        raise UserError(
            f"{path}:{number}: expected 2 tab-separated fields (premise, hypothesis), "
            f"got {len(fields)}"
        )
      premises.append(fields[0])
      hypotheses.append(fields[1])
    if not premises:
      raise UserError(f"{path}: no sentence pair to classify")
    probs = pair_probabilities(
        config, data, state, make_pair_probabilities(graphdef), mesh, premises, hypotheses
    )
    prediction = probs.argmax(-1)
    columns: dict[str, list[Any]] = {
        "premise": premises,
        "hypothesis": hypotheses,
        "prediction": [data.label_names[c] for c in prediction],
    }
    for c, name in enumerate(data.label_names):
      columns[f"prob_{name}"] = [f"{p:.6g}" for p in probs[:, c]]
    return columns


class Translation:
  """Translation with `models.Seq2Seq`; its decoder self-attention layers are constrained too."""

  name = "translation"
  seq_keys = ("src", "tgt_in")

  def load_data(self, config: ConfigDict, workdir: str) -> TaskData:
    return load_translation(config, workdir)

  def max_positions(self, config: ConfigDict) -> int:
    # The position table covers the source, the training targets and beam-search decoding.
    d = config.data
    return max(d.max_source_len, d.max_target_len, config.nmt.max_decode_len) + 1

  def build_model(self, config: ConfigDict, data: TaskData, rngs: nnx.Rngs) -> nnx.Module:
    spec = models.TransformerSpec.from_config(config.model, self.max_positions(config))
    dtype = compute_dtype(config.compute_dtype)
    return models.Seq2Seq(data.tokenizer.vocab_size, spec, dtype=dtype, rngs=rngs)

  def layer_names(self, config: ConfigDict) -> list[str]:
    return _encoder_names(config) + [f"dec{l}" for l in range(config.model.num_decoder_layers)]

  def tokens_per_example(self, config: ConfigDict) -> int:
    return config.data.max_source_len + config.data.max_target_len

  def heatmap_inputs(self, config: ConfigDict) -> list[tuple[int, str]]:
    # Decoder self-attention is over the shifted targets.
    encoder = config.model.num_layers
    return [(l, "src") for l in range(encoder)] + [
        (encoder + l, "tgt_in") for l in range(config.model.num_decoder_layers)
    ]

  def loss(self, config, model, batch, *, train, rngs) -> LossOutput:
    logits, records = model(batch["src"], batch["tgt_in"], train=train, rngs=rngs)
    targets = batch["tgt_out"]
    weights = (targets != tokenizer_lib.PAD_ID).astype(jnp.float32)
    if "mask" in batch:
      weights = weights * batch["mask"][:, None]
    vocab = logits.shape[-1]
    smoothing = config.nmt.label_smoothing if train else 0.0
    labels = optax.smooth_labels(jax.nn.one_hot(targets, vocab), smoothing)
    ce = optax.softmax_cross_entropy(logits, labels)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    metrics = {"token_accuracy": constraints.weighted_mean(correct, weights, None)}
    return constraints.weighted_mean(ce, weights, None), metrics, records, logits

  def eval_outputs(self, logits: jax.Array) -> dict[str, jax.Array]:
    del logits  # Token accuracy is in the metrics; the report decodes with `decoding` instead.
    return {}

  def predict(self, config, data, state, *, graphdef, mesh, path) -> dict[str, list[Any]]:
    sources = [line for _, line in iter_lines(path, "predict.input") if line.strip()]
    if not sources:
      raise UserError(f"{path}: no sentence to translate")
    translate = decoding.make_translate_fn(graphdef, config)
    translations = translate_sentences(config, data, state, translate, mesh, sources)
    return {"source": sources, "translation": translations}

  def report(self, config, data, state, result, *, evaluate, graphdef, mesh) -> dict[str, Any]:
    del result, evaluate  # BLEU needs decoded text, not the teacher-forced pass.
    translate = decoding.make_translate_fn(graphdef, config)
    limit = config.nmt.max_eval_sentences or len(data.eval_references)
    hypotheses = translate_ids(config, data, state, translate, mesh, data.eval["src"][:limit])
    references = data.eval_references[:limit]
    detokenizer = config.nmt.detokenize
    if detokenizer == "auto":
      detokenizer = "moses" if bleu.looks_tokenized(references) else "none"
    if detokenizer == "moses":
      # The model learnt the references' tokenisation, so its output is tokenised the same way.
      lang = config.data.source_lang if config.data.reverse else config.data.target_lang
      hypotheses = bleu.detokenize(hypotheses, lang)
      references = bleu.detokenize(references, lang)
    return {
        "bleu": bleu.corpus_bleu(hypotheses, references),
        "bleu_signature": bleu.bleu_signature(),
        "detokenized": detokenizer,
        "num_sentences": len(hypotheses),
        "examples": [
            {"hypothesis": h, "reference": r} for h, r in list(zip(hypotheses, references))[:3]
        ],
    }


# --- Inference on new inputs (--mode=predict and causal_attn_jax.load_run) -----------------------

PairProbabilities = Callable[[TrainState, Batch], jax.Array]


def make_pair_probabilities(graphdef: nnx.GraphDef) -> PairProbabilities:
  """Jitted `probabilities(state, batch) -> [B, C]`: a pair classifier's softmax."""

  @jax.jit
  def probabilities(state: TrainState, batch: Batch) -> jax.Array:
    model = nnx.merge(graphdef, state.params, state.model_state)
    logits, _ = model(batch["ids"], batch["segment_ids"], train=False)
    return jax.nn.softmax(logits.astype(jnp.float32), -1)

  return probabilities


def pair_probabilities(
    config: ConfigDict,
    data: TaskData,
    state: TrainState,
    probabilities: PairProbabilities,
    mesh: Mesh,
    premises: Sequence[str],
    hypotheses: Sequence[str],
) -> np.ndarray:
  """float32 [N, C]: each pair's label probabilities, in padded batches of eval_batch_size."""
  ids, segments = data.tokenizer.encode_pair(list(premises), list(hypotheses), config.data.max_len)
  rows = []
  arrays = {"ids": ids, "segment_ids": segments}
  for host_batch, batch in device_batches(arrays, config.eval_batch_size, mesh):
    rows.append(to_host(probabilities(state, batch))[host_batch["mask"]])
  return np.concatenate(rows)


def translate_sentences(
    config: ConfigDict,
    data: TaskData,
    state: TrainState,
    translate: decoding.TranslateFn,
    mesh: Mesh,
    sources: Sequence[str],
) -> list[str]:
  """The beam-search translation (config.nmt) of each source sentence, detokenised pieces."""
  src = data.tokenizer.encode(
      list(sources), config.data.max_source_len, add_bos=False, add_eos=True
  )
  return translate_ids(config, data, state, translate, mesh, src)


def translate_ids(
    config: ConfigDict,
    data: TaskData,
    state: TrainState,
    translate: decoding.TranslateFn,
    mesh: Mesh,
    src: np.ndarray,
) -> list[str]:
  """`translate_sentences` of source sentences already encoded, src int32 [N, S]."""
  translations = []
  for host_batch, batch in device_batches({"src": src}, config.eval_batch_size, mesh):
    tokens = to_host(translate(state.params, state.model_state, batch["src"]))
    translations += data.tokenizer.decode_batch(tokens[host_batch["mask"]])
  return translations


Task = PairClassification | Translation
TASKS: dict[str, Task] = {t.name: t for t in (PairClassification(), Translation())}


def get_task(config: ConfigDict) -> Task:
  """The task object of `config.task`."""
  if config.task not in TASKS:
    raise ValueError(f"unknown task {config.task!r}; known tasks: {sorted(TASKS)}")
  return TASKS[config.task]
