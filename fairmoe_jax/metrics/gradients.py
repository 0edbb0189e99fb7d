"""Gradient conflict between attribute tasks at the MoE layers (paper Fig. 6).

For attribute i the "task" loss is the fairness surrogate restricted to that
attribute; its gradient with respect to the parameters of every SparseMoE block
is compared, per batch, with every other attribute's by cosine similarity.
Values near 1 mean the attribute tasks pull the MoE the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from fairmoe_jax.data.augment import normalize_on_device
from fairmoe_jax.fairness.surrogates import fairness_surrogate
from fairmoe_jax.moe.layer import SparseMoE


def moe_paths(model: nnx.Module) -> list[tuple[Any, ...]]:
  """Graph paths of the model's SparseMoE blocks."""
  return [path for path, node in nnx.iter_graph(model) if isinstance(node, SparseMoE)]


def split_moe_weights(
    graphdef: nnx.GraphDef, params: nnx.State, model_state: nnx.State
) -> tuple[nnx.State, nnx.State] | None:
  """(the SparseMoE blocks' weights, every other weight), or None without MoE blocks."""
  prefixes = moe_paths(nnx.merge(graphdef, params, model_state))
  if not prefixes:
    return None

  def in_moe(path, _):
    return any(tuple(path[: len(p)]) == tuple(p) for p in prefixes)

  return nnx.split_state(params, in_moe, ...)


def batch_cosines_fn(
    graphdef: nnx.GraphDef, group_sizes: Sequence[int], psi: str
) -> Callable[..., jax.Array]:
  """The jitted (moe_params, other_params, model_state, batch) -> [pairs] cosines of one batch."""
  pairs = list(itertools.combinations(range(len(group_sizes)), 2))

  @jax.jit
  def batch_cosines(moe_params, other_params, model_state, batch):
    def task_losses(moe_params):  # [m]: one forward pass for every attribute's task.
      model = nnx.merge(graphdef, moe_params, other_params, model_state)
      images = normalize_on_device(batch["image"], batch["mask"])
      logits, _ = model(images, train=False, context={"attributes": batch["attributes"]})
      return jnp.stack(
          [
              fairness_surrogate(
                  logits,
                  batch["label"],
                  batch["attributes"],
                  group_sizes,
                  psi,
                  mask=batch["mask"],
                  attribute_indices=(i,),
              )
              for i in range(len(group_sizes))
          ]
      )

    # Each task's gradient with respect to the MoE parameters only, one [m, ...] leaf per weight:
    # one forward and one backward batched over the tasks, not a pass per task. Their [m, m] Gram
    # matrix is summed leaf by leaf, so expert-sharded leaves are reduced where they lie.
    jacobian = jax.jacrev(task_losses)(moe_params)
    gram = sum(
        jnp.einsum("mp,np->mn", x, x, precision=jax.lax.Precision.HIGHEST)
        for x in (leaf.reshape(len(group_sizes), -1) for leaf in jax.tree.leaves(jacobian))
    )
    norms = jnp.sqrt(jnp.diagonal(gram))
    cosines = gram / jnp.maximum(norms[:, None] * norms[None, :], 1e-12)
    return jnp.stack([cosines[a, b] for a, b in pairs])

  return batch_cosines


def gradient_cosines(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    model_state: nnx.State,
    batches: Iterable[dict[str, jax.Array]],
    *,
    attribute_names: Sequence[str],
    group_sizes: Sequence[int],
    psi: str,
) -> dict[str, list[float]]:
  """{"a|b": [cosine per batch]} for every pair of attributes; {} without MoE blocks."""
  split = split_moe_weights(graphdef, params, model_state)
  if split is None or len(group_sizes) < 2:
    return {}
  batch_cosines = batch_cosines_fn(graphdef, group_sizes, psi)
  per_batch = [np.asarray(batch_cosines(*split, model_state, b)) for b in batches]
  if not per_batch:
    return {}
  values = np.stack(per_batch)
  pairs = itertools.combinations(range(len(group_sizes)), 2)
  return {
      f"{attribute_names[a]}|{attribute_names[b]}": values[:, n].round(6).tolist()
      for n, (a, b) in enumerate(pairs)
  }
