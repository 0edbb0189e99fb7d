"""The expert MLP as one Pallas TPU kernel per pass, the hidden activation never in memory.

`ExpertWeights.apply_expert_major` leaves the MLP to XLA, which runs one matmul per fusion: the
hidden activation h [E, rows, H] is written by the first matmul and read back by the second, and
the backward pass reads it twice more and writes and reads dh, so seven H-wide floats cross
memory per row against six D-wide ones (`benchmarks/dispatch_levers.expert_mlp_traffic_floor`).
With H = 4 D that is most of the MLP's traffic. These kernels keep h in the core's vector memory:

* forward, one grid step per (expert, row block): y = GELU(x W1 + b1) W2 + b2;
* backward, the same grid: h is recomputed from x, then dx, and dW1, db1, dW2, db2 summed over
  the expert's row blocks in float32.

Per row, x and y cross memory forward and x, dy and dx backward (5 D floats). Each expert's
weights are read once per pass and its gradients written once: the row blocks of an expert are
consecutive grid steps that keep the same weight block, which the Pallas pipeline does not copy
again. The cost the kernels pass to `pallas_call` (what XLA's TPU cost analysis counts for them)
is that traffic, computed from the blocks; the FLOPs count the recomputed first matmul.

Values: the matmuls run in x.dtype with float32 accumulation, the biases, GELU and every
gradient sum in float32, results cast to x.dtype. So in float32 they are the XLA path's up to
rounding, and in bfloat16 they round h and GELU(h) once less than it does. TPU only:
`interpret=True` runs them anywhere, slowly (tests). `fused_expert_mlp` lowers the kernels for
a TPU and the XLA path on every other platform; `moe_einsum_fused`, the dispatch `einsum_fused`,
is `moe_einsum` with this MLP.
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

# The kernels' footprint in vector memory is kept small on purpose. Compiled deviceless for a
# v5e-16 within FairSMoE's whole DeiT-S train step, the step's bytes accessed grow with the
# scoped VMEM the kernels ask for (it is taken from what XLA's memory-space assignment has for
# the rest of the program): 1.496e10 per device with 512-row blocks and double-buffered weights,
# 1.486e10 with 128-row blocks, 1.474e10 with 128-row blocks and one buffer per weight (`einsum`:
# 1.488e10). So: 128 rows per grid step at most (a multiple of the TPU's 8-row tile), and one
# buffer for each expert's weight blocks, which also fits DeiT-S's experts in a v4's 16 MiB.
# One buffer means an expert's weights load when its first row block starts, not during the
# previous expert's (each load waits: 4.7 MB of float32 DeiT-S weights forward, about 6 us on a
# v5e): a cost in time the compiler's cost analysis does not show; a TPU run would weigh it.
MAX_ROW_BLOCK = 128
WEIGHT_BUFFERS = 1
# Bytes of the float32 [rows, H] intermediates of a backward step (h, GELU(h), its slope, dh)
# at most: the row block shrinks for experts wider than any paper config's (H > 8192).
HIDDEN_BLOCK_BYTES = 16 * 2**20
# The most vector memory any TPU core has (v5e, v6e): the scoped limit never asks for more.
VMEM_CAPACITY_MAX = 128 * 2**20
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def row_block(rows: int, hidden: int) -> int:
  """Rows per grid step for `rows` rows per expert of hidden width `hidden`: the largest
  multiple of 8 that divides `rows` and is at most the cap (MAX_ROW_BLOCK, and
  HIDDEN_BLOCK_BYTES for the step's four float32 [rows, H] intermediates), or (no such divisor)
  `rows` rounded up to a multiple of 8 and capped, the rows then padded with zeros to a
  multiple of it."""
  cap = max(8, min(MAX_ROW_BLOCK, HIDDEN_BLOCK_BYTES // (16 * hidden)) // 8 * 8)
  for block in range(min(cap, rows - rows % 8), 7, -8):
    if rows % block == 0:
      return block
  return min(cap, -(-rows // 8) * 8)


def vmem_bytes(
    rows_block: int, dim: int, hidden: int, itemsize: int, weight_buffers: int = 1
) -> int:
  """Vector memory the backward step needs (the larger pass): its row blocks, double-buffered
  by the Pallas pipeline (x, dy, dx), its expert's blocks in `weight_buffers` buffers (W1, b1,
  W2 and the four float32 gradients), and the float32 intermediates of its body ([rows, H]: h,
  GELU(h), the slope, dh; [rows, D]: dx)."""
  rows = 2 * 3 * rows_block * dim * itemsize
  expert = weight_buffers * 4 * (4 * dim * hidden + 2 * hidden + dim)
  return rows + expert + 4 * rows_block * (4 * hidden + dim)


def _squeezed():
  # jax 0.12 names a dropped block dimension `pl.Squeezed()`; earlier jax takes None.
  return pl.Squeezed() if hasattr(pl, "Squeezed") else None


def _gelu_and_slope(h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The exact GELU of h and its derivative, in float32: Phi(h) h and Phi(h) + h phi(h).

  Phi is written with erf, which Mosaic lowers, not with erfc as `experts.gelu_exact` is: the
  two differ by float32 rounding (absolute, near 1e-7 of Phi), where Phi is tiny."""
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


