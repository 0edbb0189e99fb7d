"""Fairness over intersections of sensitive attributes (e.g. sex x age), from per-example arrays.

An intersection ``"sex*age"`` has one group per combination of the attributes' groups, named by
joining the group names with ``*`` (``"female*<30"``). An example whose value is missing (``-1``)
for any attribute of the intersection is not counted for it.

Intersection groups are often small, and a handful of examples can decide a spread metric, so
groups under ``min_group_size`` are listed as ``small_groups`` and every metric is also given
over the others only (``without_small_groups``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from fairmoe_jax.metrics.fairness import METRIC_NAMES, attribute_fairness, confusion_counts

SEPARATOR = "*"


def parse_intersections(spec: str | Sequence[str]) -> list[tuple[str, ...]]:
  """``"sex*age,age*site"`` (or ``["sex*age", "age*site"]``) -> ``[("sex", "age"), ...]``."""
  terms = spec.split(",") if isinstance(spec, str) else list(spec)
  parsed: list[tuple[str, ...]] = []
  for term in terms:
    if not isinstance(term, str):
      raise ValueError(f"expected strings like 'sex*age', got {term!r}")
    if not term.strip():
      if isinstance(spec, str):
        continue  # A trailing comma, or the empty default.
      raise ValueError("empty intersection")
    names = tuple(name.strip() for name in term.split(SEPARATOR))
    if len(names) < 2 or not all(names):
      raise ValueError(f"{term!r} is not an intersection of two or more attributes (a*b)")
    if len(set(names)) != len(names):
      raise ValueError(f"{term!r} names an attribute twice")
    if names in parsed:
      raise ValueError(f"{term!r} is given twice")
    parsed.append(names)
  return parsed


def check_attributes(
    intersections: Sequence[tuple[str, ...]], attribute_names: Sequence[str]
) -> None:
  """Raises ValueError naming an intersection's attribute that the dataset does not have."""
  for names in intersections:
    unknown = [name for name in names if name not in attribute_names]
    if unknown:
      raise ValueError(
          f"{SEPARATOR.join(names)!r}: no sensitive attribute {', '.join(map(repr, unknown))}; "
          f"the dataset has {', '.join(attribute_names)}"
      )


def intersection_groups(attributes: np.ndarray, group_sizes: Sequence[int]) -> np.ndarray:
  """Row-major combined group index of ``attributes`` ``[N, k]``; -1 where any value is missing."""
  attributes = np.asarray(attributes, np.int64)
  missing = np.any(attributes < 0, axis=1)
  filled = np.where(missing[:, None], 0, attributes)  # Any valid index; overwritten below.
  index = np.ravel_multi_index(tuple(filled.T), tuple(group_sizes))
  return np.where(missing, -1, index)


def _metrics(counts: np.ndarray) -> dict[str, float]:
  result = attribute_fairness(counts)
  return {m: float(getattr(result, m)) for m in METRIC_NAMES}


def intersection_report(
    labels: np.ndarray,
    predictions: np.ndarray,
    attributes: np.ndarray,
    *,
    attribute_names: Sequence[str],
    group_names: Sequence[Sequence[str]],
    intersections: Sequence[tuple[str, ...]],
    num_classes: int,
    min_group_size: int,
) -> dict[str, Any]:
  """``{"sex*age": entry, ...}`` from per-example ``labels``, ``predictions`` and ``attributes``.

  ``labels`` and ``predictions`` are [N] class indices, ``attributes`` [N, m] group indices
  (-1 = missing). Each entry holds the four metrics, ``groups``, ``empty_groups``,
  ``min_group_size``, ``small_groups`` and ``without_small_groups`` (None when fewer than two
  groups are left).
  """
  check_attributes(intersections, attribute_names)
  report: dict[str, Any] = {}
  for names in intersections:
    columns = [list(attribute_names).index(name) for name in names]
    sizes = [len(group_names[c]) for c in columns]
    combined = intersection_groups(np.asarray(attributes)[:, columns], sizes)
    group_keys = [
        SEPARATOR.join(parts) for parts in itertools.product(*(group_names[c] for c in columns))
    ]
    mask = np.ones_like(combined)
    counts = np.asarray(
        confusion_counts(
            labels, predictions, combined, mask, num_groups=len(group_keys), num_classes=num_classes
        )
    )
    result = attribute_fairness(counts)
    n = result.group_n
    small = (n > 0) & (n < min_group_size)
    entry: dict[str, Any] = {m: float(getattr(result, m)) for m in METRIC_NAMES}
    entry["groups"] = {
        group_keys[g]: {"n": int(n[g]), "accuracy": float(result.group_accuracy[g])}
        for g in np.flatnonzero(n > 0)
    }
    entry["empty_groups"] = [group_keys[g] for g in result.empty_groups]
    entry["min_group_size"] = int(min_group_size)
    entry["small_groups"] = [group_keys[g] for g in np.flatnonzero(small)]
    kept = int(np.count_nonzero((n > 0) & ~small))
    # Zeroing a small group's counts makes it empty, which every metric already leaves out. With
    # fewer than two groups left nothing is compared: null, not the "no disparity" 1.0 / 0.0.
    without = (
        _metrics(np.where(small[:, None, None], 0.0, counts))
        if kept >= 2
        else dict.fromkeys(METRIC_NAMES)
    )
    entry["without_small_groups"] = {**without, "num_groups": kept}
    report[SEPARATOR.join(names)] = entry
  return report
