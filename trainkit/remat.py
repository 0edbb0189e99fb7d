"""Rematerialisation of transformer blocks (`model.remat`), in training only: `none`, `dots`
(keeps the linear layers' products) or `block` (keeps only the block's input); docs/design.md
has what each costs.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.nnx as nnx
import jax
import ml_collections

from trainkit.config import require_choice

# Policy name -> `jax.checkpoint` policy, from the most memory kept to the least.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "block": jax.checkpoint_policies.nothing_saveable,
}
REMAT_CHOICES: tuple[str, ...] = tuple(REMAT_POLICIES)
# The policy that keeps the least: a run already at it has nothing more to gain from the key.
MOST_AGGRESSIVE_REMAT = REMAT_CHOICES[-1]


def check_remat(policy: str) -> str:
  """`policy` if it is a known name; a ValueError listing the names otherwise (models)."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat={policy!r}; known: {', '.join(REMAT_CHOICES)}")
  return policy


def validate_remat(config: ml_collections.ConfigDict, key: str = "model.remat") -> str:
  """The config's remat policy; a ConfigError naming `key` and the choices otherwise."""
  return require_choice(config, key, REMAT_CHOICES)


def checkpointed(fn: Callable[..., Any], policy: str) -> Callable[..., Any]:
  """`fn(*args)` under `jax.checkpoint` with the named policy (`fn` itself for "none").

  Only the variables `fn` replaced are written back: `nnx.remat` writes back every one, which
  flax refuses for a model state of the jitted step's trace.
  """
  if check_remat(policy) == "none":
    return fn
  jax_policy = REMAT_POLICIES[policy]

  def call(*args: Any) -> Any:
    is_node = [nnx.graph.is_graph_node(a) for a in args]
    nodes = tuple(a for a, node in zip(args, is_node) if node)
    others = tuple(a for a, node in zip(args, is_node) if not node)
    graphdef, state = nnx.split(nodes)

    def pure(state: nnx.State, others: tuple[Any, ...]) -> tuple[Any, nnx.State]:
      before = {path: _value(v) for path, v in nnx.to_flat_state(state)}
      merged = nnx.merge(graphdef, state)
      inner_nodes, inner_others = iter(merged), iter(others)
      out = fn(*(next(inner_nodes) if node else next(inner_others) for node in is_node))
      changed = [
          (path, v)
          for path, v in nnx.to_flat_state(nnx.state(merged))
          if _value(v) is not before.get(path)
      ]
      return out, nnx.from_flat_state(changed)

    out, changed = jax.checkpoint(pure, policy=jax_policy, prevent_cse=True)(state, others)
    nnx.update(nodes, changed)
    return out

  return call


def _value(variable: nnx.Variable) -> Any:
  """The array a variable holds, as an object (identity tells whether it was replaced)."""
  return jax.tree.leaves(variable)[0]
