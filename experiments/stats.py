"""The statistics behind every results table: intervals per cell, paired differences, verdicts.

A cell is the mean over seeds with its 95% Student-t interval. A claim ("row is higher than
baseline on metric") is decided on the differences between the two rows' runs of the *same*
seed (same initialisation and data order), so that what the seeds share cancels:

  holds          the interval of the mean paired difference lies entirely on the claimed side
  does not hold  it lies entirely on the other side
  undecided      it contains 0 (or fewer than two pairs exist)

The verdict is the statistics' alone; `MIN_VERDICT_SEEDS` is the protocol's number of pairs a
verdict must rest on (docs/protocol.md), and a claim with fewer is flagged, not re-decided.
"""

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

HOLDS, DOES_NOT_HOLD, UNDECIDED = "holds", "does not hold", "undecided"
DIRECTIONS = ("higher", "lower")


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of `n` values and its two-sided Student-t interval (None below two values)."""

  mean: float
  low: float | None
  high: float | None
  n: int

  def contains(self, value: float) -> bool:
    return self.low is None or self.low <= value <= self.high


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
  """Mean and `confidence` interval of the mean, mean ± t_{n-1} · s / sqrt(n) (s: ddof=1)."""
  values = [float(v) for v in values]
  n = len(values)
  if n == 0:
    raise ValueError("no values to summarise")
  mean = math.fsum(values) / n
  if n < 2:
    return Interval(mean, None, None, n)
  sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
  half = float(scipy_stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
  return Interval(mean, mean - half, mean + half, n)


def format_interval(
    mean: float,
    low: float | None,
    high: float | None,
    *,
    scale: float = 1.0,
    decimals: int = 3,
    sign: bool = False,
) -> str:
  """`mean [low, high]` scaled and rounded (`mean` alone without an interval); `sign` writes
  the mean's sign always (for differences)."""
  text = f"{scale * mean:{'+' if sign else ''}.{decimals}f}"
  if low is None:
    return text
  return f"{text} [{scale * low:.{decimals}f}, {scale * high:.{decimals}f}]"


def paired(
    row: Mapping[int, float], baseline: Mapping[int, float]
) -> tuple[list[int], list[float]]:
  """(seeds both have, row - baseline per such seed), in seed order."""
  seeds = sorted(set(row) & set(baseline))
  return seeds, [float(row[s]) - float(baseline[s]) for s in seeds]


def verdict(difference: Interval, better: str) -> str:
  """The verdict on "row is `better` (higher/lower) than its baseline" from the interval of
  the mean paired difference row - baseline."""
  if better not in DIRECTIONS:
    raise ValueError(f"better must be one of {DIRECTIONS}, got {better!r}")
  if difference.low is None or difference.low <= 0.0 <= difference.high:
    return UNDECIDED
  above = difference.low > 0.0
  return HOLDS if above == (better == "higher") else DOES_NOT_HOLD


@dataclasses.dataclass(frozen=True)
class ClaimResult:
  """A claim decided: the paired seeds, the interval of the mean difference and the verdict."""

  seeds: list[int]
  difference: Interval | None
  verdict: str
  enough_seeds: bool


def decide(
    row: Mapping[int, float],
    baseline: Mapping[int, float],
    better: str,
    *,
    confidence: float = CONFIDENCE,
    min_seeds: int = MIN_VERDICT_SEEDS,
) -> ClaimResult:
  """Decides one claim from each row's value per seed (only seeds both rows have count)."""
  seeds, differences = paired(row, baseline)
  if not differences:
    return ClaimResult([], None, UNDECIDED, False)
  interval = t_interval(differences, confidence)
  return ClaimResult(seeds, interval, verdict(interval, better), len(seeds) >= min_seeds)
