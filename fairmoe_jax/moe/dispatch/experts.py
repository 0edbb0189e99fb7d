"""The stacked weights of a layer's experts, as the dispatch algorithms take them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@jax.custom_jvp
def gelu_exact(x: jax.Array) -> jax.Array:
  """The exact (erf) GELU, `jax.nn.gelu(x, approximate=False)`, with its derivative spelled out.

  The values are jax's own. The derivative is the one jax <= 0.10 derives for that function,
  op for op, so the gradients are bit-identical there. jax 0.11+ differentiates `erfc`
  through `lax.polynomial` with literal coefficients, which `jax.shard_map(check_vma=True)`
  rejects ("Primitive polynomial requires varying manual axes to match") when `x` varies
  over a mesh axis, as the expert-parallel layer's tokens do (docs/design.md, "The exact
  GELU under shard_map").
  """
  return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
  # gelu(x) = 0.5 x erfc(u), u = -x / sqrt(2), and erfc'(u) = -2 / sqrt(pi) exp(-u^2). The
  # ops and their order are those of jax's own JVP of `jax.nn.gelu` (jax 0.10), so that the
  # transposed (reverse-mode) rule is too.
  (x,), (x_dot,) = primals, tangents
  sqrt_half = np.sqrt(0.5).astype(x.dtype)
  u = -x * sqrt_half
  u_dot = -x_dot * sqrt_half
  erfc_u = jax.lax.erfc(u)
  half_x = 0.5 * x
  erfc_slope = np.array(-2.0 / np.sqrt(np.pi), x.dtype)
  erfc_dot = erfc_slope * (u_dot * jnp.exp(-jnp.square(u)))
  y = (half_x * erfc_u).astype(x.dtype)
  y_dot = ((0.5 * x_dot) * erfc_u + half_x * erfc_dot).astype(x.dtype)
  return y, y_dot


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
    h = gelu_exact(h)
    return add_bias(jnp.einsum("...enh,ehd->...end", h, w.w2), self.b2[:, None, :])

  def apply_expert_major(self, x: jax.Array) -> jax.Array:
    """Applies expert e to x[e]: [E, *rows, D] -> [E, *rows, D], any number of row axes.

    `apply`'s values on rows laid out as the caller has them, e.g. `moe_einsum`'s
    [E, G, C, D] buffers, which would need a relayout to become [E, G * C, D] on a TPU when C
    is not a multiple of its row tile.
    """
    w = self.cast(x.dtype)
    rows = (1,) * (x.ndim - 2)  # The biases broadcast over the row axes.
    h = jnp.einsum("e...d,edh->e...h", x, w.w1)
    h = gelu_exact(add_bias(h, self.b1.reshape(self.num_experts, *rows, -1)))
    y = jnp.einsum("e...h,ehd->e...d", h, w.w2)
    return add_bias(y, self.b2.reshape(self.num_experts, *rows, -1))


def add_bias(h: jax.Array, bias: jax.Array) -> jax.Array:
  """h + bias in h.dtype, the bias (broadcastable to h) given in its own dtype (float32).

  The bias is broadcast (or gathered, by the caller) before the cast to h.dtype, so that its
  gradient, a sum over every token, accumulates in the bias' dtype and not in a bfloat16
  compute dtype; the values are those of `h + bias.astype(h.dtype)`.
  """
  return h + jnp.broadcast_to(bias, h.shape).astype(h.dtype)
