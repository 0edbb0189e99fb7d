r"""The FLOPs `dropless`'s grouped matmuls execute on a Hopper GPU, from the routing's group sizes.

  python benchmarks/grouped_gemm_flops.py     # deit_s32, k=2, E = 4, 8, 64, bfloat16 tokens

tokamax's Mosaic GPU kernels (`fairmoe_jax/moe/dispatch/grouped_gemm.py`) compute whole tiles, which
XLA's cost analysis does not see. How the sm90 kernels tile the rows (block_m 64, block_k 128; the
forward and input-gradient tiles fixed in 0.0.12, a group's first one 8-aligned in 0.0.17) is read in
`docs/notebook/dropless-tokamax-2026-12-06.md`. `executed_vs_dense` is the kernels' FLOPs over the
dense MLP's on the same rows (k x tokens; both matmuls, forward and backward).
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


def _bounds(group_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  sizes = np.asarray(group_sizes, np.int64)
  ends = np.cumsum(sizes)
  return sizes, ends - sizes, ends


def forward_rows(group_sizes: np.ndarray, tile: int = TILE_ROWS, align: int | None = None) -> int:
  """Rows the forward kernel computes: whole `tile`-row tiles per non-empty group, fixed over all
  rows (`align` None) or from the group's first row rounded down to `align`."""
  sizes, starts, ends = _bounds(group_sizes)
  if align is None:
    tiles = (ends - 1) // tile - starts // tile + 1
  else:
    tiles = -(-(ends - starts // align * align) // tile)
  return int(tile * tiles[sizes > 0].sum())


def weight_gradient_rows(group_sizes: np.ndarray, block: int = WEIGHT_GRADIENT_BLOCK) -> int:
  """Rows the weight-gradient kernel contracts: each group's whole `block`-row blocks."""
  _, starts, ends = _bounds(group_sizes)
  return int(block * (-(-ends // block) - starts // block).sum())


def executed_vs_dense(group_sizes: np.ndarray, align: int | None = None) -> float:
  """Forward, input and weight gradients' executed FLOPs over the dense MLP's (K x N cancels)."""
  forward = forward_rows(group_sizes, align=align)
  return (2 * forward + weight_gradient_rows(group_sizes)) / (3 * int(np.sum(group_sizes)))


def main() -> None:
  parser = bench_utils.parser(__doc__, "grouped_gemm_flops")
  parser.add_argument("--shape", default="deit_s32", choices=list(moe_layer.SHAPES))
  parser.add_argument("--experts", nargs="+", type=int, default=[4, 8, 64])
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  rows = []
  for e in args.experts:
    # Rows per expert of moe_layer's step inputs (seed 0), routed as its loss routes them.
    x, router, _, _ = moe_layer.layer_args(moe_layer.SHAPES[args.shape], e, 2, "", args.dtype)
    logits = x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ router
    sizes = np.bincount(np.asarray(route_from_logits(logits, 2).expert_index).ravel(), minlength=e)
    row = dict(shape=args.shape, num_experts=e, top_k=2, rows=int(sizes.sum()))
    row.update(min_group=int(sizes.min()), max_group=int(sizes.max()))
    row.update(weight_gradient_rows=weight_gradient_rows(sizes))
    for version, align in ALIGN.items():
      row[f"forward_rows_{version}"] = forward_rows(sizes, align=align)
      row[f"vs_dense_{version}"] = executed_vs_dense(sizes, align)
    rows.append(row)
  columns = [("E", "num_experts"), ("rows", "rows"), ("min", "min_group"), ("max", "max_group")]
  columns += [("weight-grad rows", "weight_gradient_rows")]
  for v in ALIGN:
    columns += [(f"fwd rows {v}", f"forward_rows_{v}"), (f"vs dense {v}", f"vs_dense_{v}", 3)]
  print(bench_utils.markdown_table(rows, columns).lstrip())
  bench_utils.write_results(args.output, args, rows, [])


if __name__ == "__main__":
  main()
