"""The statistics behind every results table (docs/protocol.md, section 3): a cell's mean and its
95% Student-t interval over seeds; a claim decided on the paired differences of the same seeds;
for folds whose training sets overlap, Nadeau and Bengio's corrected resampled t-interval
(Machine Learning 52, 2003); the p-value that goes with either interval; Holm's adjustment."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from scipy import stats as scipy_stats

CONFIDENCE = 0.95
MIN_VERDICT_SEEDS = 5  # Paired seeds a verdict rests on (3 are enough for a context row).
# Sample sizes under which a table flags its split or a group (docs/protocol.md).
MIN_SPLIT_EXAMPLES = 500
MIN_GROUP_EXAMPLES = 50

POWER = 0.8  # Of the smallest difference an undecided verdict's table could detect.
HOLDS, DOES_NOT_HOLD, UNDECIDED = "holds", "does not hold", "undecided"
# A claim whose rows do not lie above what a reader without a model scores (a constant, a coin
# flip, the source copied): docs/protocol.md, section 3.
UNTESTABLE = "untestable: at reference"
DIRECTIONS = ("higher", "lower")


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of `n` values and its two-sided Student-t interval (None below two values)."""

  mean: float
  low: float | None
  high: float | None
  n: int


def _mean_se(
    values: Sequence[float], test_to_train: float | None
) -> tuple[float, float | None, int]:
  """The mean, its standard error sd · sqrt(1/n + test_to_train) (sd: ddof=1; None for one
  value) and n."""
  values = [float(v) for v in values]
  n = len(values)
  mean = math.fsum(values) / n
  if n < 2:
    return mean, None, n
  sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
  return mean, sd * math.sqrt(1.0 / n + (test_to_train or 0.0)), n


def interval(values: Sequence[float], test_to_train: float | None = None) -> Interval:
  """mean ± t_{n-1} · se (no bounds for one value)."""
  mean, se, n = _mean_se(values, test_to_train)
  if se is None:
    return Interval(mean, None, None, n)
  half = float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * se
  return Interval(mean, mean - half, mean + half, n)


def p_value(values: Sequence[float], test_to_train: float | None = None) -> float:
  """Two-sided p-value of "the mean is 0": p < 1 - CONFIDENCE exactly when `interval` excludes 0."""
  mean, se, n = _mean_se(values, test_to_train)
  if se is None:
    return 1.0
  if se == 0.0:
    return 1.0 if mean == 0.0 else 0.0
  return float(2.0 * scipy_stats.t.sf(abs(mean) / se, n - 1))


def holm(p_values: Sequence[float | None]) -> list[float | None]:
  """Holm's step-down adjusted p-values of one family (None: untested, still counted in m)."""
  m = len(p_values)
  tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
  adjusted: list[float | None] = [None] * m
  running = 0.0
  for rank, (p, i) in enumerate(tested):
    running = max(running, min(1.0, (m - rank) * p))
    adjusted[i] = running
  return adjusted


def verdict_at(mean: float, p: float, better: str) -> str:
  """The verdict a (possibly Holm-adjusted) p-value gives a mean difference: without adjustment,
  "undecided" exactly when the difference's interval contains 0."""
  if p >= 1.0 - CONFIDENCE or mean == 0.0:
    return UNDECIDED
  return HOLDS if (mean > 0.0) == (better == "higher") else DOES_NOT_HOLD


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  """A claim decided: the paired seeds, the mean difference's interval, the verdict, p and the
  smallest difference detectable at `POWER` (None below two pairs)."""

  seeds: list[int]
  difference: Interval | None
  verdict: str
  enough_seeds: bool
  p: float = 1.0
  detectable: float | None = None
  tested_mean: float = 0.0  # The mean difference moved by a margin (0 without a difference).


def decide(
    row: Mapping[int, float],
    baseline: Mapping[int, float],
    better: str,
    test_to_train: float | None = None,
    margin: float = 0.0,
) -> ClaimResult:
  """Decides one claim on the seeds both rows have; with `test_to_train`, the corrected interval;
  with a `margin`, as non-inferiority: "not worse by more than the margin" (the differences moved
  by it towards `better`)."""
  seeds = sorted(set(row) & set(baseline))
  differences = [float(row[s]) - float(baseline[s]) for s in seeds]
  if not differences:
    return ClaimResult([], None, UNDECIDED, False)
  shift = margin if better == "higher" else -margin
  moved = [d + shift for d in differences]
  p = p_value(moved, test_to_train)
  _, se, n = _mean_se(differences, test_to_train)
  # (t_{1-alpha/2} + t_{power}) se: the paired t-test's minimum detectable difference.
  t = lambda q: float(scipy_stats.t.ppf(q, n - 1))  # noqa: E731
  detectable = None if se is None else (t(0.5 + CONFIDENCE / 2) + t(POWER)) * se
  tested = math.fsum(moved) / n
  enough, verdict = len(seeds) >= MIN_VERDICT_SEEDS, verdict_at(tested, p, better)
  difference = interval(differences, test_to_train)
  return ClaimResult(seeds, difference, verdict, enough, p, detectable, tested)
