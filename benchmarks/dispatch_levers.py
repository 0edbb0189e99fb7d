r"""Bytes accessed by the `einsum` layer, by its expert MLP against that MLP's traffic floor, and
with the fused expert MLP (`einsum_fused`).

  python benchmarks/dispatch_levers.py                  # deit_s32 E=64 float32 on a v5e, ~2 min
  python benchmarks/dispatch_levers.py --experts 4 --dtype bfloat16

Compiled for one v5e chip as `benchmarks/dispatch_compile.py` compiles its rows: the layer, the
expert MLP alone and its traffic floor (`expert_mlp_traffic_floor`), against V-MoE's best; the
MLP in `fused_mlp`'s Pallas kernels, alone and as `einsum_fused`; and each dispatch's writes of
the dispatched buffers' shape (`buffer_writes`). The JSON (`--out`) holds the bytes.

With `--settings MULTIPLE,GROUP_SIZE ...` (capacity granularity and routing groups,
`moe.capacity_multiple_of` and `moe.group_size`), each setting's C, bytes accessed, relayout copies
and drop rate instead, compiled for every `--dispatch` (none: C and drops only):

  python benchmarks/dispatch_levers.py --experts 4 --settings 1,1 4,1 8,1 8,2 \
      --out benchmarks/results/capacity_granularity.json
  python benchmarks/dispatch_levers.py --experts 64 --dispatch --settings 1,1 1,2 1,4 8,4

The step is the layer's with the images routed in groups of `group_size`, as `SparseMoE` forms
them, and C = `compute_capacity(group_size * S, E, k, 1.25, multiple_of)`. Relayout copies: the
arrays of the [E, G C, D] and [E, G C, H] row layout the entry computation writes
(`buffer_writes`), each a copy of an [E, G, C, .] buffer. Drop rate: the fraction of (token,
choice) pairs over capacity on the step's own inputs (`moe_layer.layer_args`, seed 0), the same
for every capacity dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_utils  # noqa: E402
import dispatch_compile  # noqa: E402
import moe_layer  # noqa: E402
from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS, compute_capacity  # noqa: E402
from fairmoe_jax.moe.dispatch import experts as experts_module  # noqa: E402
from fairmoe_jax.moe.dispatch.capacity import stats_per_example, to_groups  # noqa: E402
from fairmoe_jax.moe.dispatch.sort import sort_slot_plan  # noqa: E402
from fairmoe_jax.moe.experimental.fused_mlp import fused_expert_mlp  # noqa: E402
from fairmoe_jax.moe.routers import route_from_logits  # noqa: E402
from trainkit.preflight import analysis  # noqa: E402
from trainkit.preflight.targets import get_target  # noqa: E402

TOP_K = 2


def expert_mlp_traffic_floor(
    num_experts: int, rows: int, dim: int, hidden: int, itemsize: int = 4
) -> int:
  """Bytes the expert MLP's forward and backward pass must move on `rows` rows per expert, with
  weights, tokens and intermediates of `itemsize` bytes, under one matmul per fusion.

  Weights: W1 and W2 are read forward and backward and their gradients written (3 x 2 kernels).
  Per row, with x and y of width D and h of width H: forward reads x, writes h, reads h again
  (GELU fused into the second matmul) and writes y (2 D + 2 H); backward reads dy for dA = dy W2^T
  and for dW2, reads h in dA's fusion (GELU'(h)) and again for dW2 (GELU(h)), writes dh, reads
  it for dW1 and for dx, reads x for dW1 and writes dx (4 D + 5 H). Biases are left out (E x
  (D + H), under a megabyte here). A fused kernel that recomputes h where it is needed could go
  lower; XLA does not write one.
  """
  kernels = 2 * num_experts * dim * hidden
  per_row = 6 * dim + 7 * hidden
  return itemsize * (3 * kernels + num_experts * rows * per_row)


def expert_mlp_bytes(
    mesh: jax.sharding.Mesh, shape: str, num_experts: int, dtype: str, mlp: str = "xla"
) -> float:
  """Bytes accessed by the expert MLP alone, forward and backward, compiled on `mesh` for the
  [E, G, C, D] buffers `einsum` hands it at `shape` (weights float32, tokens in `dtype`); `mlp`
  "xla" (`ExpertWeights.apply_expert_major`) or "fused" (`fused_mlp`'s kernels on a TPU)."""
  groups, tokens, dim, _ = dispatch_compile.SHAPES[shape]
  x, _, weights, _ = dispatch_compile.abstract_args(
      mesh, shape, num_experts, TOP_K, "einsum", dtype
  )
  capacity = compute_capacity(tokens, num_experts, TOP_K, 1.25)
  buffers = jax.ShapeDtypeStruct((num_experts, groups, capacity, dim), x.dtype, sharding=x.sharding)

  def loss(x: jax.Array, experts: experts_module.ExpertWeights, cotangent: jax.Array):
    y = fused_expert_mlp(x, experts) if mlp == "fused" else experts.apply_expert_major(x)
    return jnp.sum((y * cotangent).astype(jnp.float32)), jnp.zeros(())

  compiled, _ = moe_layer.compile_step(loss, (buffers, weights, buffers))
  return analysis.cost(compiled)["bytes accessed"]


def _vmoe_best(shape: str, num_experts: int, dtype: str, target: str) -> float | None:
  """V-MoE's best bytes for the case in the committed dispatch table, or None."""
  rows = bench_utils.read_json(dispatch_compile.TABLE_JSON).get("rows", [])
  case = (shape, num_experts, dtype, target)
  peers = [
      r["bytes_accessed"]
      for r in rows
      if (r["shape"], r["num_experts"], r["dtype"], r["target"]) == case
      and r["dispatch"] in moe_layer.PEER_ROWS
      and r.get("bytes_accessed")
  ]
  return min(peers) if peers else None


def buffer_writes(hlo_text: str, dims: Sequence[int]) -> dict[str, int]:
  """{dtype: how many arrays of shape `dims` the optimised HLO's entry computation writes}: e.g.
  the [E, G, C, D] buffers a dispatch writes, and in which precision. Instructions inside fusions
  write nothing to memory, and parameters, bitcasts and tuple elements are no new array."""
  entry = re.search(r"^ENTRY .*?^}", hlo_text, re.MULTILINE | re.DOTALL)
  shape = re.escape("[" + ",".join(str(d) for d in dims) + "]")
  counts: dict[str, int] = {}
  for dtype, opcode in re.findall(
      r"^\s*(?:ROOT )?%?[\w.-]+ = (\w+)" + shape + r"(?:\{[^}]*\})? ([\w-]+)\(",
      entry.group(0) if entry else "",
      re.MULTILINE,
  ):
    if opcode not in ("parameter", "bitcast", "get-tuple-element"):
      counts[dtype] = counts.get(dtype, 0) + 1
  return counts


def _buffer_line(name: str, compiled: Any, experts: int, groups: int, capacity: int, dim: int):
  text = compiled.as_text()
  buffers = buffer_writes(text, (experts, groups, capacity, dim))
  rows = buffer_writes(text, (experts, groups * capacity, dim))
  return (
      f"{name}: arrays of the dispatched buffers' shape [E, G, C, D] = "
      f"[{experts}, {groups}, {capacity}, {dim}] written, by dtype: {buffers or 'none'}; "
      f"of the kernels' rows [E, G C, D]: {rows or 'none'}"
  )


def grouped(algorithm, group_size: int):
  """`algorithm` on routing groups of `group_size` images, undone on y and the stats."""

  def run(x, expert_index, gates, experts, *, capacity):
    groups = to_groups((x, expert_index, gates), group_size)
    y, stats = algorithm(*groups, experts, capacity=capacity)
    return y.reshape(x.shape), stats_per_example(stats, expert_index, experts.num_experts)

  return run


def drop_rate(args: tuple, num_experts: int, group_size: int, capacity: int) -> float:
  x, router, _, _ = args
  routing = route_from_logits(x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ router, TOP_K)
  index = routing.expert_index.reshape(x.shape[0] // group_size, -1, TOP_K)
  return float(
      sort_slot_plan(index, num_experts=num_experts, capacity=capacity).stats.fraction_dropped
  )


def granularity(args: argparse.Namespace, inputs: tuple) -> list[dict]:
  """The rows of `--settings`: per setting its C and drop rate, then per dispatch its bytes."""
  images, tokens, dim, hidden = dispatch_compile.SHAPES[args.shape]
  concrete = moe_layer.layer_args(
      dispatch_compile.SHAPES[args.shape], args.experts, TOP_K, "einsum", args.dtype
  )
  rows, compiled = [], {}
  for setting in args.settings:
    multiple_of, group_size = (int(v) for v in setting.split(","))
    capacity = compute_capacity(group_size * tokens, args.experts, TOP_K, 1.25, multiple_of)
    dropped = drop_rate(concrete, args.experts, group_size, capacity)
    setting = dict(capacity_multiple_of=multiple_of, group_size=group_size, capacity=capacity)
    rows.append(dict(setting, dispatch=None, fraction_dropped=dropped))
    print(f"{args.shape} E={args.experts} {setting}: {dropped:.4f} dropped", flush=True)
    for name in args.dispatch:
      key = (name, group_size, capacity)  # A multiple that leaves C as it is: the same step.
      if key not in compiled:
        algorithm = DISPATCH_ALGORITHMS[name]
        algorithm = grouped(algorithm, group_size) if group_size > 1 else algorithm
        with mock.patch.dict(DISPATCH_ALGORITHMS, {name: algorithm}):
          step, _ = moe_layer.compile_step(moe_layer.layer_loss(name, capacity, TOP_K), inputs)
        layout = (args.experts, images // group_size * capacity)
        compiled[key] = dict(
            bytes_accessed=analysis.cost(step)["bytes accessed"],
            relayout_copies=sum(
                sum(buffer_writes(step.as_text(), (*layout, w)).values()) for w in (dim, hidden)
            ),
        )
      rows.append(dict(setting, dispatch=name, **compiled[key]))
      print(f"  {args.target} {args.dtype} {name}: {compiled[key]}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      record = dict(vars(args), jax=jax.__version__, libtpu=dispatch_compile.libtpu_version())
      json.dump(dict(record, rows=rows), f, indent=1)
  return rows


def main(argv: list[str] | None = None) -> dict | list[dict]:
  parser = bench_utils.parser(__doc__)
  parser.add_argument("--shape", default="deit_s32")
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--target", default="v5e-8")
  parser.add_argument("--out", default="")
  parser.add_argument("--settings", nargs="*", default=[], metavar="MULTIPLE,GROUP_SIZE")
  parser.add_argument("--dispatch", nargs="*", default=["einsum_fused", "einsum"])
  args = parser.parse_args(argv)
  target = get_target(args.target)
  mesh = dispatch_compile.one_device_mesh(target)
  groups, tokens, dim, hidden = dispatch_compile.SHAPES[args.shape]
  capacity = compute_capacity(tokens, args.experts, TOP_K, 1.25)
  inputs = dispatch_compile.abstract_args(
      mesh, args.shape, args.experts, TOP_K, "einsum", args.dtype
  )
  if args.settings:
    return granularity(args, inputs)
  rows = {}
  case = f"{args.target} {args.shape} E={args.experts} {args.dtype}"

  def record(name: str, value: float, note: str = "") -> None:
    rows[name] = value
    print(f"{case} {name}: {value / 1e9:.3f} GB accessed{note}", flush=True)

  einsum_step, _ = moe_layer.compile_step(moe_layer.layer_loss("einsum", capacity, TOP_K), inputs)
  record("einsum", analysis.cost(einsum_step)["bytes accessed"])
  # The floor counts every tensor in float32; a bfloat16 layer mixes float32 weights with
  # bfloat16 tokens and intermediates, and meets the 0.9x target already.
  floor = None
  if args.dtype == "float32":
    floor = expert_mlp_traffic_floor(args.experts, groups * capacity, dim, hidden)
  alone = expert_mlp_bytes(mesh, args.shape, args.experts, args.dtype)
  record("expert MLP alone", alone, f"; its floor {floor / 1e9:.3f} GB" if floor else "")
  # What goes below that floor: the MLP in one Pallas kernel per pass (`fused_mlp`), alone and
  # in the layer (the dispatch `einsum_fused`). The kernels' share is their own cost estimate.
  fused = expert_mlp_bytes(mesh, args.shape, args.experts, args.dtype, "fused")
  record("fused expert MLP alone", fused)
  compiled, _ = moe_layer.compile_step(
      moe_layer.layer_loss("einsum_fused", capacity, TOP_K), inputs
  )
  record("einsum_fused", analysis.cost(compiled)["bytes accessed"])
  # Where the layers' bytes beyond the MLP go: the precision of the buffers each writes, and
  # einsum_fused's copies of them into the kernels' row layout (forward and backward).
  for name, step in (("einsum", einsum_step), ("einsum_fused", compiled)):
    print(_buffer_line(name, step, args.experts, groups, capacity, dim), flush=True)
  vmoe_best = _vmoe_best(args.shape, args.experts, args.dtype, args.target)
  if vmoe_best is not None:
    print(
        f"V-MoE's best (benchmarks/results/dispatch_compile.json): {vmoe_best / 1e9:.3f} GB; "
        + ", ".join(f"{name} {value / vmoe_best:.3f}x" for name, value in rows.items())
        + (f", the MLP's floor {floor / vmoe_best:.3f}x" if floor else ""),
        flush=True,
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
          dict(vars(args), bytes_accessed=rows, mlp_floor=floor, vmoe_best=vmoe_best), f, indent=1
      )
  return rows


if __name__ == "__main__":
  main()
