"""The interface shared by the dispatch algorithms:

    y, stats = algorithm(x, expert_index, gates, experts, capacity=C)

x: [G, S, D] tokens (G groups = examples); expert_index / gates: [G, S, k] (best first);
`experts` an `ExpertWeights`; `stats` a `DispatchStats`.

Capacity semantics (`einsum`, `sort`, expert-parallel `sort`; `dispatch_and_combine_masks` is
the reference): each expert accepts at most C choices per group; all top-1 choices of a group
are served before any top-2 choice, earlier tokens first within a level; a dropped choice
contributes 0. `dense` and `dropless` serve every choice.

Expert matmuls run in x.dtype; gates stay float32 until they weight the outputs (in x.dtype).
"""

from __future__ import annotations

from typing import Callable

import jax

from fairmoe_jax.moe.dispatch.capacity import DispatchStats

DispatchAlgorithm = Callable[..., tuple[jax.Array, DispatchStats]]


def check_inputs(x: jax.Array, expert_index: jax.Array, gates: jax.Array) -> None:
  """Raises ValueError unless x is [G, S, D] and expert_index / gates are [G, S, k]."""
  if x.ndim != 3:
    raise ValueError(f"x must be [groups, tokens, dim], got {x.shape}")
  if expert_index.ndim != 3 or expert_index.shape[:2] != x.shape[:2]:
    raise ValueError(
        f"expert_index must be [groups, tokens, k] for x {x.shape}, got {expert_index.shape}"
    )
  if gates.shape != expert_index.shape:
    raise ValueError(f"gates {gates.shape} and expert_index {expert_index.shape} differ")
