"""`dropless` dispatch: grouped matmuls over all choices sorted by expert (MegaBlocks-style).

All G S k choices are sorted by expert and run through two grouped matmuls; capacity is ignored
and nothing is dropped. O(G S k D) memory, no padding beyond one tile.

The grouped matmuls (`matmul=`, `DROPLESS_MATMULS`):

* `ragged_dot`: `jax.lax.ragged_dot`, lowered densely over the experts on CPU and TPU
  (docs/benchmarks.md); on a GPU, tokamax's grouped GEMMs where installed (`grouped_gemm`).
  What runs on CPU and GPU.
* `megablox`: the Pallas TPU kernels of `jax.experimental.pallas.ops.tpu.megablox` (`gmm`,
  `tgmm`, as MaxText), visiting only each expert's row tiles. TPU only (`interpret=True` for tests).
* `auto` (default): `megablox` where the step is lowered for a TPU and the kernels fit
  (`megablox_fits`), else `ragged_dot`; chosen at lowering (`jax.lax.platform_dependent`), so a
  deviceless TPU compile on a CPU host compiles the TPU's kernels (docs/design.md, "Dropless on
  TPU: megablox").
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch import grouped_gemm, spmd
from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, add_bias, gelu_exact
from fairmoe_jax.moe.dispatch.slots import SlotPlan, combine_slots, gather_slots

DROPLESS_MATMULS = ("auto", "ragged_dot", "megablox")

# The TPU's lane width (a block's last dimension is a multiple of it), megablox's default tile.
MEGABLOX_TILE = 128
MAX_ROW_TILE = 512
# VMEM one kernel call's blocks may take: under Mosaic's default 16 MiB on v5e, with room for
# its scratch (17 MiB of blocks fails with CompileTimeScopedVmemOom).
VMEM_BUDGET = 12 * 2**20
MEGABLOX_MODULE = "jax.experimental.pallas.ops.tpu.megablox.gmm"


def _megablox_kernels() -> Any:
  """megablox's `gmm`/`tgmm` module, imported on first use (it loads Pallas' TPU backend)."""
  try:
    kernels = importlib.import_module(MEGABLOX_MODULE)
  except Exception:  # noqa: BLE001  # ImportError, or a Pallas backend that fails to load.
    return None
  return kernels if hasattr(kernels, "gmm") and hasattr(kernels, "tgmm") else None


def row_tile(num_rows: int, num_experts: int = 1) -> int:
  """Rows per tile tm: the power of two at most an expert's mean load, clipped to [128, 512]
  (rows rounded up to 16 if fewer). Larger tiles read the weights fewer times but may compute up
  to E - 1 extra tiles.
  """
  load = max(num_rows / num_experts, 1.0)
  tm = min(max(2 ** int(math.log2(load)), MEGABLOX_TILE), MAX_ROW_TILE)
  return min(tm, -(-num_rows // 16) * 16)


def _width_tile_candidates(width: int) -> list[int]:
  """Tiles of a feature width, largest first: the whole width, then the multiples of 128 dividing
  it (else its gcd with 128, interpret only)."""
  if width <= MEGABLOX_TILE:
    return [width]
  if width % MEGABLOX_TILE:
    return [math.gcd(width, MEGABLOX_TILE)]
  return [t for t in range(width, 0, -MEGABLOX_TILE) if width % t == 0]


def _vmem_bytes(tm: int, tk: int, tn: int) -> int:
  """VMEM of one call's float32 blocks: rows, weights and output double-buffered, accumulator."""
  return 4 * (2 * (tm * tk + tk * tn + tm * tn) + max(tm, tk) * tn)


def width_tiles(tm: int, k: int, n: int) -> tuple[int, int]:
  """(tk, tn) of an [M, k] x [k, n] call, as wide as `VMEM_BUDGET` allows; tk shrinks first
  (`gmm` reads its rows once per column tile, whatever tk).
  """
  ks, ns = _width_tile_candidates(k), _width_tile_candidates(n)
  while _vmem_bytes(tm, ks[0], ns[0]) > VMEM_BUDGET and (len(ks) > 1 or len(ns) > 1):
    if len(ks) > 1:
      ks = ks[1:]
    else:
      ns = ns[1:]
  return ks[0], ns[0]


def megablox_fits(dtype: Any, dim: int, hidden: int) -> bool:
  """Whether `auto` uses megablox on a TPU: float32/bfloat16 tokens, widths <= 128 or k * 128."""
  return jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) and all(
      w <= MEGABLOX_TILE or w % MEGABLOX_TILE == 0 for w in (dim, hidden)
  )


