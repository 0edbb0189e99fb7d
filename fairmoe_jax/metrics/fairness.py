"""Group-fairness metrics for multi-class classification with several sensitive attributes.

Device side (pure ``jnp``, inside a jitted eval step): per-batch count tensors ``counts[g, y,
p]``, which add (``jax.tree.map(jnp.add, acc, batch_counts)``). Host side (numpy float64):
metrics from a finished count tensor and the paper's multi-attribute mean ``MF_Psi`` (Eq. 1).
Formulas and the conventions for empty groups and undefined rates: ``docs/design.md``
("Fairness metrics").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

METRIC_NAMES: tuple[str, ...] = ("pqd", "dp", "eopp", "eodds")

# Device side: count tensors.


def confusion_counts(
    labels: jax.Array,
    predictions: jax.Array,
    groups: jax.Array,
    mask: jax.Array,
    *,
    num_groups: int,
    num_classes: int,
) -> jax.Array:
  """Per-group confusion matrices, float32 ``[num_groups, num_classes, num_classes]``.

  An example is skipped when ``mask`` is 0 (padding), ``groups < 0`` (attribute missing) or an
  index is out of range (nothing can raise under ``jit``).
  """
  labels = jnp.asarray(labels, jnp.int32)
  predictions = jnp.asarray(predictions, jnp.int32)
  groups = jnp.asarray(groups, jnp.int32)
  # Counts, not weights: any nonzero mask entry means "real example".
  weight = (jnp.asarray(mask) != 0) & (groups >= 0)

  group_onehot = jax.nn.one_hot(groups, num_groups, dtype=jnp.float32)
  group_onehot = group_onehot * weight[:, None].astype(jnp.float32)
  # An out-of-range label or prediction must not alias onto another (y, p) cell
  # of the flattened index, so it zeroes the example's row instead.
  in_range = (
      (labels >= 0) & (labels < num_classes) & (predictions >= 0) & (predictions < num_classes)
  )
  joint = jnp.where(in_range, labels * num_classes + predictions, -1)
  joint_onehot = jax.nn.one_hot(joint, num_classes * num_classes, dtype=jnp.float32)

  # One matmul [G, B] x [B, C*C]. HIGHEST precision keeps the 0/1 products and their
  # sums exact on accelerators whose default float32 matmul uses bf16/tf32 passes.
  counts = jnp.einsum("bg,bk->gk", group_onehot, joint_onehot, precision=jax.lax.Precision.HIGHEST)
  return counts.reshape(num_groups, num_classes, num_classes)


def attribute_counts(
    labels: jax.Array,
    predictions: jax.Array,
    attributes: jax.Array,
    mask: jax.Array,
    *,
    group_sizes: tuple[int, ...],
    num_classes: int,
) -> tuple[jax.Array, ...]:
  """One ``confusion_counts`` tensor per attribute column of ``attributes`` ``[B, m]``.

  ``group_sizes[i]`` is the number of groups of attribute ``i``.
  """
  attributes = jnp.asarray(attributes)
  if attributes.ndim != 2 or attributes.shape[1] != len(group_sizes):
    raise ValueError(
        f"attributes has shape {attributes.shape}; expected [B, {len(group_sizes)}] "
        f"to match group_sizes={group_sizes}"
    )
  return tuple(
      confusion_counts(
          labels, predictions, attributes[:, i], mask, num_groups=g, num_classes=num_classes
      )
      for i, g in enumerate(group_sizes)
  )


def overall_counts(
    labels: jax.Array, predictions: jax.Array, mask: jax.Array, *, num_classes: int
) -> jax.Array:
  """Confusion matrix over all unmasked examples, float32 ``[num_classes, num_classes]``.

  Needed because a per-attribute tensor drops examples whose attribute is missing.
  """
  single_group = jnp.zeros(jnp.shape(labels), jnp.int32)
  return confusion_counts(
      labels, predictions, single_group, mask, num_groups=1, num_classes=num_classes
  )[0]


# Host side: metrics from counts.


@dataclasses.dataclass(frozen=True)
class AttributeFairness:
  """Fairness of one sensitive attribute.

  ``group_accuracy[g]`` is NaN for an empty group (undefined, and 0.0 would look
  like a measured accuracy); empty groups never enter ``pqd``/``dp``/``eopp``/``eodds``.
  """

  pqd: float
  dp: float
  eopp: float
  eodds: float
  group_n: np.ndarray  # int64 [G]
  group_accuracy: np.ndarray  # float64 [G]
  empty_groups: list[int]

  @property
  def measurable(self) -> bool:
    """Whether two or more groups have examples: with one, every disparity is 0 by definition
    (PQD 1.0, DP 0.0), which says nothing about fairness."""
    return int(np.count_nonzero(self.group_n)) >= 2


def _spread(values: np.ndarray, defined: np.ndarray) -> float | None:
  """``max - min`` of ``values`` over ``defined`` entries; None if fewer than 2."""
  if np.count_nonzero(defined) < 2:
    return None
  v = values[defined]
  return float(v.max() - v.min())


def _safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
  """``num / den`` with 0 where ``den == 0``; callers mask those entries out anyway."""
  return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _mean_or(values: list[float], default: float) -> float:
  return float(np.mean(values)) if values else default


def _check_counts(counts: np.ndarray) -> np.ndarray:
  counts = np.asarray(counts, dtype=np.float64)
  if counts.ndim != 3 or counts.shape[1] != counts.shape[2]:
    raise ValueError(f"expected counts of shape [G, C, C], got {counts.shape}")
  if np.any(counts < 0) or not np.all(np.isfinite(counts)):
    raise ValueError("counts must be finite and non-negative")
  return counts


def predictive_quality_disparity(counts: np.ndarray) -> float:
  """PQD = min_g acc_g / max_g acc_g over non-empty groups (1.0 = perfectly fair).

  1.0 when fewer than two groups are non-empty or when every group has accuracy 0:
  there is no measurable disparity in either case.
  """
  counts = _check_counts(counts)
  n = counts.sum(axis=(1, 2))
  nonempty = n > 0
  if np.count_nonzero(nonempty) < 2:
    return 1.0
  acc = np.trace(counts, axis1=1, axis2=2)[nonempty] / n[nonempty]
  return 1.0 if acc.max() == 0.0 else float(acc.min() / acc.max())


def demographic_parity(counts: np.ndarray) -> float:
  """Mean over classes c of the spread over non-empty groups of P(pred = c | g)."""
  counts = _check_counts(counts)
  n = counts.sum(axis=(1, 2))
  nonempty = n > 0
  pred_rate = _safe_divide(counts.sum(axis=1), n[:, None])  # [G, C]
  spreads = [_spread(pred_rate[:, c], nonempty) for c in range(counts.shape[1])]
  return _mean_or([s for s in spreads if s is not None], 0.0)


def _one_vs_rest_rates(counts: np.ndarray) -> tuple[np.ndarray, ...]:
  """Per group and class: TPR, its defined-mask, FPR, its defined-mask (all [G, C])."""
  tp = np.diagonal(counts, axis1=1, axis2=2)  # [G, C]
  positives = counts.sum(axis=2)  # label == c
  predicted = counts.sum(axis=1)  # pred == c
  negatives = counts.sum(axis=(1, 2))[:, None] - positives  # label != c
  tpr = _safe_divide(tp, positives)
  fpr = _safe_divide(predicted - tp, negatives)
  return tpr, positives > 0, fpr, negatives > 0


def equal_opportunity(counts: np.ndarray) -> float:
  """Mean over classes c of the spread over groups of TPR_c = P(pred = c | y = c, g).

  Only groups with an example of class c take part for c; a class with fewer than
  two such groups is skipped; 0.0 if every class is skipped.
  """
  counts = _check_counts(counts)
  tpr, tpr_ok, _, _ = _one_vs_rest_rates(counts)
  spreads = [_spread(tpr[:, c], tpr_ok[:, c]) for c in range(counts.shape[1])]
  return _mean_or([s for s in spreads if s is not None], 0.0)


def equalized_odds(counts: np.ndarray) -> float:
  """Mean over classes c of max(spread of TPR_c, spread of FPR_c) over groups.

  FPR_c = P(pred = c | y != c, g). Each spread uses only groups where its rate is
  defined; a class takes the max of its defined spreads and is skipped if neither
  is; 0.0 if every class is skipped. Binary targets: equals fairlearn's
  ``equalized_odds_difference``.
  """
  counts = _check_counts(counts)
  tpr, tpr_ok, fpr, fpr_ok = _one_vs_rest_rates(counts)
  per_class = []
  for c in range(counts.shape[1]):
    spreads = (_spread(tpr[:, c], tpr_ok[:, c]), _spread(fpr[:, c], fpr_ok[:, c]))
    defined = [s for s in spreads if s is not None]
    if defined:
      per_class.append(max(defined))
  return _mean_or(per_class, 0.0)


def attribute_fairness(counts: np.ndarray) -> AttributeFairness:
  """All metrics of one attribute from its count tensor ``[G, C, C]``."""
  counts = _check_counts(counts)
  n = counts.sum(axis=(1, 2))
  correct = np.trace(counts, axis1=1, axis2=2)
  accuracy = np.full(n.shape, np.nan)
  np.divide(correct, n, out=accuracy, where=n > 0)
  return AttributeFairness(
      pqd=predictive_quality_disparity(counts),
      dp=demographic_parity(counts),
      eopp=equal_opportunity(counts),
      eodds=equalized_odds(counts),
      # Counts are exact integers held in float32; rint guards against float noise.
      group_n=np.rint(n).astype(np.int64),
      group_accuracy=accuracy,
      empty_groups=[int(g) for g in np.flatnonzero(n == 0)],
  )


def multi_attribute_fairness(per_attribute: Sequence[AttributeFairness]) -> dict[str, float]:
  """``MF_Psi = (1/m) sum_i Psi(s_i)`` (paper Eq. 1) for every Psi in ``METRIC_NAMES``, over the
  ``measurable`` attributes: one with a single group in the split (e.g. an identity fold without
  a Bald person) has PQD 1.0 and DP 0.0 by definition, which averaged in would make the MF
  figures look fairer than any attribute measured. When none is measurable, the mean of all
  (the report flags every one of them)."""
  if not per_attribute:
    raise ValueError("multi-attribute fairness needs at least one attribute")
  measured = [a for a in per_attribute if a.measurable] or list(per_attribute)
  return {name: float(np.mean([getattr(a, name) for a in measured])) for name in METRIC_NAMES}


def overall_accuracy(overall: np.ndarray) -> tuple[float, int]:
  """(accuracy, number of examples) from an ``overall_counts`` matrix; accuracy 0.0 if empty."""
  overall = np.asarray(overall, dtype=np.float64)
  if overall.ndim != 2 or overall.shape[0] != overall.shape[1]:
    raise ValueError(f"expected overall counts of shape [C, C], got {overall.shape}")
  n = overall.sum()
  accuracy = float(np.trace(overall) / n) if n > 0 else 0.0
  return accuracy, int(np.rint(n))
