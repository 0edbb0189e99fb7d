"""The challenge split's score (HANS and the like): accuracy, and per heuristic and gold label.

Scored by the classification task (`tasks.PairClassification.report`) and by the data-only
readers of `references`, the same way for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from causal_attn_jax.data import nli
from causal_attn_jax.metrics.bleu import accuracy

if TYPE_CHECKING:
  from causal_attn_jax.data.loading import TaskData


def _group_accuracy(labels: np.ndarray, predictions: np.ndarray, keep: np.ndarray) -> float | None:
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
