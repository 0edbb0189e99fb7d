"""Fairness-driven expert management (FEM, paper Sec. 5.3): which experts serve which
sensitive attribute, and the dynamic allocation that grows or shrinks each attribute's share.

The paper assigns experts to *attributes*: "we strategically assign each expert to focus on
unique sets of sensitive attributes"; S_e is "the set of attributes assigned to expert e".
An assignment is therefore a 0/1 float32 array [m, E] (attribute x expert): row a lists the
experts whose S_e contains a. Attribute a holds `counts[a]` experts, taken in the order

    (a + j * m) mod E,   j = 0 .. counts[a] - 1,

so with one expert each the attributes start on distinct experts (where E >= m), and growing
an attribute first takes experts no other attribute holds yet.

`class_assignment` derives a class-level [sum G_i, E] assignment from it for the
`class_routing` reading of Eq. 8 (each class of attribute a gets the experts of a round-robin).

Allocation (Algorithm 2 is in the appendix we do not have; this is our reading of the text,
see docs/design.md). At every review, on the validation split:

* attribute a grows (counts[a] += 1, up to E) when its single-attribute fairness SF_a has held
  or improved (within `tolerance`) for `patience` consecutive reviews ("if SF_i remains stable
  or improves over n iterations, we consider increasing the number of experts");
* at the next review after a growth, the growth is undone if the validation loss is worse than
  when the growth was decided ("if adding more experts results in a worse validation loss than
  previously observed ... a reduction").

The allocator state is a dict of small arrays kept in `TrainState.extra["fem"]`, so it is
checkpointed with the run. `make_expert_manager` is the review hook the training loop calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from fairmoe_jax.fairness.surrogates import review_metric

ALLOCATION_PREFIX = "fem/experts/"  # metrics.jsonl key of each attribute's expert count.
SHARE_PREFIX = "fem/share/"  # metrics.jsonl key of each expert's share of validation choices.
# A change of an expert's share of the routing choices larger than this (one point) counts as
# "usage changed" after a FEM change.
USAGE_CHANGE = 0.01


class ExpertAssignment(nnx.Variable):
  """[m, E] float32 0/1 in a router's state: which experts hold which attribute (S_e by columns)."""


def attribute_assignment(
    num_attributes: int, num_experts: int, counts: Sequence[int] | None = None
) -> np.ndarray:
  """[m, E] 0/1 float32: attribute a holds experts (a + j m) mod E for j < counts[a] (default 1)."""
  counts = np.ones(num_attributes, np.int32) if counts is None else np.asarray(counts)
  assignment = np.zeros((num_attributes, num_experts), np.float32)
  for a in range(num_attributes):
    for j in range(int(counts[a])):
      assignment[a, (a + j * num_attributes) % num_experts] = 1.0
  return assignment


def class_offsets(group_sizes: Sequence[int]) -> np.ndarray:
  """Row of the first class of each attribute in a stacked [sum G_i, ...] array."""
  return np.concatenate([[0], np.cumsum(group_sizes)[:-1]]).astype(np.int32)


