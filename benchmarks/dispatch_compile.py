r"""Which MoE dispatch on an accelerator, decided by the compiler: one MoE layer compiled, not run.

  python benchmarks/dispatch_compile.py                                  # v5e-8 and h100x1, float32
  python benchmarks/dispatch_compile.py --peer-vmoe ../shared/peers/vmoe --dtype float32 bfloat16
  python benchmarks/dispatch_compile.py --targets v5e-8 --dtype bfloat16 --merge   # add rows
  python benchmarks/dispatch_compile.py --targets v5e-8 --cases deit_s_e4 --mesh 4 2 --merge

`benchmarks/moe_layer.py`'s step (forward and backward), for each `--dispatch`, `dense_mlp` and,
with `--peer-vmoe`, V-MoE's dispatchers, at moe_layer.py's `--cases vmoe` and `deit_s32`, lowered
on one device of each target (`trainkit.preflight.targets.devices`) and compiled by its XLA. Per
row: XLA's cost and memory analyses (`scratch` = what the step needs besides its inputs and
results), a roofline time and the compile time. XLA's GPU compiler gives no cost analysis.

XLA counts a while loop's body once: the looped dispatches (`sort_blocks`, `blocksparse`) add
`flops_est`, the matmuls of a balanced routing. `dropless_ragged_dot` and `dropless_megablox`
force one of `dropless`'s kernels; a Pallas kernel's cost is its own estimate. A row that fails
to compile records its `error`. With `--mesh DATA EXPERT` the step is compiled on that mesh of
the target's devices instead (tokens over both axes, experts over "expert", the dispatch per
device as `SparseMoE` runs it); figures per device, plus each collective's bytes and the number
of row gathers. Writes JSON (default benchmarks/results/dispatch_compile.json) with, per target, dtype and case, the dispatch of least roofline time and of least scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import json
import os
import re
from typing import Any, Callable
from unittest import mock

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bench_utils
import moe_layer
from bench_utils import fmt, markdown_table, write_results
from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    ExpertWeights,
    data_parallel_moe,
    expert_parallel_moe,
)
from fairmoe_jax.moe.experimental.blocksparse import choose_block_size
from fairmoe_jax.moe.layer import EXPERT_AXIS
from trainkit.mesh import BATCH_AXES, make_mesh
from trainkit.preflight import analysis, hlo
from trainkit.preflight.targets import Target, devices, get_target

SHAPES = moe_layer.SHAPES  # (images, tokens per image, width, expert MLP hidden width)
CASES = {
    "vmoe": moe_layer.VMOE_CASES,  # ("cpu", 8, 2), ("cpu", 64, 2), ("cpu_deit", 8, 2)
    "deit_s": (("deit_s32", 4, 2), ("deit_s32", 64, 2)),
    "deit_s_e4": (("deit_s32", 4, 2),),  # The --mesh rows'.
}
DISPATCHES = tuple(
    "sort einsum einsum_fused sort_blocks blocksparse dropless dropless_ragged_dot".split()
)
# Rows that force one of the grouped matmuls `dropless` picks by platform (megablox's Pallas
# kernels on TPU, `ragged_dot` elsewhere).
VARIANTS = {
    "dropless_ragged_dot": ("dropless", {"matmul": "ragged_dot"}),
    "dropless_megablox": ("dropless", {"matmul": "megablox"}),
}
BASELINE = moe_layer.BASELINE
# The table docs/benchmarks.md cites (committed).
TABLE_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "dispatch_compile.json"
)
# Dispatches whose expert MLP runs in loops with run-time trip counts (see the caveat above).
LOOPED = ("sort_blocks", "blocksparse")
# Matmuls per row of a block's expert MLP, forward and backward (`blocksparse.block_mlp`): two
# forward, and backward the recomputed first one plus four.
_BLOCK_MATMULS = 7
# What the JSON records of each target compiled for.
TARGET_FIELDS = ("name", "platform", "device_kind", "num_devices", "peak_bf16_flops")
TARGET_FIELDS += ("peak_tf32_flops", "memory_bandwidth", "topology")


def libtpu_version() -> str | None:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def one_device_mesh(target: Target) -> Mesh:
  """A 1-device mesh on the first device of `target` (a per-layer comparison, no sharding)."""
  return Mesh(np.array(devices(target)[:1]).reshape(1), ("data",))


def sharded_mesh(target: Target, data: int, expert: int) -> Mesh:
  """The (data, expert) mesh of a training run on `target`'s devices."""
  return make_mesh({"data": data, "expert": expert}, devices(target))


