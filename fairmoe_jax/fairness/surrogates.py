"""Differentiable batch surrogates of the fairness metric Psi (the L_Psi term of paper Sec. 4).

PQD and DP are computed from hard predictions, which have no gradient. On a
batch we replace them by smooth spreads over the groups of each attribute,
summed over attributes as Eq. 3 writes L_Psi = sum_i Psi(s_i):

* "pqd": per group, the soft accuracy = mean over its examples of the predicted
  probability of the true class; the loss is max_g - min_g (0 when all groups
  are equally well served; PQD = min/max of the hard accuracies is 1 then).
* "dp": per group, the mean predicted class distribution; the loss is the
  largest over classes of max_g - min_g (0 at demographic parity).

Groups absent from the batch (and examples whose attribute is missing, -1, or
whose `mask` is 0) are excluded, as in the evaluation metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

PSI_SURROGATES = ("pqd", "dp")
# What `fair.psi` may name: one surrogate, or both trained together ("pqd+dp", the default
# rule: docs/design.md, "One L_Psi rule"), each term with its own lambda.
PSI_RULES = ("pqd", "dp", "pqd+dp")


def psi_terms(rule: str) -> tuple[str, ...]:
  """The surrogates a `fair.psi` rule trains: "pqd+dp" -> ("pqd", "dp")."""
  if rule not in PSI_RULES:
    raise ValueError(f"psi={rule!r}; known: {', '.join(PSI_RULES)}")
  return tuple(rule.split("+"))


def review_metric(rule: str) -> str:
  """The single-attribute fairness SF_a that FEM watches under a rule: PQD, the paper's
  headline metric, whenever the rule trains it; DP otherwise."""
  return "pqd" if "pqd" in psi_terms(rule) else "dp"


def _group_means(
    values: jax.Array, groups: jax.Array, weights: jax.Array, num_groups: int
) -> tuple[jax.Array, jax.Array]:
  """Weighted per-group means of values [B, C] -> ([G, C] means, [G] present flags)."""
  one_hot = jax.nn.one_hot(groups, num_groups, dtype=jnp.float32) * weights[:, None]  # -1 -> 0
  counts = one_hot.sum(0)
  means = (one_hot.T @ values) / jnp.maximum(counts, 1e-9)[:, None]
  return means, counts > 0


def _spread(means: jax.Array, present: jax.Array) -> jax.Array:
  """max_g - min_g over present groups, per column; 0 with fewer than two groups."""
  high = jnp.max(jnp.where(present[:, None], means, -jnp.inf), axis=0)
  low = jnp.min(jnp.where(present[:, None], means, jnp.inf), axis=0)
  return jnp.where(jnp.sum(present) >= 2, high - low, 0.0)


def fairness_surrogate(
    logits: jax.Array,
    labels: jax.Array,
    attributes: jax.Array,
    group_sizes: Sequence[int],
    psi: str = "pqd",
    mask: jax.Array | None = None,
    attribute_indices: Sequence[int] | None = None,
) -> jax.Array:
  """Sum over attributes of the group spread of `psi` (Eq. 3; see module docstring).

  Args:
    logits: [B, K] class logits.
    labels: [B] int target classes.
    attributes: [B, m] int groups, -1 = missing.
    group_sizes: G_i per attribute.
    mask: [B] example weights (0 for padding); default all ones.
    attribute_indices: attributes to include (default all).
  """
  if psi not in PSI_SURROGATES:
    raise ValueError(f"psi={psi!r}; known: {', '.join(PSI_SURROGATES)}")
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights = jnp.ones(labels.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
  # PQD reads the label's probability [B, 1]; the others every class's [B, K].
  values = jnp.take_along_axis(probs, labels[:, None], axis=-1) if psi == "pqd" else probs
  indices = range(len(group_sizes)) if attribute_indices is None else attribute_indices
  spreads = []
  for i in indices:
    means, present = _group_means(values, attributes[:, i], weights, group_sizes[i])
    spreads.append(jnp.max(_spread(means, present)))
  return jnp.sum(jnp.stack(spreads))
