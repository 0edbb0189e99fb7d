"""The expert MLP as one Pallas TPU kernel per pass, the hidden activation never in memory.

XLA runs the expert MLP one matmul per fusion, so h [E, rows, H] crosses memory seven times per
row. These kernels keep h in vector memory: forward, y = GELU(x W1 + b1) W2 + b2 per (expert,
row block); backward, h recomputed, then dx, and the four weight gradients summed over the
expert's row blocks in float32. Each expert's weights are read once per pass; the cost passed to
`pallas_call` is that traffic. Matmuls in x.dtype with float32 accumulation; biases, GELU and
gradient sums in float32. TPU only (`interpret=True` for tests); `fused_expert_mlp` lowers XLA's
MLP on other platforms, and `moe_einsum_fused` is the dispatch `einsum_fused`. Why, values and
figures: docs/design.md, "The fused expert MLP on TPU".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.capacity import DispatchStats
from fairmoe_jax.moe.dispatch.einsum import moe_einsum
from fairmoe_jax.moe.dispatch.experts import ExpertWeights

# Where a jax cannot type the kernels' outputs inside shard_map (`spmd.run_kernel`).
_FALLBACK = "use moe.dispatch=einsum"

# Small on purpose: the kernels' scoped VMEM is taken from the rest of the train step
# (docs/design.md, "The fused expert MLP on TPU", "Vector memory, kept small").
MAX_ROW_BLOCK = 128
WEIGHT_BUFFERS = 1
# Cap on a backward step's float32 [rows, H] intermediates (binds only for H > 8192).
HIDDEN_BLOCK_BYTES = 16 * 2**20
# The most vector memory any TPU core has (v5e, v6e): the scoped limit never asks for more.
VMEM_CAPACITY_MAX = 128 * 2**20
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def row_block(rows: int, hidden: int) -> int:
  """Rows per grid step: the largest multiple of 8 dividing `rows` under the cap (MAX_ROW_BLOCK,
  HIDDEN_BLOCK_BYTES for four float32 [rows, H] intermediates), else `rows` rounded up to 8 and
  capped (the rows then zero-padded).
  """
  cap = max(8, min(MAX_ROW_BLOCK, HIDDEN_BLOCK_BYTES // (16 * hidden)) // 8 * 8)
  for block in range(min(cap, rows - rows % 8), 7, -8):
    if rows % block == 0:
      return block
  return min(cap, -(-rows // 8) * 8)


def vmem_bytes(
    rows_block: int, dim: int, hidden: int, itemsize: int, weight_buffers: int = 1
) -> int:
  """Vector memory of the backward step (the larger pass): row blocks double-buffered (x, dy,
  dx), the expert's blocks in `weight_buffers` buffers (W1, b1, W2, four float32 gradients) and
  the float32 intermediates ([rows, H] h, GELU(h), slope, dh; [rows, D] dx).
  """
  rows = 2 * 3 * rows_block * dim * itemsize
  expert = weight_buffers * 4 * (4 * dim * hidden + 2 * hidden + dim)
  return rows + expert + 4 * rows_block * (4 * hidden + dim)


def _gelu_and_slope(h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Exact GELU of h and its derivative in float32, with erf (Mosaic lowers no erfc)."""
  cdf = 0.5 + 0.5 * jax.lax.erf(h * _SQRT_HALF)
  return h * cdf, cdf + h * (_INV_SQRT_2PI * jnp.exp(-0.5 * h * h))


def _contract(a: jax.Array, b: jax.Array, dims: tuple[int, int]) -> jax.Array:
  """a and b contracted over a's axis dims[0] and b's dims[1], summed in float32."""
  numbers = (((dims[0],), (dims[1],)), ((), ()))
  return jax.lax.dot_general(a, b, numbers, preferred_element_type=jnp.float32)


def _forward_kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, y_ref):
  x = x_ref[...]
  h = _contract(x, w1_ref[...].astype(x.dtype), (1, 0)) + b1_ref[...]
  a, _ = _gelu_and_slope(h)
  y = _contract(a.astype(x.dtype), w2_ref[...].astype(x.dtype), (1, 0)) + b2_ref[...]
  y_ref[...] = y.astype(y_ref.dtype)


