r"""Capacity granularity and routing groups (`moe.capacity_multiple_of`, `moe.group_size`),
compiled for one TPU v5e chip: each setting's C, bytes accessed, relayout copies and drop rate.

  python benchmarks/capacity_granularity.py --out benchmarks/results/capacity_granularity.json
  python benchmarks/capacity_granularity.py --experts 64 --dispatch --settings 1,1 1,2 1,4 8,4

Each setting MULTIPLE,GROUP_SIZE is compiled for every `--dispatch` (none: C and drops only).

`dispatch_compile.py`'s step (`moe_layer.py`'s loss, forward and backward, capacity factor 1.25,
top-2) with the images routed in groups of `group_size`, as `SparseMoE` forms them, and C =
`compute_capacity(group_size * S, E, k, 1.25, multiple_of)`. Relayout copies: the arrays of the
[E, G C, D] and [E, G C, H] row layout the optimised entry computation writes
(`dispatch_levers.buffer_writes`), each a copy of an [E, G, C, .] buffer. Drop rate: the
fraction of (token, choice) pairs over capacity on the step's own inputs
(`moe_layer.layer_args`, seed 0: random tokens and router), the same for every capacity dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dispatch_compile  # noqa: E402
import dispatch_levers  # noqa: E402
import moe_layer  # noqa: E402
from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS, compute_capacity  # noqa: E402
from fairmoe_jax.moe.dispatch.capacity import stats_per_example, to_groups  # noqa: E402
from fairmoe_jax.moe.dispatch.sort import sort_slot_plan  # noqa: E402
from fairmoe_jax.moe.routers import route_from_logits  # noqa: E402
from trainkit.preflight import analysis  # noqa: E402
from trainkit.preflight.targets import get_target  # noqa: E402

TOP_K, CAPACITY_FACTOR = 2, 1.25


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
  plan = sort_slot_plan(index, num_experts=num_experts, capacity=capacity)
  return float(plan.stats.fraction_dropped)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--shape", default="deit_s32")
  parser.add_argument("--experts", type=int, default=4)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--target", default="v5e-8")
  parser.add_argument("--dispatch", nargs="*", default=["einsum_fused", "einsum"])
  parser.add_argument("--settings", nargs="+", default=["1,1", "4,1", "8,1", "8,2"])
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  mesh = dispatch_compile.one_device_mesh(get_target(args.target))
  images, tokens, dim, hidden = dispatch_compile.SHAPES[args.shape]
  inputs = dispatch_compile.abstract_args(
      mesh, args.shape, args.experts, TOP_K, "einsum", args.dtype
  )
  concrete = moe_layer.layer_args(
      dispatch_compile.SHAPES[args.shape], args.experts, TOP_K, "einsum", args.dtype
  )
  rows, compiled = [], {}
  for setting in args.settings:
    multiple_of, group_size = (int(v) for v in setting.split(","))
    capacity = compute_capacity(
        group_size * tokens, args.experts, TOP_K, CAPACITY_FACTOR, multiple_of
    )
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
                sum(dispatch_levers.buffer_writes(step.as_text(), (*layout, w)).values())
                for w in (dim, hidden)
            ),
        )
      rows.append(dict(setting, dispatch=name, **compiled[key]))
      print(f"  {args.target} {args.dtype} {name}: {compiled[key]}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      record = dict(vars(args), jax=jax.__version__, libtpu=dispatch_compile.libtpu_version())
      json.dump(dict(record, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main()
