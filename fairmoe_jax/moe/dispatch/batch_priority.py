"""Batch-priority routing (V-MoE, Riquelme et al. 2021, Sec. 4): tokens reordered by routing
confidence around any capacity dispatch that serves earlier tokens first, so overflow drops the
least confident choices instead of a group's last tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch.slots import gather_rows
from fairmoe_jax.moe.routers.base import RouterOutput


def priority_scores(gates: jax.Array, score: str = "max") -> jax.Array:
  """Per-token priority from gates [..., k] -> [...]: "max" (V-MoE's default) or "sum";
  stop-gradiented.
  """
  gates = jax.lax.stop_gradient(gates.astype(jnp.float32))
  if score == "max":
    return gates.max(axis=-1)
  if score == "sum":
    return gates.sum(axis=-1)
  raise ValueError(f"score must be 'max' or 'sum', got {score!r}")


def batch_priority_order(
    router_output: RouterOutput | jax.Array, *, num_groups: int | None = None, score: str = "max"
) -> jax.Array:
  """Permutation serving the highest-priority tokens of each group first.

      order = batch_priority_order(route, num_groups=G)
      idx_s, gates_s = reorder_tokens((expert_index, gates), order)  # [G, S, k]
      dispatch_s, combine_s, stats = dispatch_and_combine_masks(idx_s, gates_s, ...)
      dispatch, combine = restore_token_order((dispatch_s, combine_s), order)

  (or reorder x, run the layer, restore y). With the capacity semantics (top-1 choices first)
  this is exactly V-MoE's BPR.

  Args:
    router_output: a `RouterOutput` or its gates, [G, S, k], or [T, k] with `num_groups`.
    num_groups: G, to split flat [T, k] gates into groups.
    score: "max" or "sum" (`priority_scores`).

  Returns [G, S] int32: order[g, i] is the token served i-th in group g (stable sort).
  """
  gates = router_output.gates if isinstance(router_output, RouterOutput) else router_output
  if gates.ndim == 2:
    if num_groups is None:
      raise ValueError("flat [T, k] gates need num_groups")
    gates = gates.reshape(num_groups, -1, gates.shape[-1])
  if gates.ndim != 3:
    raise ValueError(f"gates must be [G, S, k] or [T, k], got {gates.shape}")
  priority = priority_scores(gates, score)
  return jnp.argsort(-priority, axis=1, stable=True).astype(jnp.int32)


def _take_tokens(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """x [G, S, ...] reindexed along S by the permutations index [G, S] (inverse: theirs), by a
  gather in both passes (`slots.gather_rows`; a gather's VJP would scatter-add)."""
  num_groups, group_size = index.shape
  offset = jnp.arange(num_groups, dtype=jnp.int32)[:, None] * group_size
  rows = x.reshape(num_groups * group_size, -1)
  out = gather_rows(rows, (index + offset).reshape(-1), (inverse + offset).reshape(-1, 1))
  return out.reshape(x.shape)


def reorder_tokens(tree: Any, order: jax.Array) -> Any:
  """Every [G, S, ...] array of `tree` in serving order: out[g, i] = x[g, order[g, i]]."""
  inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
  return jax.tree.map(lambda x: _take_tokens(x, order, inverse), tree)


def restore_token_order(tree: Any, order: jax.Array) -> Any:
  """Inverse of `reorder_tokens`: out[g, order[g, i]] = x[g, i]."""
  inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
  return jax.tree.map(lambda x: _take_tokens(x, inverse, order), tree)