def _backward_kernel(
    x_ref, dy_ref, w1_ref, b1_ref, w2_ref, dx_ref, dw1_ref, db1_ref, dw2_ref, db2_ref
):
  @pl.when(pl.program_id(1) == 0)
  def _():  # The first row block of an expert: its gradient sums start at zero.
    for ref in (dw1_ref, db1_ref, dw2_ref, db2_ref):
      ref[...] = jnp.zeros(ref.shape, ref.dtype)

  x, dy = x_ref[...], dy_ref[...]
  w1 = w1_ref[...].astype(x.dtype)
  h = _contract(x, w1, (1, 0)) + b1_ref[...]
  a, slope = _gelu_and_slope(h)
  dh = _contract(dy, w2_ref[...].astype(x.dtype), (1, 1)) * slope
  dh_c = dh.astype(x.dtype)
  dx_ref[...] = _contract(dh_c, w1, (1, 1)).astype(dx_ref.dtype)
  dw1_ref[...] += _contract(x, dh_c, (0, 0))
  dw2_ref[...] += _contract(a.astype(x.dtype), dy, (0, 0))
  db1_ref[...] += jnp.sum(dh, axis=0, keepdims=True)
  db2_ref[...] += jnp.sum(dy.astype(jnp.float32), axis=0, keepdims=True)


