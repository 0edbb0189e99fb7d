"""The interface shared by the dispatch algorithms.

Every algorithm maps routing decisions and the stacked expert weights straight
to the layer output:

    y, stats = algorithm(x, expert_index, gates, experts, capacity=C)

with x: [G, S, D] tokens (G groups = examples, S tokens per group),
expert_index / gates: [G, S, k] routing decisions (best choice first),
`experts` an `ExpertWeights` and `stats` a `DispatchStats`.

The capacity algorithms (`einsum`, `sort` and the expert-parallel version of
`sort`) share the semantics of `dispatch_and_combine_masks`: each expert accepts
at most C choices per group; all top-1 choices of a group are served before any
top-2 choice, and within one priority level earlier tokens come first; a dropped
choice contributes 0 to the output. `dense` and `dropless` ignore the capacity
and serve every choice.

All algorithms compute the expert matmuls in x.dtype (the weights are cast to it)
and keep gates in float32 until they weight the expert outputs, which are
returned in x.dtype.
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
