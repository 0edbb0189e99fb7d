"""Gradient conflict between attribute tasks at the MoE layers (paper Fig. 6).

For attribute i the "task" loss is the fairness surrogate restricted to that
attribute; its gradient with respect to the parameters of every SparseMoE block
is compared, per batch, with every other attribute's by cosine similarity.
Values near 1 mean the attribute tasks pull the MoE the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
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


def _cosine(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> jax.Array:
  dot = sum(jnp.vdot(x, y) for x, y in zip(a, b))
  norm_a = jnp.sqrt(sum(jnp.vdot(x, x) for x in a))
  norm_b = jnp.sqrt(sum(jnp.vdot(y, y) for y in b))
  return dot / jnp.maximum(norm_a * norm_b, 1e-12)


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
  prefixes = moe_paths(nnx.merge(graphdef, params, model_state))
  if not prefixes or len(group_sizes) < 2:
    return {}

  def in_moe(path, _):
    return any(tuple(path[: len(p)]) == tuple(p) for p in prefixes)

  pairs = list(itertools.combinations(range(len(group_sizes)), 2))

  @jax.jit
  def batch_cosines(params, batch):
    def task_loss(p, i):
      model = nnx.merge(graphdef, p, model_state)
      images = normalize_on_device(batch["image"], batch["mask"])
      logits, _ = model(images, train=False, context={"attributes": batch["attributes"]})
      return fairness_surrogate(
          logits,
          batch["label"],
          batch["attributes"],
          group_sizes,
          psi,
          mask=batch["mask"],
          attribute_indices=(i,),
      )

    grads = []
    for i in range(len(group_sizes)):
      g = jax.grad(task_loss)(params, i)
      leaves = [(path, getattr(x, "get_value", lambda: x)()) for path, x in nnx.to_flat_state(g)]
      grads.append([x for path, x in leaves if in_moe(path, x)])
    return jnp.stack([_cosine(grads[a], grads[b]) for a, b in pairs])

  per_batch = [np.asarray(batch_cosines(params, b)) for b in batches]
  if not per_batch:
    return {}
  values = np.stack(per_batch)
  return {
      f"{attribute_names[a]}|{attribute_names[b]}": values[:, n].round(6).tolist()
      for n, (a, b) in enumerate(pairs)
  }
