"""Reference readers for the Causal Transformer results tables, scored as the task scores a model.

majority class  the training split's most frequent label (on HANS, collapsed to two labels);
cue reader      (generated testbeds) the label the planted cue points to (a tie is wrong);
chance          a uniform guess;
source copied   (translation) the source sentence as its own translation, scored by BLEU.
`with_controls` adds (it trains) the controls of a claim on the constraint or attention, role
control: causal attention untrained (one step at learning rate 0), uniform attention (pair tasks).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Mapping

import ml_collections
import numpy as np

from causal_attn_jax.config import constraint_spec
from causal_attn_jax.constraints import constraint_violations
from causal_attn_jax.data import loading, nli, ood_pairs, spurious, tokenizer
from causal_attn_jax.metrics import attention_sparsity, bleu
from causal_attn_jax.metrics.challenge import challenge_report
from paper_runner.table_spec import CONTROL_ROLE, untrained_control

Reader = Callable[[nli.PairData], np.ndarray]


def _pair_reports(config: ml_collections.ConfigDict) -> dict[str, dict[str, Any]]:
  train, evaluation, challenge = loading.load_pairs(config)
  k = train.num_classes
  majority = int(np.bincount(train.labels, minlength=k).argmax())
  readers: dict[str, Reader] = {
      f"majority class of the training split ({train.label_names[majority]})": (
          lambda pairs: np.full(len(pairs.labels), majority)
      )
  }
  generator = config.data.get("generator", "")
  if generator == "spurious_pairs":
    entailment = train.label_names.index("entailment")
    readers["cue reader (full overlap = entailment)"] = lambda pairs: np.where(
        spurious.overlap_cue(pairs), entailment, 1 - entailment
    )
  elif generator == "ood_pairs":
    lexicon = ood_pairs.lexicon(ood_pairs.OodPairsSpec(**config.data.ood_pairs.to_dict()))
    readers["cue reader (the filler majority's label)"] = lambda pairs: ood_pairs.cue_prediction(
        pairs, lexicon
    )
  reports = {}
  for name, read in readers.items():
    predictions = read(evaluation)
    reports[name] = {"accuracy": float(np.mean(predictions == evaluation.labels))}
    if challenge is not None:
      scored = loading.TaskData(
          tokenizer=None,
          train={},
          eval={},
          challenge={"label": challenge.labels},
          challenge_hans=challenge.label_names == nli.HANS_LABELS
          and train.label_names != nli.HANS_LABELS,
          challenge_heuristics=challenge.heuristics,
      )
      reports[name]["challenge"] = challenge_report(scored, read(challenge))
  chance = {"accuracy": 1.0 / k}
  if challenge is not None:
    chance["challenge"] = {"accuracy": 1.0 / challenge.num_classes}
  reports[f"chance ({k} classes, a uniform guess)"] = chance
  return reports


def _translation_reports(config: ml_collections.ConfigDict) -> dict[str, dict[str, Any]]:
  _, (sources, targets) = loading.load_parallel(config)
  limit = config.nmt.max_eval_sentences or len(targets)
  sources, targets = sources[:limit], targets[:limit]
  detokenizer = config.nmt.detokenize
  if detokenizer == "auto":
    detokenizer = "moses" if bleu.looks_tokenized(targets) else "none"
  if detokenizer == "moses":
    sources = bleu.detokenize(sources, config.data.source_lang)
    targets = bleu.detokenize(targets, config.data.target_lang)
  return {"source copied as its translation": {"bleu": bleu.corpus_bleu(sources, targets)}}


def _rooted(config: Mapping[str, Any], base_dir: str) -> ml_collections.ConfigDict:
  """`config` with its relative data files read from `base_dir` (where the runs started)."""
  config = ml_collections.ConfigDict(dict(config))
  for key, value in list(config.data.items()):
    if isinstance(value, str) and value and key.endswith(("_file", "_source", "_target")):
      if not os.path.isabs(os.path.expanduser(value)):
        config.data[key] = os.path.join(base_dir, value)
  return config


def reference_reports(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """{reader name: a report.json-shaped dict} for the data of a run's saved `config`."""
  config = _rooted(config, base_dir)
  return _translation_reports(config) if config.task == "translation" else _pair_reports(config)


UNTRAINED_SEEDS = (0, 1, 2)  # The causal tables' seeds.


def uniform_attention(run: ml_collections.ConfigDict, eval_ids: np.ndarray) -> dict[str, Any]:
  """The constraint and sparsity measures of attention uniform over each query's real tokens."""
  valid = eval_ids != tokenizer.PAD_ID
  mask = (valid[:, :, None] & valid[:, None, :])[:, None]  # [B, 1, N, N]: one head.
  probs = (mask / np.maximum(mask.sum(-1, keepdims=True), 1)).astype(np.float32)
  spec = constraint_spec(run)
  measured = constraint_violations(probs, mask, decoder=False, spec=spec, valid_q=valid)
  within, keys = float(measured.nodes_within), float(attention_sparsity(probs, valid)[0])
  report = dict(constraints=dict(nodes_within=within), attention=dict(effective_keys=keys))
  return dict(report, role=CONTROL_ROLE)


def with_controls(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """`reference_reports` and the controls' constraint and attention measures."""
  from causal_attn_jax import tasks, train  # Imports the model: only where controls are trained.

  run = _rooted(config, base_dir)  # The controls read the runs' data too.
  with tempfile.TemporaryDirectory() as workdir:  # The eval split as a model reads it.
    ids = tasks.get_task(run).load_data(run, workdir).eval["ids"]
  measures, causal = ("constraints", "attention"), {"model.attention": "causal"}
  untrained = untrained_control(
      train.train_and_evaluate, run.to_dict(), causal, measures, UNTRAINED_SEEDS
  )
  return reference_reports(run) | {
      "causal attention untrained (1 step at learning rate 0)": untrained,
      "uniform attention (every real token alike)": uniform_attention(run, ids),
  }