def _backward_kernel(x_ref, dy_ref, w1_ref, b1_ref, w2_ref, dx_ref, dw1_ref, db1_ref, dw2_ref,
                     db2_ref):
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
  squeezed = _squeezed()
  rows_spec = pl.BlockSpec((squeezed, block, dim), lambda e, r: (e, r, 0))
  mode = {} if buffers == 2 else {"pipeline_mode": pl.Buffered(buffers)}

  def per_expert(*shape):
    return pl.BlockSpec((squeezed, *shape), lambda e, r: (e,) + (0,) * len(shape), **mode)

  vmem = vmem_bytes(block, dim, hidden, x.dtype.itemsize, buffers)
  return (num_experts, rows // block), rows_spec, per_expert, _compiler_params(semantics, vmem)


def _compiler_params(semantics: tuple[str, str], vmem: int):
  # The scoped limit the kernel asks Mosaic for: its need and a margin for Mosaic's own
  # temporaries. One expert's weights must fit in a core's vector memory (a v5e's 128 MiB holds
  # Swin-B's last stage, a v4's 16 MiB DeiT-S's); where they do not, the TPU compile fails, in
  # the preflight (`--mode=compile`) before any run.
  limit = min(int(vmem * 1.25) + 8 * 2**20, VMEM_CAPACITY_MAX)
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


def _weight_bytes(num_experts: int, dim: int, hidden: int) -> int:
  return 4 * num_experts * (2 * dim * hidden + hidden + dim)  # Float32 kernels and biases.


def forward_cost(num_experts: int, rows: int, dim: int, hidden: int, itemsize: int):
  """The forward kernel's FLOPs, transcendentals (erf) and HBM bytes (x read, y written, the
  weights read once per expert)."""
  return pl.CostEstimate(
      flops=4 * num_experts * rows * dim * hidden,
      transcendentals=num_experts * rows * hidden,
      bytes_accessed=2 * itemsize * num_experts * rows * dim + _weight_bytes(num_experts, dim, hidden),
  )


def backward_cost(num_experts: int, rows: int, dim: int, hidden: int, itemsize: int):
  """The backward kernel's: five matmuls (h recomputed, dh, dx, dW1, dW2), erf and exp; x and
  dy read and dx written; W1, b1, W2 read and all four gradients written once per expert."""
  read = 4 * num_experts * (2 * dim * hidden + hidden)
  return pl.CostEstimate(
      flops=10 * num_experts * rows * dim * hidden,
      transcendentals=2 * num_experts * rows * hidden,
      bytes_accessed=(3 * itemsize * num_experts * rows * dim + read
                      + _weight_bytes(num_experts, dim, hidden)),
  )


def _forward(x: jax.Array, experts: ExpertWeights, interpret: bool) -> jax.Array:
  num_experts, rows, dim = x.shape
  hidden = experts.w1.shape[-1]
  grid, rows_spec, per_expert, params = _layout(x, hidden, ("parallel", "parallel"))
  call = pl.pallas_call(
      _forward_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=grid,
      in_specs=[rows_spec, per_expert(dim, hidden), per_expert(1, hidden),
                per_expert(hidden, dim), per_expert(1, dim)],
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
      in_specs=[rows_spec, rows_spec, per_expert(dim, hidden), per_expert(1, hidden),
                per_expert(hidden, dim)],
      out_specs=(rows_spec, per_expert(dim, hidden), per_expert(1, hidden),
                 per_expert(hidden, dim), per_expert(1, dim)),
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

  The row axes are merged (a relayout on a TPU where the last one is not a multiple of 8) and
  padded with zero rows to a whole number of row blocks; the padding's outputs are sliced off,
  so its cotangents are zero and it adds nothing to any gradient.
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
  if not spmd.kernels_can_run(x, *jax.tree.leaves(experts)):
    return experts.apply_expert_major(x)  # Inside shard_map on a jax that cannot type them.
  if interpret:
    return fused_expert_mlp_kernels(x, experts, interpret=True)
  platform_dependent = getattr(jax.lax, "platform_dependent", None)
  if platform_dependent is None:  # A jax without it: the platform JAX runs on.
    if jax.default_backend() == "tpu":
      return fused_expert_mlp_kernels(x, experts)
    return experts.apply_expert_major(x)
  # Both branches are traced; only the lowering platform's is lowered and compiled.
  return platform_dependent(
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
) -> tuple[jax.Array, DispatchStats]:
  """`moe_einsum` with the expert MLP in the Pallas kernels on a TPU (`moe_einsum`'s XLA MLP on
  every other platform; `interpret`: Pallas' interpret mode, for CPU tests): the dispatch
  `moe.dispatch=einsum_fused`."""
  mlp = functools.partial(fused_expert_mlp, interpret=interpret)
  return moe_einsum(x, expert_index, gates, experts, capacity=capacity, expert_mlp=mlp)
