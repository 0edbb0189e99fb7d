"""Rematerialisation of transformer blocks (`model.remat`): memory for recomputation.

A train step keeps, for its backward pass, the activations its forward pass computed (the
residuals): at a large batch they are most of a step's memory. `jax.checkpoint` around a block
keeps fewer of them and recomputes the others in the backward pass, inside that block only.
Which ones are kept is a named policy:

  none   no checkpoint: every residual is kept (the program of a model without the option).
  dots   keeps the results of matrix products without batch dimensions (the linear layers:
         qkv, attention projection, MLP or router matmuls) and recomputes the rest: layer
         norms, activations, softmax, the attention-score products (which have batch
         dimensions) and what an MoE dispatch sorts, gathers or scatters.
         (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`)
  block  keeps nothing inside a block but its input: the backward pass reruns the block's
         forward pass first (`jax.checkpoint_policies.nothing_saveable`). The least memory and
         the most recomputation: less than a whole forward pass, as a product whose result the
         backward pass does not read (a branch's last projection) is not rerun. A train step's
         FLOPs grow by 22-25% for the paper's Swin runs compiled for one H100, against the
         third a whole forward pass would add (docs/scaling.md).

Only the train mode is checkpointed (`train=True`): an evaluation has no backward pass, and a
decoding step keeps a cache that a checkpoint must not replay. A block's outputs (its MoE
auxiliaries, attention probabilities a loss reads) are outputs of the checkpointed function and
so are kept whatever the policy. docs/design.md, "Rematerialisation (`model.remat`)".
"""

from __future__ import annotations

from typing import Any, Callable

import flax.nnx as nnx
import jax
import ml_collections

from trainkit.config import require_choice

# Policy name -> `jax.checkpoint` policy (None: no checkpoint). Ordered from the most memory to
# the least: a message that suggests more remat suggests the ones after the config's.
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

  The NNX objects among `args` (the module, an `nnx.Rngs`) go in as their state and come back
  updated, so dropout draws the same keys in the forward pass and its recomputation and the
  caller's `Rngs` advances as without the checkpoint. The other arguments (arrays, pytrees of
  them, None) are the checkpoint's inputs as they are.

  Why not `nnx.remat`: it writes the state back into every variable of the caller's objects,
  and a train step's model state (FairSMoE's expert assignment) belongs to the jitted step's
  trace, not to the differentiated loss's: flax refuses ("Cannot mutate ExpertAssignment from a
  different trace level"). Here only the variables `fn` replaced are written back, after the
  checkpoint returns, in the caller's trace.
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
      # Only what `fn` changed goes back (an Rngs' counts): the caller may hold variables it
      # cannot write in this trace, such as a model state that is not differentiated.
      changed = [
          (path, v) for path, v in nnx.to_flat_state(nnx.state(merged))
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
