"""Batch-priority routing (V-MoE, Riquelme et al. 2021, Sec. 4).

`batch_priority_order` / `reorder_tokens` / `restore_token_order` wrap any
capacity dispatch that serves earlier tokens first (such as
`dispatch_and_combine_masks` or the `einsum` and `sort` algorithms): tokens are
served in decreasing order of routing confidence, so capacity overflow drops the
least confident choices instead of the last tokens of a group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.routers.base import RouterOutput


def priority_scores(gates: jax.Array, score: str = "max") -> jax.Array:
  """Per-token priority from its gates [..., k] -> [...].

  "max": the largest routing weight (V-MoE's default); "sum": the sum of the k
  routing weights. Gates are stop-gradiented: the order carries no gradient.
  """
  gates = jax.lax.stop_gradient(gates.astype(jnp.float32))
  if score == "max":
    return gates.max(axis=-1)
  if score == "sum":
    return gates.sum(axis=-1)
  raise ValueError(f"score must be 'max' or 'sum', got {score!r}")


def batch_priority_order(
    router_output: RouterOutput | jax.Array,
    *,
    num_groups: int | None = None,
    score: str = "max",
) -> jax.Array:
  """Permutation serving the highest-priority tokens of each group first.

  Batch-priority routing (BPR) lets the capacity-limited dispatch serve tokens
  in decreasing order of priority instead of their position in the sequence,
  so when capacity is short it is the least confident routings that get
  dropped. It composes with any dispatch that serves earlier tokens first:

      order = batch_priority_order(route, num_groups=G)
      idx_s, gates_s = reorder_tokens((expert_index, gates), order)  # [G, S, k]
      dispatch_s, combine_s, stats = dispatch_and_combine_masks(idx_s, gates_s, ...)
      dispatch, combine = restore_token_order((dispatch_s, combine_s), order)

  after which `dispatch` / `combine` index tokens in their original order and
  are used with the original x as usual. (Equivalently, reorder x, run the whole
  layer, and restore the order of y.) With `dispatch_and_combine_masks`, which
  serves all top-1 choices of a group before any top-2 choice, this is exactly
  V-MoE's BPR: choice j of all tokens by priority, then choice j + 1.

  Args:
    router_output: a `RouterOutput` (its `gates` are used) or a gates array, of
      shape [G, S, k], or [T, k] with `num_groups` given (T = G * S).
    num_groups: G, needed to split flat [T, k] gates into groups.
    score: "max" or "sum", see `priority_scores`.

  Returns:
    order: [G, S] int32; order[g, i] is the index of the token served i-th in
    group g. Sorting is stable, so equal priorities keep sequence order.
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


def _take_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [G, S, ...] reindexed along S by index [G, S]."""
  return jax.vmap(lambda xg, ig: xg[ig])(x, index)


def reorder_tokens(tree: Any, order: jax.Array) -> Any:
  """Sorts every [G, S, ...] array of a pytree by `order` along the token axis.

  out[g, i] = x[g, order[g, i]], i.e. tokens in serving (priority) order.
  """
  return jax.tree.map(lambda x: _take_tokens(x, order), tree)


def restore_token_order(tree: Any, order: jax.Array) -> Any:
  """Inverse of `reorder_tokens`: out[g, order[g, i]] = x[g, i]."""
  inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
  return jax.tree.map(lambda x: _take_tokens(x, inverse), tree)
