r"""The FLOPs `dropless`'s grouped matmuls execute on a Hopper GPU, from the routing's group sizes.

  python benchmarks/grouped_gemm_flops.py     # deit_s32, k=2, E = 4, 8, 64, bfloat16 tokens

On a GPU `dropless` runs tokamax's Mosaic GPU kernels (`fairmoe_jax/moe/dispatch/grouped_gemm.py`,
bfloat16 and float16 only: float32 runs XLA's dense lowering). XLA's cost analysis does not see
inside them, and they compute whole tiles. Read in tokamax's sm90 kernels (0.0.12 and 0.0.17,
site-packages), with the sm90 heuristic config (block_m 64, block_n 64, block_k 128; the H100
autotuning cache has no entry for these shapes):

- forward and input gradient (`ragged_dot_kernel`, [M, K] x [E, K, N]; the input gradient is the
  same kernel on the transposed weights): 64-row tiles, each a full 64 x K x N product for one
  group. 0.0.12 (`GroupInfo.create`) cuts the rows into fixed 64-row tiles and runs a tile once for
  each group with rows in it; 0.0.17 (`GroupInfo.create_aligned`) starts each group's tiles at its
  first row rounded down to 8. Empty groups run nothing.
- weight gradient (`ragged_contracting_dim_dot_kernel`, rows contracted into [E, K, N]): each group
  runs, for every 64 x 64 output tile, the whole 128-row blocks its rows touch (masked), and an
  empty group at an offset that is not a multiple of 128 one block.

The dense MLP's FLOPs for the same rows (k x tokens, both matmuls, forward and backward) are
3 x 2 x rows x K x N per matmul; `executed_vs_dense` is the kernels' over that.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import bench_utils
import moe_layer
from fairmoe_jax.moe import route_from_logits

TILE_ROWS = 64  # block_m of tokamax's sm90 heuristic config.
WEIGHT_GRADIENT_BLOCK = 128  # Its block_k: the rows a weight-gradient step contracts.
ALIGN = {"0.0.12": None, "0.0.17": 8}  # Where each version starts a group's first tile.


def forward_rows(group_sizes: np.ndarray, tile: int = TILE_ROWS, align: int | None = None) -> int:
  """Rows the forward kernel computes: whole `tile`-row tiles per non-empty group, the tiles
  fixed over all rows (`align` None) or starting at the group's first row rounded down to
  `align`."""
  sizes = np.asarray(group_sizes, np.int64)
  ends = np.cumsum(sizes)
  starts = ends - sizes
  if align is None:
    tiles = (ends - 1) // tile - starts // tile + 1
  else:
    tiles = -(-(ends - starts // align * align) // tile)
  return int(tile * tiles[sizes > 0].sum())


def weight_gradient_rows(group_sizes: np.ndarray, block: int = WEIGHT_GRADIENT_BLOCK) -> int:
  """Rows the weight-gradient kernel contracts: each group's whole `block`-row blocks."""
  ends = np.cumsum(np.asarray(group_sizes, np.int64))
  starts = ends - np.asarray(group_sizes, np.int64)
  return int(block * (-(-ends // block) - starts // block).sum())


def executed_vs_dense(group_sizes: np.ndarray, align: int | None = None) -> float:
  """The grouped matmuls' executed FLOPs (forward, input and weight gradients) over the dense
  MLP's on the same rows (the K x N of each product cancels)."""
  rows = int(np.sum(group_sizes))
  return (2 * forward_rows(group_sizes, align=align) + weight_gradient_rows(group_sizes)) / (
      3 * rows
  )


def routed_group_sizes(shape: str, num_experts: int, top_k: int, dtype: str) -> np.ndarray:
  """Rows per expert of `moe_layer`'s step inputs (seed 0) routed as its loss routes them."""
  x, router, _, _ = moe_layer.layer_args(moe_layer.SHAPES[shape], num_experts, top_k, "", dtype)
  logits = x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ router
  index = np.asarray(route_from_logits(logits, top_k).expert_index).ravel()
  return np.bincount(index, minlength=num_experts)


def main() -> None:
  parser = bench_utils.parser(__doc__, "grouped_gemm_flops")
  parser.add_argument("--shape", default="deit_s32", choices=list(moe_layer.SHAPES))
  parser.add_argument("--experts", nargs="+", type=int, default=[4, 8, 64])
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  rows = []
  for e in args.experts:
    sizes = routed_group_sizes(args.shape, e, 2, args.dtype)
    row = dict(shape=args.shape, num_experts=e, top_k=2, rows=int(sizes.sum()))
    row.update(min_group=int(sizes.min()), max_group=int(sizes.max()))
    row.update(weight_gradient_rows=weight_gradient_rows(sizes))
    for version, align in ALIGN.items():
      row[f"forward_rows_{version}"] = forward_rows(sizes, align=align)
      row[f"vs_dense_{version}"] = executed_vs_dense(sizes, align)
    rows.append(row)
  columns = [("E", "num_experts"), ("rows", "rows"), ("min", "min_group"), ("max", "max_group")]
  columns += [("weight-grad rows", "weight_gradient_rows")]
  for version in ALIGN:
    columns += [(f"fwd rows {version}", f"forward_rows_{version}")]
    columns += [(f"vs dense {version}", f"vs_dense_{version}", 3)]
  print(bench_utils.markdown_table(rows, columns).lstrip())
  bench_utils.write_results(args.output, args, rows, [])


if __name__ == "__main__":
  main()
