"""BLEU (via sacrebleu), accuracy and macro-F1 for the paper's NMT and classification results.

BLEU is sacrebleu's corpus BLEU on detokenised text with its default ``13a`` tokenizer, the
setting comparable across papers: already tokenised text (e.g. Moses-tokenised WMT14) inflates
scores, so `detokenize` first (`looks_tokenized` tells which texts need it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from trainkit.errors import import_extra


def looks_tokenized(lines: Sequence[str], threshold: float = 0.5) -> bool:
  """Whether most non-empty lines have punctuation split off (Moses's "Parlament ." and "Antrag ,
  im")."""
  lines = [line for line in lines if line.strip()]
  if not lines:
    return False
  hits = sum(bool(re.search(r"\w [.,;:!?](?: |$)", line)) for line in lines)
  return hits / len(lines) >= threshold


def detokenize(lines: Sequence[str], lang: str) -> list[str]:
  """Moses detokenisation (sacremoses) of each line, for the given language code."""
  sacremoses = import_extra("sacremoses", "causal", "detokenising references")
  detokenizer = sacremoses.MosesDetokenizer(lang=lang)
  return [detokenizer.detokenize(line.split()) for line in lines]


def bleu_signature() -> str:
  """sacrebleu's signature of the setting `corpus_bleu` uses (report it beside the score)."""
  metric = import_extra("sacrebleu", "causal", "BLEU").metrics.BLEU()
  metric.corpus_score(["a"], [["a"]])  # The signature names the reference count once it is known.
  return str(metric.get_signature())


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Corpus BLEU (0-100) of ``hypotheses`` against one reference each (ValueError if misaligned)."""
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references.")
  sacrebleu = import_extra("sacrebleu", "causal", "BLEU")
  return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def _flat(labels, predictions) -> tuple[np.ndarray, np.ndarray]:
  labels = np.asarray(labels).reshape(-1)
  predictions = np.asarray(predictions).reshape(-1)
  if labels.shape != predictions.shape:
    raise ValueError(f"{labels.shape[0]} labels but {predictions.shape[0]} predictions.")
  return labels, predictions


def accuracy(labels, predictions) -> float:
  """Fraction of correct predictions (NaN for none)."""
  labels, predictions = _flat(labels, predictions)
  return float(np.mean(labels == predictions)) if labels.size else float("nan")


def macro_f1(labels, predictions, num_classes: int) -> float:
  """Unweighted mean over ``num_classes`` classes of the per-class F1.

  A class with no true and no predicted example has F1 0 and still counts, as in
  ``sklearn.metrics.f1_score(average="macro", labels=range(num_classes))``.
  """
  labels, predictions = _flat(labels, predictions)
  classes = np.arange(num_classes)[:, None]
  true_positive = ((labels == classes) & (predictions == classes)).sum(1)
  false_positive = ((labels != classes) & (predictions == classes)).sum(1)
  false_negative = ((labels == classes) & (predictions != classes)).sum(1)
  denominator = 2 * true_positive + false_positive + false_negative
  f1 = np.where(denominator > 0, 2 * true_positive / np.maximum(denominator, 1), 0.0)
  return float(f1.mean())