def abstract_args(
    mesh: Mesh, shape: str, num_experts: int | None, top_k: int, dispatch: str, dtype: str
) -> tuple[Any, ...]:
  """moe_layer.layer_args as ShapeDtypeStructs on `mesh` (nothing computed); on a `sharded_mesh`
  laid out as training lays them out: tokens and cotangent over every axis, experts over
  "expert", the other weights replicated."""
  args = jax.eval_shape(
      lambda: moe_layer.layer_args(SHAPES[shape], num_experts, top_k, dispatch, dtype)
  )

  def placed(i: int, arg: Any) -> Any:
    spec = PartitionSpec()
    if EXPERT_AXIS in mesh.shape and i in (0, len(args) - 1):
      spec = PartitionSpec(BATCH_AXES)
    elif EXPERT_AXIS in mesh.shape and isinstance(arg, ExpertWeights):
      spec = PartitionSpec(EXPERT_AXIS)
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), arg)

  return tuple(placed(i, arg) for i, arg in enumerate(args))


def loss_fn(
    dispatch: str, capacity: int | None, top_k: int, peer: Any, mesh: Mesh
) -> Callable[..., Any]:
  """moe_layer.py's loss of the row; a VARIANTS row runs its dispatch with its options, and on a
  `sharded_mesh` the dispatch runs per device as `SparseMoE` runs it."""
  name, options = VARIANTS.get(dispatch, (dispatch, {}))
  if name not in DISPATCH_ALGORITHMS:  # The dense MLP and V-MoE's: the partitioner splits them.
    return moe_layer.layer_loss(dispatch, capacity, top_k, peer)
  algorithm = functools.partial(DISPATCH_ALGORITHMS[name], **options)
  if mesh.shape.get(EXPERT_AXIS, 1) > 1:
    algorithm = functools.partial(expert_parallel_moe, mesh=mesh, algorithm=name)
  elif EXPERT_AXIS in mesh.shape:
    algorithm = functools.partial(data_parallel_moe, algorithm, mesh=mesh)
  with mock.patch.dict(DISPATCH_ALGORITHMS, {dispatch: algorithm}):  # Read when the loss is made.
    return moe_layer.layer_loss(dispatch, capacity, top_k)


