"""Reference readers for the Causal Transformer results tables, scored as the task scores a model.

majority class  the training split's most frequent label (on HANS, collapsed to two labels);
cue reader      (generated testbeds) the label the planted cue points to (a tie is wrong);
chance          a uniform guess;
source copied   (translation) the source sentence as its own translation, scored by BLEU.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import ml_collections
import numpy as np

from causal_attn_jax.data import loading, nli, ood_pairs, spurious
from causal_attn_jax.metrics import bleu
from causal_attn_jax.metrics.challenge import challenge_report

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


def reference_reports(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """{reader name: a report.json-shaped dict} for the data of a run's saved `config`."""
  config = ml_collections.ConfigDict(dict(config))
  for key, value in list(config.data.items()):  # Relative data files: under `base_dir`.
    if isinstance(value, str) and value and key.endswith(("_file", "_source", "_target")):
      if not os.path.isabs(os.path.expanduser(value)):
        config.data[key] = os.path.join(base_dir, value)
  return _translation_reports(config) if config.task == "translation" else _pair_reports(config)
