"""Linear top-k routing (paper Eq. 5), the default router of `SparseMoE`."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from fairmoe_jax.moe.routers.base import (
    RouterOutput,
    check_top_k,
    float32_gate,
    route_from_logits,
)


class TopKRouter(nnx.Module):
  """Linear top-k router: R(x) = Top-K(softmax(x W)) (paper Eq. 5).

  The bias-free gate runs in float32 whatever the layer's dtype: routing and the z-loss are
  sensitive to logit precision (ST-MoE, Sec. 3).
  """

  def __init__(self, dim: int, num_experts: int, top_k: int, *, rngs: nnx.Rngs):
    check_top_k(top_k, num_experts)
    self.num_experts = num_experts
    self.top_k = top_k
    self.gate = float32_gate(dim, num_experts, rngs=rngs)

  def logits(self, x: jax.Array) -> jax.Array:
    """[T, D] tokens -> [T, E] float32 logits."""
    return self.gate(x.astype(jnp.float32))

  def __call__(
      self,
      x: jax.Array,
      *,
      train: bool = False,
      rngs: nnx.Rngs | None = None,
      context: Mapping[str, jax.Array] | None = None,
  ) -> RouterOutput:
    """Routes tokens x: [T, D]; deterministic and context-free (router protocol args)."""
    del train, rngs, context
    return route_from_logits(self.logits(x), self.top_k)
