"""Fairness-driven expert management (FEM, paper Sec. 5.3): which experts serve which
attribute class, and the dynamic allocation that grows or shrinks each attribute's
share between evaluations.

An assignment is a 0/1 float32 array [sum_i G_i, E]: row `offset_i + c` lists the
experts assigned to class c of attribute i. Attribute i has `counts[i]` experts per
class; class c of attribute i gets experts

    (offset_i + c * counts[i] + j) mod E,   j = 0 .. counts[i] - 1,

so with one expert per class consecutive classes (over all attributes) get
consecutive experts, spreading the attributes over the experts ("each expert
focuses on a unique set of attributes" as far as E allows), and growing an
attribute gives each of its classes one more expert.

Allocation (run on the host after each validation pass; the paper's Algorithm 2
is not in the text we have, this is our reading, see docs/design.md):

* attribute i grows (counts[i] += 1, up to max(1, E // G_i)) when its validation
  single-attribute fairness SF_i has held or improved (within `tolerance`) for
  `patience` consecutive evaluations;
* at the next evaluation after a growth, if the validation loss is worse than
  when the growth was decided, the growth is undone.

The allocator state is a dict of small arrays kept in `TrainState.extra["fem"]`, so
it is checkpointed with the run.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses

import numpy as np

from fairmoe_jax.moe.fair_router import class_offsets


def max_counts(group_sizes: Sequence[int], num_experts: int) -> np.ndarray:
  """Largest experts-per-class of each attribute that keeps its classes on distinct experts."""
  return np.maximum(1, num_experts // np.asarray(group_sizes)).astype(np.int32)


def initial_assignment(
    group_sizes: Sequence[int], num_experts: int, counts: Sequence[int] | None = None
) -> np.ndarray:
  """[sum G_i, E] 0/1 float32 assignment for `counts[i]` experts per class (default 1)."""
  counts = np.ones(len(group_sizes), np.int32) if counts is None else np.asarray(counts)
  assignment = np.zeros((sum(group_sizes), num_experts), np.float32)
  for i, (offset, size) in enumerate(zip(class_offsets(group_sizes), group_sizes)):
    for c in range(size):
      for j in range(int(counts[i])):
        assignment[offset + c, (offset + c * counts[i] + j) % num_experts] = 1.0
  return assignment


def initial_state(num_attributes: int) -> dict[str, np.ndarray]:
  return {
      "counts": np.ones(num_attributes, np.int32),
      "streak": np.zeros(num_attributes, np.int32),
      "last_sf": np.full(num_attributes, np.nan, np.float32),
      "growth_loss": np.full(num_attributes, np.nan, np.float32),
  }


@dataclasses.dataclass(frozen=True)
class ExpertAllocator:
  """The dynamic allocation rule (module docstring) as a pure function of its state.

  Attributes:
    group_sizes: G_i per attribute.
    num_experts: E.
    patience: n, evaluations SF_i must hold or improve before a growth.
    tolerance: a drop of SF_i up to this much still counts as "held".
  """

  group_sizes: tuple[int, ...]
  num_experts: int
  patience: int = 2
  tolerance: float = 0.0

  def update(
      self, state: dict[str, np.ndarray], sf: Sequence[float], val_loss: float
  ) -> tuple[dict[str, np.ndarray], list[str]]:
    """One evaluation: returns the new state and the events ("grow"/"shrink" attribute i).

    Args:
      state: from `initial_state` or a previous update.
      sf: validation SF_i per attribute, higher is fairer (e.g. PQD, or -DP).
      val_loss: validation loss.
    """
    state = {k: np.array(v) for k, v in state.items()}
    limits = max_counts(self.group_sizes, self.num_experts)
    events = []
    for i, sf_i in enumerate(sf):
      if np.isfinite(state["growth_loss"][i]):  # Judge the last growth.
        if val_loss > state["growth_loss"][i]:
          state["counts"][i] -= 1
          state["streak"][i] = 0
          events.append(f"shrink {i}")
        state["growth_loss"][i] = np.nan
      last = state["last_sf"][i]
      held = np.isfinite(last) and sf_i >= last - self.tolerance
      state["streak"][i] = state["streak"][i] + 1 if held else 0
      state["last_sf"][i] = sf_i
      if state["streak"][i] >= self.patience and state["counts"][i] < limits[i]:
        state["counts"][i] += 1
        state["streak"][i] = 0
        state["growth_loss"][i] = val_loss
        events.append(f"grow {i}")
    return state, events

  def assignment(self, state: dict[str, np.ndarray]) -> np.ndarray:
    return initial_assignment(self.group_sizes, self.num_experts, state["counts"])