def _layout(x: jax.Array, hidden: int, semantics: tuple[str, str]):
  """The grid (experts, row blocks), the row blocks' spec, a spec maker for expert e's blocks
  (kept across its row blocks, in WEIGHT_BUFFERS buffers) and the compiler parameters."""
  num_experts, rows, dim = x.shape
  block = row_block(rows, hidden)
  buffers = WEIGHT_BUFFERS
  squeezed = pl.Squeezed()  # A dropped block dimension.
  rows_spec = pl.BlockSpec((squeezed, block, dim), lambda e, r: (e, r, 0))
  mode = {} if buffers == 2 else {"pipeline_mode": pl.Buffered(buffers)}

  def per_expert(*shape):
    return pl.BlockSpec((squeezed, *shape), lambda e, r: (e,) + (0,) * len(shape), **mode)

  vmem = vmem_bytes(block, dim, hidden, x.dtype.itemsize, buffers)
  # Need plus a margin for Mosaic's temporaries; an expert too large for a core's VMEM fails
  # the TPU compile (in the preflight, `--mode=compile`).
  limit = min(int(vmem * 1.25) + 8 * 2**20, VMEM_CAPACITY_MAX)
  params = pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)
  return (num_experts, rows // block), rows_spec, per_expert, params


def _weight_bytes(num_experts: int, dim: int, hidden: int) -> int:
  return 4 * num_experts * (2 * dim * hidden + hidden + dim)  # Float32 kernels and biases.


def forward_cost(num_experts: int, rows: int, dim: int, hidden: int, itemsize: int):
  """The forward kernel's FLOPs, erfs and HBM bytes (x, y, the weights once per expert)."""
  return pl.CostEstimate(
      flops=4 * num_experts * rows * dim * hidden,
      transcendentals=num_experts * rows * hidden,
      bytes_accessed=2 * itemsize * num_experts * rows * dim
      + _weight_bytes(num_experts, dim, hidden),
  )


def backward_cost(num_experts: int, rows: int, dim: int, hidden: int, itemsize: int):
  """The backward kernel's: five matmuls (h recomputed, dh, dx, dW1, dW2), erf and exp; x and
  dy read and dx written; W1, b1, W2 read and all four gradients written once per expert."""
  read = 4 * num_experts * (2 * dim * hidden + hidden)
  return pl.CostEstimate(
      flops=10 * num_experts * rows * dim * hidden,
      transcendentals=2 * num_experts * rows * hidden,
      bytes_accessed=(
          3 * itemsize * num_experts * rows * dim + read + _weight_bytes(num_experts, dim, hidden)
      ),
  )


def _forward(x: jax.Array, experts: ExpertWeights, interpret: bool) -> jax.Array:
  num_experts, rows, dim = x.shape
  hidden = experts.w1.shape[-1]
  grid, rows_spec, per_expert, params = _layout(x, hidden, ("parallel", "parallel"))
  call = pl.pallas_call(
      _forward_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=grid,
      in_specs=[
          rows_spec,
          per_expert(dim, hidden),
          per_expert(1, hidden),
          per_expert(hidden, dim),
          per_expert(1, dim),
      ],
      out_specs=rows_spec,
      compiler_params=params,
      cost_estimate=forward_cost(num_experts, rows, dim, hidden, x.dtype.itemsize),
      interpret=interpret,
      name="fused_expert_mlp_forward",
  )
  args = (x, experts.w1, experts.b1[:, None, :], experts.w2, experts.b2[:, None, :])
  return spmd.run_kernel(call, args, {}, fallback=_FALLBACK)


def _backward(x, d_y, experts, interpret):
  num_experts, rows, dim = x.shape
  hidden = experts.w1.shape[-1]
  # The row blocks of an expert accumulate into its gradient blocks: they run in order.
  grid, rows_spec, per_expert, params = _layout(x, hidden, ("parallel", "arbitrary"))
  f32 = jnp.float32
  call = pl.pallas_call(
      _backward_kernel,
      out_shape=(
          jax.ShapeDtypeStruct(x.shape, x.dtype),
          jax.ShapeDtypeStruct((num_experts, dim, hidden), f32),
          jax.ShapeDtypeStruct((num_experts, 1, hidden), f32),
          jax.ShapeDtypeStruct((num_experts, hidden, dim), f32),
          jax.ShapeDtypeStruct((num_experts, 1, dim), f32),
      ),
      grid=grid,
      in_specs=[
          rows_spec,
          rows_spec,
          per_expert(dim, hidden),
          per_expert(1, hidden),
          per_expert(hidden, dim),
      ],
      out_specs=(
          rows_spec,
          per_expert(dim, hidden),
          per_expert(1, hidden),
          per_expert(hidden, dim),
          per_expert(1, dim),
      ),
      compiler_params=params,
      cost_estimate=backward_cost(num_experts, rows, dim, hidden, x.dtype.itemsize),
      interpret=interpret,
      name="fused_expert_mlp_backward",
  )
  args = (x, d_y, experts.w1, experts.b1[:, None, :], experts.w2)
  d_x, d_w1, d_b1, d_w2, d_b2 = spmd.run_kernel(call, args, {}, fallback=_FALLBACK)
  grads = ExpertWeights(w1=d_w1, b1=d_b1[:, 0], w2=d_w2, b2=d_b2[:, 0])
  grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, experts)
  # Inside shard_map: replicated weights get the sum of every device's gradient.
  return spmd.typed_like(d_x, x), spmd.typed_like(grads, experts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fused_rows(x: jax.Array, experts: ExpertWeights, interpret: bool) -> jax.Array:
  return _forward(x, experts, interpret)


def _fused_rows_fwd(x, experts, interpret):
  return _forward(x, experts, interpret), (x, experts)


def _fused_rows_bwd(interpret, residuals, d_y):
  x, experts = residuals
  return _backward(x, d_y.astype(x.dtype), experts, interpret)


_fused_rows.defvjp(_fused_rows_fwd, _fused_rows_bwd)


def fused_expert_mlp_kernels(
    x: jax.Array, experts: ExpertWeights, *, interpret: bool = False
) -> jax.Array:
  """`experts.apply_expert_major(x)` by the Pallas kernels: [E, *rows, D] -> [E, *rows, D].

  Row axes are merged and zero-padded to whole row blocks; the padding is sliced off (zero
  cotangents).
  """
  num_experts, dim = x.shape[0], x.shape[-1]
  rows = int(np.prod(x.shape[1:-1]))
  flat = x.reshape(num_experts, rows, dim)
  pad = -rows % row_block(rows, experts.w1.shape[-1])
  if pad:
    flat = jnp.pad(flat, ((0, 0), (0, pad), (0, 0)))
  y = _fused_rows(flat, experts, interpret)
  return y[:, :rows].reshape(x.shape)


def fused_expert_mlp(x: jax.Array, experts: ExpertWeights, *, interpret: bool = False) -> jax.Array:
  """`experts.apply_expert_major(x)`: the Pallas kernels where lowered for a TPU (or with
  `interpret`), XLA's MLP on every other platform."""
  if not spmd.kernels_can_run(x, *jax.tree.leaves(experts), dispatch="einsum_fused"):
    return experts.apply_expert_major(x)  # Inside shard_map on a jax that cannot type them.
  if interpret:
    return fused_expert_mlp_kernels(x, experts, interpret=True)
  if jax.default_backend() != "tpu":  # A deviceless TPU compile traces here too: said anyway.
    spmd.report_fallback("einsum_fused", "XLA's MLP, no kernel: the einsum dispatch's cost")
  # Both branches are traced; only the lowering platform's is lowered and compiled.
  return jax.lax.platform_dependent(
      x, experts, tpu=fused_expert_mlp_kernels, default=lambda x, w: w.apply_expert_major(x)
  )


def moe_einsum_fused(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
    interpret: bool = False,
    per_group: bool = False,
) -> tuple[jax.Array, DispatchStats]:
  """`moe_einsum` with the expert MLP in the Pallas kernels on a TPU (XLA's elsewhere;
  `interpret` for CPU tests): `moe.dispatch=einsum_fused`. `per_group` (the layer's where no mesh
  is known): XLA's MLP, which the SPMD partitioner splits over a sharded batch (it cannot split
  a Mosaic kernel)."""
  if per_group:
    spmd.report_fallback("einsum_fused", "no mesh: XLA's MLP, the einsum dispatch's cost")
    return moe_einsum(x, expert_index, gates, experts, capacity=capacity)
  mlp = functools.partial(fused_expert_mlp, interpret=interpret)
  return moe_einsum(x, expert_index, gates, experts, capacity=capacity, expert_mlp=mlp)