def _tiling(tm: int, k: int, n: int, tiling: tuple[int, int, int] | None) -> tuple[int, int, int]:
  """One kernel call's (tm, tk, tn) for an [M, k] x [k, n] product: `tiling` if given."""
  return tuple(tiling) if tiling is not None else (tm, *width_tiles(tm, k, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def megablox_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    tm: int,
    tiling: tuple[int, int, int] | None,
    interpret: bool,
) -> jax.Array:
  """lhs [M, K] rows grouped by `group_sizes` [E] times rhs [E, K, N] -> [M, N] in lhs.dtype.

  Megablox's `gmm`, M a multiple of `tm`; rows past sum(group_sizes) have undefined outputs.
  The weight gradient (`tgmm`) accumulates in float32 and returns in rhs' dtype; empty groups get
  zero. `tiling` None gives each kernel call its own tiles (`_tiling`).
  """
  return _megablox_matmul_fwd(lhs, rhs, group_sizes, tm, tiling, interpret)[0]


def _kernel(fn: Any, *args: jax.Array, **kwargs: Any) -> jax.Array:
  """A megablox kernel call, also inside `jax.shard_map(check_vma=True)` (`spmd.run_kernel`)."""
  return spmd.run_kernel(
      fn, args, kwargs, fallback="use matmul='ragged_dot' (or 'auto', which does)"
  )


def _megablox_matmul_fwd(lhs, rhs, group_sizes, tm, tiling, interpret):
  kernels = _megablox_kernels()
  w = rhs.astype(lhs.dtype)
  out = _kernel(
      kernels.gmm,
      lhs,
      w,
      group_sizes,
      preferred_element_type=lhs.dtype,
      tiling=_tiling(tm, *w.shape[1:], tiling),
      interpret=interpret,
  )
  # rhs itself is kept for its dtype and mesh axes only (no copy: it is an input).
  return out, (lhs, w, group_sizes, rhs)


def _megablox_matmul_bwd(tm, tiling, interpret, residuals, d_out):
  lhs, w, group_sizes, rhs = residuals
  _, k, n = w.shape
  kernels = _megablox_kernels()
  d_lhs = _kernel(
      kernels.gmm,
      d_out,
      w,
      group_sizes,
      preferred_element_type=lhs.dtype,
      tiling=_tiling(tm, n, k, tiling),
      transpose_rhs=True,
      interpret=interpret,
  )
  d_rhs = _kernel(
      kernels.tgmm,
      lhs.swapaxes(0, 1),
      d_out,
      group_sizes,
      preferred_element_type=jnp.float32,
      tiling=_tiling(tm, k, n, tiling),
      num_actual_groups=w.shape[0],
      interpret=interpret,
  )
  return spmd.typed_like(d_lhs, lhs), spmd.typed_like(d_rhs.astype(rhs.dtype), rhs), None


megablox_matmul.defvjp(_megablox_matmul_fwd, _megablox_matmul_bwd)


@jax.custom_vjp
def _bias_rows(bias: jax.Array, row_expert: jax.Array) -> jax.Array:
  """bias [E, H] of each row's expert -> [N, H]. Its VJP sums each expert's rows by a one-hot
  matmul, not the gather's scatter-add (atomics on a GPU, so reruns would differ)."""
  return bias[row_expert]


def _bias_rows_fwd(bias, row_expert):
  return _bias_rows(bias, row_expert), (bias, row_expert)


def _bias_rows_bwd(residuals, d_rows):
  bias, row_expert = residuals
  one_hot = jax.nn.one_hot(row_expert, bias.shape[0], dtype=d_rows.dtype)
  d_bias = jnp.einsum("...e,...h->eh", one_hot, d_rows, preferred_element_type=jnp.float32)
  return spmd.typed_like(d_bias.astype(bias.dtype), bias), None


_bias_rows.defvjp(_bias_rows_fwd, _bias_rows_bwd)


def _ragged_dot_mlp(
    rows: jax.Array, group_sizes: jax.Array, row_expert: jax.Array, experts: ExpertWeights
) -> jax.Array:
  """The expert MLP of expert-sorted rows [N, D] (or [G, N, D], each group sorted apart, with
  group_sizes [G, E]) by `_ragged_dot`, in rows.dtype."""
  # Biases gathered in float32 (`add_bias`): their gradients accumulate in float32.
  h = add_bias(ragged_matmul(rows, experts.w1, group_sizes), _bias_rows(experts.b1, row_expert))
  h = gelu_exact(h)
  return add_bias(ragged_matmul(h, experts.w2, group_sizes), _bias_rows(experts.b2, row_expert))


# The weight gradient of a ragged_dot: rows [N, K] and output cotangents [N, M], contracted over
# N, which is ragged (split into the experts' groups): [E, K, M].
_RAGGED_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _row_experts(group_sizes: jax.Array, num_rows: int, dtype: Any) -> jax.Array:
  """[G, M, E] one-hot expert of each row of G groups of expert-sorted rows (sizes [G, E])."""
  end = jnp.cumsum(group_sizes, axis=-1)[:, None, :]
  row = jnp.arange(num_rows)[None, :, None]
  return ((row >= end - group_sizes[:, None, :]) & (row < end)).astype(dtype)


def _ragged_dot(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot` of rows [M, K] with group_sizes [E]; of rows [G, M, K] with
  group_sizes [G, E], a one-hot contraction over the experts: what XLA lowers a ragged dot to
  (E times the FLOPs), with a group axis the SPMD partitioner splits. (`ragged_dot_general` with
  a batch dimension broadcasts the weights per group, and libtpu refuses it.)"""
  if rows.ndim == 2:
    return grouped_gemm.ragged_dot(rows, w, group_sizes)
  return jnp.einsum(
      "gme,gmk,ekn->gmn", _row_experts(group_sizes, rows.shape[1], rows.dtype), rows, w
  )


@jax.custom_vjp
def ragged_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`_ragged_dot(rows, w, group_sizes)` with its weight gradient summed in float32."""
  return _ragged_dot(rows, w.astype(rows.dtype), group_sizes)


def _ragged_matmul_fwd(rows, w, group_sizes):
  return ragged_matmul(rows, w, group_sizes), (rows, w, group_sizes)


def _ragged_matmul_bwd(residuals, d_out):
  rows, w, group_sizes = residuals
  d_rows = _ragged_dot(d_out, w.astype(rows.dtype).swapaxes(1, 2), group_sizes)
  if rows.ndim == 2:
    d_w = grouped_gemm.ragged_dot_general(
        rows, d_out, group_sizes, _RAGGED_WEIGHT_GRADIENT, preferred_element_type=jnp.float32
    )
  else:  # Summed over the groups in the contraction, not held per group [G, E, K, N].
    masked = _row_experts(group_sizes, rows.shape[1], rows.dtype)[..., None] * rows[:, :, None]
    d_w = jnp.einsum("gmek,gmn->ekn", masked, d_out, preferred_element_type=jnp.float32)
  return d_rows.astype(rows.dtype), d_w.astype(w.dtype), None


ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def _megablox_mlp(
    rows: jax.Array,
    group_sizes: jax.Array,
    row_expert: jax.Array,
    experts: ExpertWeights,
    tiling: tuple[int, int, int] | None,
    interpret: bool,
) -> jax.Array:
  """`_ragged_dot_mlp` with megablox's kernels, the rows padded to whole row tiles.

  The up to tm - 1 zero padding rows join the last expert's group and are sliced off before the
  combine: zero cotangents, so results are the real rows' exactly.
  """
  num_rows = rows.shape[0]
  tm = tiling[0] if tiling is not None else row_tile(num_rows, experts.num_experts)
  pad = -num_rows % tm
  sizes = group_sizes.at[-1].add(pad)
  rows = jnp.pad(rows, ((0, pad), (0, 0)))
  row_expert = jnp.pad(row_expert, (0, pad), constant_values=experts.num_experts - 1)
  tiling = tuple(tiling) if tiling is not None else None

  def matmul(lhs, rhs):
    return megablox_matmul(lhs, rhs, sizes, tm, tiling, interpret)

  h = gelu_exact(add_bias(matmul(rows, experts.w1), _bias_rows(experts.b1, row_expert)))
  out = add_bias(matmul(h, experts.w2), _bias_rows(experts.b2, row_expert))
  return out[:num_rows]


def _auto_mlp(rows, group_sizes, row_expert, experts, tiling, interpret):
  """megablox when lowered for a TPU (and it fits), `ragged_dot` on every other platform."""
  # An explicit `tiling` is the caller's promise that the widths fit it: only the dtype is read.
  widths = (MEGABLOX_TILE, MEGABLOX_TILE) if tiling is not None else experts.w1.shape[1:]
  if not megablox_fits(rows.dtype, *widths):
    return _ragged_dot_mlp(rows, group_sizes, row_expert, experts)
  if _megablox_kernels() is None or not spmd.kernels_can_run(rows, experts.w1, report=False):
    spmd.report_fallback(
        "dropless",
        f"megablox cannot run in jax {jax.__version__} (no Pallas TPU megablox module, or no "
        "check_vma switch inside shard_map), so on a TPU the experts run jax.lax.ragged_dot, "
        f"lowered densely: {experts.num_experts} times the expert FLOPs",
    )
    return _ragged_dot_mlp(rows, group_sizes, row_expert, experts)
  megablox = functools.partial(_megablox_mlp, tiling=tiling, interpret=interpret)
  # Both branches are traced; only the lowering platform's is lowered and compiled.
  return jax.lax.platform_dependent(
      rows, group_sizes, row_expert, experts, tpu=megablox, default=_ragged_dot_mlp
  )


def _expert_sorted_plan(
    expert_index: jax.Array, num_experts: int
) -> tuple[SlotPlan, jax.Array, jax.Array]:
  """Every choice of [G, S, k] sorted by expert: the `SlotPlan` (row i holds choice
  slot_choice[i], choice c sits in row choice_slot[c]), the [E] group sizes and [N] row experts."""
  top_k = expert_index.shape[-1]
  flat_expert = expert_index.reshape(-1).astype(jnp.int32)
  # Choice i = (t * k + j) belongs to token t = i // k of the flattened [G * S] tokens.
  choice = jnp.arange(flat_expert.size, dtype=jnp.int32)
  sorted_expert, sorted_choice = jax.lax.sort(
      (flat_expert, choice), dimension=0, is_stable=True, num_keys=1
  )
  bounds = jnp.searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  group_sizes = (bounds[1:] - bounds[:-1]).astype(jnp.int32)
  choice_row = (
      jnp.zeros_like(choice).at[sorted_choice].set(choice, unique_indices=True).reshape(-1, top_k)
  )
  return SlotPlan(sorted_choice, choice_row), group_sizes, sorted_expert


def moe_dropless(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
    matmul: str = "auto",
    tiling: tuple[int, int, int] | None = None,
    interpret: bool = False,
    per_group: bool = False,
) -> tuple[jax.Array, DispatchStats]:
  """Sort all choices by expert and run grouped matmuls; nothing is dropped.

  `capacity` is ignored; groups only matter for the stats. `matmul` is one of
  `DROPLESS_MATMULS`; `tiling` (tm, tk, tn, default `row_tile` by `width_tiles` per call) and
  `interpret` (Pallas' interpret mode, for CPU tests) apply to megablox only. `per_group`: each
  group's choices sorted apart and the experts run by `_ragged_dot`'s one-hot contraction with a
  group axis, which the SPMD partitioner splits (the layer's choice where no mesh is known)."""
  del capacity
  if matmul not in DROPLESS_MATMULS:
    raise ValueError(f"matmul={matmul!r}; known: {', '.join(DROPLESS_MATMULS)}")
  if matmul == "megablox" and per_group:
    raise ValueError("matmul='megablox' sorts all groups' choices together: per_group=False")
  if matmul == "megablox" and _megablox_kernels() is None:
    raise ImportError(
        "matmul='megablox' needs jax.experimental.pallas.ops.tpu.megablox, which this jax "
        f"({jax.__version__}) does not provide; use matmul='ragged_dot'"
    )
  check_inputs(x, expert_index, gates)
  stats = dropless_stats(expert_index, experts.num_experts)
  if per_group:
    plan, group_sizes, row_expert = jax.vmap(
        lambda index: _expert_sorted_plan(index[None], experts.num_experts)
    )(expert_index)
    out = _ragged_dot_mlp(jax.vmap(gather_slots)(x, plan), group_sizes, row_expert, experts)
    return jax.vmap(combine_slots)(out, gates, plan), stats
  plan, group_sizes, row_expert = _expert_sorted_plan(expert_index, experts.num_experts)
  # Gathers both ways (`slots`): no scatter-add, so the sums are the same on every rerun.
  x_sorted = gather_slots(x.reshape(-1, x.shape[-1]), plan)
  if matmul == "ragged_dot":
    out = _ragged_dot_mlp(x_sorted, group_sizes, row_expert, experts)
  elif matmul == "megablox":
    out = _megablox_mlp(x_sorted, group_sizes, row_expert, experts, tiling, interpret)
  else:
    out = _auto_mlp(x_sorted, group_sizes, row_expert, experts, tiling, interpret)
  y = combine_slots(out, gates.reshape(-1, expert_index.shape[-1]), plan)
  return y.reshape(x.shape), stats
