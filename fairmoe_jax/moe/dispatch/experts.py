"""The stacked weights of a layer's experts, as the dispatch algorithms take them."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@jax.custom_jvp
def gelu_exact(x: jax.Array) -> jax.Array:
  """The exact (erf) GELU, `jax.nn.gelu(x, approximate=False)`, with its derivative spelled out.

  The derivative is jax 0.10's, op for op (bit-identical gradients there); jax 0.11+'s goes
  through `lax.polynomial`, which `shard_map(check_vma=True)` rejects on varying `x`
  (docs/design.md, "The exact GELU under shard_map").
  """
  return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
  # gelu(x) = 0.5 x erfc(u), u = -x / sqrt(2), erfc'(u) = -2 / sqrt(pi) exp(-u^2), in jax 0.10's
  # op order.
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
    """Expert e on row e of x: [..., E, N, D] -> same, in x.dtype (exact GELU, as timm's ViT)."""
    h = expert_matmul("rows_last", x, self.w1)
    h = gelu_exact(add_bias(h, self.b1[:, None, :]))
    return add_bias(expert_matmul("rows_last", h, self.w2), self.b2[:, None, :])

  def apply_expert_major(self, x: jax.Array) -> jax.Array:
    """Expert e on x[e]: [E, *rows, D] -> same: `apply`'s values without merging row axes
    (e.g. `moe_einsum`'s [E, G, C, D], a relayout on TPU).
    """
    rows = (1,) * (x.ndim - 2)  # The biases broadcast over the row axes.
    h = expert_matmul("expert_major", x, self.w1)
    h = gelu_exact(add_bias(h, self.b1.reshape(self.num_experts, *rows, -1)))
    y = expert_matmul("expert_major", h, self.w2)
    return add_bias(y, self.b2.reshape(self.num_experts, *rows, -1))


# (forward, input gradient, weight gradient) of x @ w[e] per expert e, for the two layouts of
# the rows: "rows_last" [..., E, N, K] and "expert_major" [E, *rows, K]; w is [E, K, M].
_MATMUL_SPECS = {
    "rows_last": ("...enk,ekm->...enm", "...enm,ekm->...enk", "...enk,...enm->ekm"),
    "expert_major": ("e...k,ekm->e...m", "e...m,ekm->e...k", "e...k,e...m->ekm"),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def expert_matmul(layout: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w[e] for each expert e, in x.dtype, with the weight gradient summed in float32.

  Left to autodiff, the weight gradient is a bfloat16 matmul whose accumulation is the backend's
  choice (jax 0.11+'s CPU compiler sums in bfloat16 partials: twice the error,
  tests/fairmoe_jax/test_moe_algorithms.py); this VJP asks for float32 and returns the weights' dtype.
  """
  forward, _, _ = _MATMUL_SPECS[layout]
  return jnp.einsum(forward, x, w.astype(x.dtype))


def _expert_matmul_forward(layout, x, w):
  return expert_matmul(layout, x, w), (x, w)


def _expert_matmul_backward(layout, residuals, d_y):
  x, w = residuals
  _, input_spec, weight_spec = _MATMUL_SPECS[layout]
  d_x = jnp.einsum(input_spec, d_y, w.astype(x.dtype))
  d_w = jnp.einsum(weight_spec, x, d_y, preferred_element_type=jnp.float32)
  return d_x.astype(x.dtype), d_w.astype(w.dtype)


expert_matmul.defvjp(_expert_matmul_forward, _expert_matmul_backward)


def add_bias(h: jax.Array, bias: jax.Array) -> jax.Array:
  """h + bias in h.dtype, the bias broadcast before the cast, so that its gradient (a sum over
  every token) accumulates in the bias' dtype (float32), not bfloat16.
  """
  return h + jnp.broadcast_to(bias, h.shape).astype(h.dtype)
