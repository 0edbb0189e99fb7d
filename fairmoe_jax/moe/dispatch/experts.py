"""The stacked weights of a layer's experts, as the dispatch algorithms take them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class ExpertWeights:
  """Stacked weights of E GELU-MLP experts.

  Attributes:
    w1: [E, D, H] first-layer kernels.
    b1: [E, H] first-layer biases.
    w2: [E, H, D] second-layer kernels.
    b2: [E, D] second-layer biases.
  """

  w1: jax.Array
  b1: jax.Array
  w2: jax.Array
  b2: jax.Array

  @classmethod
  def from_module(cls, module: Any) -> "ExpertWeights":
    """Reads `w1, b1, w2, b2` from a module with those attributes (e.g. `SparseMoE`)."""
    return cls(*(getattr(module, name)[...] for name in ("w1", "b1", "w2", "b2")))

  @property
  def num_experts(self) -> int:
    return self.w1.shape[0]

  def cast(self, dtype: Any) -> "ExpertWeights":
    """The weights in the compute dtype."""
    return jax.tree.map(lambda w: w.astype(dtype), self)

  def apply(self, x: jax.Array) -> jax.Array:
    """Applies expert e to row e of x: [..., E, N, D] -> [..., E, N, D].

    Computed in x.dtype, with the exact (erf) GELU of timm's ViT MLP.
    """
    w = self.cast(x.dtype)
    h = add_bias(jnp.einsum("...end,edh->...enh", x, w.w1), self.b1[:, None, :])
    h = jax.nn.gelu(h, approximate=False)
    return add_bias(jnp.einsum("...enh,ehd->...end", h, w.w2), self.b2[:, None, :])


def add_bias(h: jax.Array, bias: jax.Array) -> jax.Array:
  """h + bias in h.dtype, the bias (broadcastable to h) given in its own dtype (float32).

  The bias is broadcast (or gathered, by the caller) before the cast to h.dtype, so that its
  gradient, a sum over every token, accumulates in the bias' dtype and not in a bfloat16
  compute dtype; the values are those of `h + bias.astype(h.dtype)`.
  """
  return h + jnp.broadcast_to(bias, h.shape).astype(h.dtype)