def class_assignment(attribute_rows: np.ndarray, group_sizes: Sequence[int]) -> np.ndarray:
  """[sum G_i, E]: class c of attribute a gets the experts of a whose rank is c modulo their number.

  With at least G_a experts, a's classes get disjoint subsets; with fewer they share. Works on
  numpy or jax arrays.
  """
  xp = jnp if isinstance(attribute_rows, jax.Array) else np
  rows = []
  for a, size in enumerate(group_sizes):
    held = attribute_rows[a]  # [E] 0/1
    rank = xp.cumsum(held) - 1  # rank of each held expert among a's experts
    count = xp.maximum(held.sum(), 1)
    for c in range(size):
      rows.append(held * ((rank % count) == (c % count)))
  return xp.stack(rows).astype(xp.float32)


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
    num_attributes: m.
    num_experts: E, also the most experts an attribute can hold.
    patience: n, reviews SF_a must hold or improve before a growth.
    tolerance: a drop of SF_a up to this much still counts as "stable".
  """

  num_attributes: int
  num_experts: int
  patience: int = 2
  tolerance: float = 0.01

  def update(
      self, state: dict[str, np.ndarray], sf: Sequence[float], val_loss: float
  ) -> tuple[dict[str, np.ndarray], list[tuple[str, int]]]:
    """One review: returns the new state and the events, ("grow" | "shrink", attribute).

    `sf` is the validation SF_a per attribute, higher is fairer (e.g. PQD, or -DP).
    """
    state = {k: np.array(v) for k, v in state.items()}
    events = []
    for a, sf_a in enumerate(sf):
      if np.isfinite(state["growth_loss"][a]):  # Judge the last growth.
        if val_loss > state["growth_loss"][a]:
          state["counts"][a] -= 1
          state["streak"][a] = 0
          events.append(("shrink", a))
        state["growth_loss"][a] = np.nan
      last = state["last_sf"][a]
      held = np.isfinite(last) and sf_a >= last - self.tolerance
      state["streak"][a] = state["streak"][a] + 1 if held else 0
      state["last_sf"][a] = sf_a
      if state["streak"][a] >= self.patience and state["counts"][a] < self.num_experts:
        state["counts"][a] += 1
        state["streak"][a] = 0
        state["growth_loss"][a] = val_loss
        events.append(("grow", a))
    return state, events

  def assignment(self, state: dict[str, np.ndarray]) -> np.ndarray:
    return attribute_assignment(self.num_attributes, self.num_experts, state["counts"])


def set_assignment(model: nnx.Module, assignment: np.ndarray) -> int:
  """Writes an [m, E] assignment into every router that holds one; returns how many."""
  written = 0
  for _, node in nnx.iter_graph(model):
    if isinstance(getattr(node, "assignment", None), ExpertAssignment):
      node.assignment.set_value(jnp.asarray(assignment))
      written += 1
  return written


def make_expert_manager(
    *,
    attribute_names: Sequence[str],
    num_experts: int,
    patience: int,
    tolerance: float,
    psi: str,
    validate: Callable[[Any], dict[str, Any]],
    write_assignment: Callable[[Any, dict[str, np.ndarray], np.ndarray], Any],
) -> Callable[[Any], tuple[Any, dict[str, float]]]:
  """The FEM review hook, `review(state) -> (state, scalars, lines)`: the lines say what changed.

  Args:
    psi: the `fair.psi` rule; the review watches its `review_metric` (PQD when the rule
      trains PQD) as the single-attribute fairness SF_a.
    validate: state -> validation report (fairness_report layout plus "loss").
    write_assignment: (state, allocator state, [m, E] assignment) -> state with the assignment
      in every router and the allocator state in `extra["fem"]`; it must keep shapes and
      shardings, so the train step is not recompiled.
  """
  allocator = ExpertAllocator(len(attribute_names), num_experts, patience, tolerance)
  metric = review_metric(psi)
  sign = 1.0 if metric == "pqd" else -1.0

  def review(state):
    report = validate(state)
    sf = [sign * report["attributes"][name][metric] for name in attribute_names]
    fem = jax.tree.map(np.asarray, jax.device_get(state.extra["fem"]))
    fem, events = allocator.update(fem, sf, report["loss"])
    state = write_assignment(state, fem, allocator.assignment(fem))
    changes = [
        f"expert management: {kind} {attribute_names[a]} to {fem['counts'][a]} experts"
        for kind, a in events
    ]
    scalars = {f"{ALLOCATION_PREFIX}{n}": float(c) for n, c in zip(attribute_names, fem["counts"])}
    scalars["fem/review_loss"] = float(report["loss"])
    # Each expert's share of the validation choices (mean over MoE blocks), measured before
    # this review's change: the next review's shares say whether the change reached routing.
    shares = list(report.get("expert_share", {}).get("choices", {}).values())
    if shares:
      scalars.update(
          {f"{SHARE_PREFIX}{e}": float(v) for e, v in enumerate(np.mean(shares, axis=0))}
      )
    scalars.update({f"fem/sf/{n}": float(s) for n, s in zip(attribute_names, sf)})
    return state, scalars, changes

  return review


def allocation_history(
    metrics: Sequence[dict[str, Any]], attribute_names: Sequence[str]
) -> list[dict[str, Any]]:
  """`[{"step", "experts": {attribute: count}}]`, one entry per review logged in metrics.jsonl."""
  history = []
  for record in metrics:
    keys = [f"{ALLOCATION_PREFIX}{n}" for n in attribute_names]
    if all(k in record for k in keys):
      history.append(
          {
              "step": int(record["step"]),
              "experts": {n: int(record[k]) for n, k in zip(attribute_names, keys)},
          }
      )
  return history


def allocation_changes(
    metrics: Sequence[dict[str, Any]],
    attribute_names: Sequence[str],
    num_experts: int,
    final_share: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
  """Every FEM change logged in metrics.jsonl, and whether routing followed it.

  Returns one entry per (review, attribute) whose expert count changed: the step, the
  attribute, "grow" or "shrink", the experts it gained or lost, their share of the validation
  routing choices when the change was decided ("share_before") and at the next review (or in
  `final_share`, the run's last validation pass, after the last review): "share_after" (None
  when neither exists), and "usage_changed" (|after - before| > USAGE_CHANGE).
  """
  reviews = [r for r in metrics if all(f"{ALLOCATION_PREFIX}{n}" in r for n in attribute_names)]

  def share(record):
    values = [record.get(f"{SHARE_PREFIX}{e}") for e in range(num_experts)]
    return None if any(v is None for v in values) else np.asarray(values, np.float64)

  m = len(attribute_names)
  previous = np.ones(m, np.int32)
  changes = []
  for i, record in enumerate(reviews):
    counts = np.asarray([int(record[f"{ALLOCATION_PREFIX}{n}"]) for n in attribute_names])
    before = share(record)
    if i + 1 < len(reviews):
      after = share(reviews[i + 1])
    else:
      after = None if final_share is None else np.asarray(final_share, np.float64)
    old_rows = attribute_assignment(m, num_experts, previous)
    new_rows = attribute_assignment(m, num_experts, counts)
    for a, name in enumerate(attribute_names):
      if counts[a] == previous[a]:
        continue
      experts = np.flatnonzero(old_rows[a] != new_rows[a]).tolist()
      entry = {
          "step": int(record["step"]),
          "attribute": name,
          "change": "grow" if counts[a] > previous[a] else "shrink",
          "experts": experts,
          "share_before": None if before is None else float(before[experts].sum()),
          "share_after": None if after is None else float(after[experts].sum()),
      }
      if entry["share_before"] is not None and entry["share_after"] is not None:
        entry["usage_changed"] = bool(
            abs(entry["share_after"] - entry["share_before"]) > USAGE_CHANGE
        )
      changes.append(entry)
    previous = counts
  return changes