def balanced_blocks(
    dispatch: str, groups: int, tokens: int, num_experts: int, top_k: int, capacity: int
) -> tuple[int, int]:
  """(blocks, block size) a looped dispatch fills when every expert gets the same load."""
  choices = groups * tokens * top_k
  block = choose_block_size(choices, num_experts)
  per_expert = choices / num_experts
  if dispatch == "sort_blocks":  # Only the kept choices: at most C per expert and image.
    per_expert = min(per_expert, groups * capacity)
  return num_experts * int(-(-per_expert // block)), block


def _error(e: Exception) -> str:
  lines = [line for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {' / '.join(lines[:3])[:600]}"


def compile_row(
    target: Target,
    mesh: Mesh,
    shape: str,
    num_experts: int | None,
    top_k: int,
    dispatch: str,
    dtype: str,
    capacity_factor: float,
    peer: Any = None,
) -> dict:
  """One row: the step of `dispatch` compiled on `mesh` (`one_device_mesh`, `sharded_mesh`) of
  `target`, its figures."""
  row = dict(target=target.name, platform=target.platform, device_kind=target.device_kind)
  row.update(moe_layer.case_row(shape, num_experts, top_k, dispatch, dtype, capacity_factor))
  if EXPERT_AXIS in mesh.shape:
    row["mesh"] = "x".join(f"{axis}{size}" for axis, size in mesh.shape.items())
  groups, tokens, dim, hidden = SHAPES[shape]
  capacity, row["error"] = row["capacity"], None
  try:
    args = abstract_args(mesh, shape, num_experts, top_k, dispatch, dtype)
    # tokamax picks its grouped-GEMM kernels by the default device when traced (grouped_gemm.py).
    gpu = target.platform == "gpu"
    with jax.default_device(mesh.devices.flat[0]) if gpu else contextlib.nullcontext():
      loss = loss_fn(dispatch, capacity, top_k, peer, mesh)
      compiled, seconds = moe_layer.compile_step(loss, args)
  except Exception as e:  # pylint: disable=broad-except  # The target compiler's own errors.
    return dict(row, error=_error(e))
  costs, text = analysis.cost(compiled) or {}, compiled.as_text()
  optimal = costs.get("optimal_seconds") or 0.0
  row.update(compile_s=seconds, flops=costs.get("flops"))
  row.update(bytes_accessed=costs.get("bytes accessed"))
  row.update(optimal_seconds=optimal if optimal > 0 else None)
  row.update(while_loops=len(re.findall(r"\swhile\(", text)))
  if "mesh" in row:
    collectives = hlo.collective_results(text).items()
    row["collective_bytes"] = {kind: sum(a.bytes for a in arrays) for kind, arrays in collectives}
    row["gathers"] = text.count(" gather(")
  memory = analysis.memory(compiled)
  row.update(memory)
  row["scratch"] = memory["peak"] - memory["arguments"] - memory["outputs"] + memory["aliased"]
  row["flops_est"] = row["flops"]
  if dispatch in LOOPED and row["flops"] is not None:
    blocks, block = balanced_blocks(dispatch, groups, tokens, num_experts, top_k, capacity)
    one_block = 2.0 * _BLOCK_MATMULS * block * dim * hidden
    row.update(balanced_blocks=blocks, block_size=block)
    row["flops_est"] = row["flops"] + (blocks - 1) * one_block
  if row["flops_est"] is not None and row["bytes_accessed"] is not None:
    roofline = analysis.roofline_seconds(
        row["flops_est"], row["bytes_accessed"], target.peak_flops(dtype), target.memory_bandwidth
    )
    row.update(roofline_s=roofline["bound_s"], bound_by=roofline["bound_by"])
  else:
    row.update(roofline_s=None, bound_by=None)
  return row


def add_ratios(rows: list[dict]) -> None:
  """flops_est and scratch of each row over those of the dense MLP of its target, dtype, shape
  and mesh."""
  case = lambda r: (r["target"], r.get("mesh"), r["dtype"], r["shape"], r["top_k"])  # noqa: E731
  dense = {case(r): r for r in rows if r["dispatch"] == BASELINE and not r["error"]}
  for r in rows:
    d = dense.get(case(r))
    for key in ("flops_est", "scratch"):
      ok = d is not None and not r["error"] and r.get(key) is not None and d.get(key)
      r[f"{key}_vs_dense"] = r[key] / d[key] if ok else None


def best_per_case(rows: list[dict]) -> list[dict]:
  """Per target, dtype and MoE case on one device: the dispatch with the smallest roofline time
  (TPU) and the one with the least scratch memory, among those that compiled."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    if r["dispatch"] != BASELINE and not r["error"] and "mesh" not in r:
      key = (r["target"], r["dtype"], r["shape"], r["num_experts"], r["top_k"])
      groups.setdefault(key, []).append(r)
  best = []
  for (target, dtype, shape, e, k), members in groups.items():
    timed = [r for r in members if r.get("roofline_s")]
    row = dict(target=target, dtype=dtype, case=f"{shape} E={e} k={k}")
    row["least_roofline"] = min(timed, key=lambda r: r["roofline_s"])["dispatch"] if timed else None
    best.append(dict(row, least_scratch=min(members, key=lambda r: r["scratch"])["dispatch"]))
  return best


# print_table's columns: (heading, key, digits, scale).
COLUMNS = (
    *(("target", "target"), ("dtype", "dtype"), ("case", "case"), ("C", "capacity")),
    *(("dispatch", "dispatch"), ("GFLOP", "gflop"), ("vs dense", "flops_est_vs_dense", 2)),
    *(("GB accessed", "bytes_accessed", 3, 1e-9), ("roofline us", "roofline_s", 0, 1e6)),
    *(("peak MB", "peak", 1, 2**-20), ("scratch MB", "scratch", 1, 2**-20)),
    *(("temp MB", "temporaries", 1, 2**-20), ("compile s", "compile_s", 1)),
)


def print_table(rows: list[dict]) -> None:
  """The rows as markdown; a looped row's GFLOP is the estimate, XLA's count in brackets."""
  shown = []
  for r in rows:
    gflop = fmt(r.get("flops_est"), 2, 1e-9)
    if r["error"]:
      gflop = f"error: {r['error'][:120]}"
    elif r["dispatch"] in LOOPED and r["flops"] is not None:
      gflop = f"{gflop}* ({fmt(r['flops'], 2, 1e-9)})"
    case = f"{r['shape']} E={r['num_experts'] or '-'} k={r['top_k']} {r.get('mesh', '')}"
    shown.append(dict(r, case=case, gflop=gflop))
  print(markdown_table(shown, COLUMNS).lstrip())


def main() -> None:
  parser = bench_utils.parser(__doc__, "dispatch_compile")
  parser.add_argument(
      "--targets",
      nargs="+",
      default=["v5e-8", "h100x1"],
      help="trainkit.preflight targets to compile for (one device of each); GPU targets give "
      "memory figures only",
  )
  parser.add_argument("--cases", nargs="+", default=["vmoe", "deit_s"], choices=list(CASES))
  parser.add_argument(
      "--dispatch",
      nargs="+",
      default=list(DISPATCHES),
      choices=list(dict.fromkeys([*DISPATCHES, *VARIANTS])),
  )
  parser.add_argument(
      "--peer-vmoe",
      default="",
      metavar="PATH",
      help="a google-research/vmoe checkout (the folder holding vmoe/): adds vmoe_einsum and "
      "vmoe_indices rows, as in moe_layer.py",
  )
  parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
  parser.add_argument(
      "--mesh",
      nargs=2,
      type=int,
      metavar=("DATA", "EXPERT"),
      help="compile on this (data, expert) mesh of each target's devices, not on one device",
  )
  parser.add_argument("--capacity_factor", type=float, default=1.25)
  parser.add_argument(
      "--merge",
      action="store_true",
      help="keep the rows of an existing --output that this run does not compile (same target, "
      "dtype, case and dispatch), so a long run can be done in parts (e.g. one --dtype each)",
  )
  args = parser.parse_args()

  peer = moe_layer.import_peer_vmoe(args.peer_vmoe) if args.peer_vmoe else None
  targets = [get_target(name) for name in args.targets]
  kept, parts = _earlier_run(args.output) if args.merge else ([], [])
  parts = [*parts, dict(vars(args), date=datetime.date.today().isoformat())]
  moe = [case for name in args.cases for case in CASES[name]]
  dispatches = [*args.dispatch, *(moe_layer.PEER_ROWS if peer else [])]
  rows: list[dict] = []
  for target in targets:
    mesh = sharded_mesh(target, *args.mesh) if args.mesh else one_device_mesh(target)
    for dtype in args.dtype:
      for shape, e, k, dispatch in moe_layer.cases(moe, dispatches):
        row = compile_row(target, mesh, shape, e, k, dispatch, dtype, args.capacity_factor, peer)
        status = row["error"] or f"compiled in {row['compile_s']:.1f} s"
        print(f"  {target.name} {dtype} {shape} E={e} k={k} {dispatch}: {status}", flush=True)
        rows.append(row)
        # A partial file if interrupted.
        _write(args, parts, merged(kept, rows), targets, quiet=True)
  rows = merged(kept, rows)
  add_ratios(rows)
  best = best_per_case(rows)
  compiled_for = sorted({r["target"] for r in rows})
  print(
      f"\ncompiled on {jax.devices()[0].device_kind} for one device of "
      f"{', '.join(get_target(t).describe() for t in compiled_for)}; JAX {jax.__version__}, "
      f"libtpu {libtpu_version()}, capacity factor {args.capacity_factor}. * = loops counted "
      "once (GFLOP: balanced-routing estimate, XLA's count in brackets)\n"
  )
  print_table(rows)
  print()
  for b in best:
    print(
        f"{b['target']} {b['dtype']} {b['case']}: least roofline {b['least_roofline']}, "
        f"least scratch {b['least_scratch']}"
    )
  _write(args, parts, rows, [get_target(t) for t in compiled_for], best=best)


def _key(row: dict) -> tuple:
  """What a row measures: a recompiled row replaces the kept one with the same key."""
  keys = ("target", "mesh", "dtype", "shape", "num_experts", "top_k", "dispatch")
  return tuple(row.get(k) for k in keys)


def merged(kept: list[dict], rows: list[dict]) -> list[dict]:
  """`kept` rows not recompiled in `rows`, then `rows`."""
  new = {_key(r) for r in rows}
  return [r for r in kept if _key(r) not in new] + rows


def _earlier_run(path: str) -> tuple[list[dict], list[dict]]:
  """The rows of an earlier output and the arguments of the runs that made them."""
  if not os.path.exists(path):
    return [], []
  with open(path) as f:
    results = json.load(f)
  return results["rows"], results.get("parts") or [dict(results["args"], date=results["date"])]


def _write(
    args: argparse.Namespace,
    parts: list[dict],
    rows: list[dict],
    targets: list[Target],
    best: list[dict] | None = None,
    quiet: bool = False,
) -> None:
  """`bench_utils.write_results`'s provenance, plus the targets, libtpu and the best rows."""
  fields = [{k: v for k, v in vars(t).items() if k in TARGET_FIELDS} for t in targets]
  extra = dict(compiled_for=[dict(f, devices_used=1) for f in fields], libtpu=libtpu_version())
  # With --merge, `parts` holds each run's arguments and date, the earlier ones first.
  extra.update(best_per_case=best, complete=best is not None, parts=parts)
  write_results(args.output, args, rows, [], quiet=quiet, **extra)


if __name__ == "__main__":
  main()
