r"""Forward+backward time and memory of one MoE layer, by dispatch algorithm, on this machine.

  python benchmarks/moe_layer.py --shape cpu                 # reduced shape, all E and k
  python benchmarks/moe_layer.py --cases vmoe                # the three cases compared with V-MoE
  python benchmarks/moe_layer.py --shape deit_s --dtype bfloat16   # DeiT-S last block (accelerator)

Each case jits `jax.value_and_grad` of sum(y * cotangent), y the MoE layer's output (float32
router, top-k, `DISPATCH_ALGORITHMS[dispatch]`, capacity per image). References: `dense_mlp`, a
GELU MLP of hidden k * H (the same active FLOPs, no routing), and `vmoe_ref`, V-MoE's einsum
dispatch (Riquelme et al. 2021) in a few lines of our own. Time: median of `--repeats` rounds,
the cases alternated (`bench_utils.time_interleaved`); memory and FLOPs: XLA's analyses.
Prints a table and the targets (sort at most 0.8x V-MoE's time with no more scratch, at most
1.3x the dense MLP at E=8, k=2, at least 1.5x faster than einsum at E=64); writes JSON (default
benchmarks/results/moe_layer.json).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

import bench_utils
from bench_utils import cost, fmt, memory_analysis, ratio
from fairmoe_jax.methods.base import AUTO_DISPATCH
from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    ExpertWeights,
    compute_capacity,
    dispatch_and_combine_masks,
    sort_slot_plan,
)
from fairmoe_jax.moe.routers import route_from_logits
from trainkit.preflight.compile import persistent_cache_off

SHAPES = {  # images (groups), tokens per image, dim, expert hidden width
    "deit_s": (256, 197, 384, 1536),
    "cpu": (32, 65, 128, 512),
    "cpu_deit": (16, 197, 384, 1536),  # DeiT-S widths and tokens, 16 images.
    "deit_s32": (32, 197, 384, 1536),  # dispatch_compile.py's
    "tiny": (3, 10, 8, 16),  # For tests.
    "test": (2, 16, 32, 64),  # tests/benchmarks/test_dispatch_compile.py
}
BASELINE = "dense_mlp"
REFERENCE = "vmoe_ref"
# `--cases vmoe`: the (shape, E, k) cases of the side-by-side comparison with V-MoE.
VMOE_CASES = (("cpu", 8, 2), ("cpu", 64, 2), ("cpu_deit", 8, 2))
_INIT_STD = 0.02  # timm / DeiT linear init, also the router's


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return _INIT_STD * jax.random.normal(key, shape, jnp.float32)


def vmoe_reference(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int,
) -> tuple[jax.Array, Any]:
  """The V-MoE layer's dispatch, for comparison: same capacity semantics as ours."""
  groups, tokens, top_k = expert_index.shape
  num_experts, dim = experts.num_experts, x.shape[-1]
  # Position of each choice in its expert's queue, all top-1 choices of a group first.
  choice = jax.nn.one_hot(jnp.swapaxes(expert_index, 1, 2), num_experts, dtype=jnp.int32)
  queue = choice.reshape(groups, top_k * tokens, num_experts)
  position = ((jnp.cumsum(queue, axis=1) - 1) * queue).sum(-1).reshape(groups, top_k, tokens)
  slot = jax.nn.one_hot(jnp.swapaxes(position, 1, 2), capacity, dtype=x.dtype)  # >= C: dropped.
  dispatch = jnp.einsum("gske,gskc->gsec", jnp.swapaxes(choice, 1, 2).astype(x.dtype), slot)
  combine = dispatch * jnp.einsum(
      "gsk,gske->gse", gates, jax.nn.one_hot(expert_index, num_experts, dtype=gates.dtype)
  )[..., None].astype(x.dtype)
  buffers = jnp.einsum("gsec,gsd->gecd", dispatch, x)
  buffers = jnp.swapaxes(buffers, 0, 1).reshape(num_experts, groups * capacity, dim)
  outputs = experts.apply(buffers).reshape(num_experts, groups, capacity, dim)
  y = jnp.einsum("gsec,gecd->gsd", combine, jnp.swapaxes(outputs, 0, 1))
  kept = jnp.einsum("gsec->gs", dispatch)  # Served choices per token, for fraction_dropped.
  return y, _Dropped(1.0 - kept.sum() / expert_index.size)


class _Dropped(NamedTuple):
  fraction_dropped: jax.Array


def _moe_loss(dispatch: str, capacity: int, top_k: int) -> Callable[..., Any]:
  algorithm = vmoe_reference if dispatch == REFERENCE else DISPATCH_ALGORITHMS[dispatch]

  def loss(x, router, experts, cotangent):
    groups, tokens, dim = x.shape
    # The router runs in float32 whatever the compute dtype (as `TopKRouter` does).
    logits = x.reshape(groups * tokens, dim).astype(jnp.float32) @ router
    routing = route_from_logits(logits, top_k)
    y, stats = algorithm(
        x,
        routing.expert_index.reshape(groups, tokens, top_k),
        routing.gates.reshape(groups, tokens, top_k),
        experts,
        capacity=capacity,
    )
    return jnp.sum((y * cotangent).astype(jnp.float32)), stats.fraction_dropped

  return loss


# google-research/vmoe's own dispatchers, from a checkout named by `--peer-vmoe` (never copied
# here): rows "vmoe_einsum" and "vmoe_indices".
PEER_ROWS = {"vmoe_einsum": "einsum", "vmoe_indices": "indices"}


def import_peer_vmoe(path: str) -> Any:
  """`vmoe.moe` imported from the checkout at `path` (the folder that holds `vmoe/`)."""
  root = os.path.abspath(path)
  if not os.path.isfile(os.path.join(root, "vmoe", "moe.py")):
    raise SystemExit(f"--peer-vmoe {path}: no vmoe/moe.py there (give the folder holding vmoe/)")
  sys.path.insert(0, root)
  import vmoe.moe  # pylint: disable=g-import-not-at-top

  return vmoe.moe


def _peer_loss(vmoe_moe: Any, name: str, capacity: int, top_k: int) -> Callable[..., Any]:
  """The layer with vmoe's top-k-per-item router and its `name` dispatcher, our expert MLP."""
  get_dispatcher = functools.partial(
      vmoe_moe.get_top_experts_per_item_dispatcher,
      name=name,
      num_selected_experts=top_k,
      batch_priority=False,
      capacity=capacity,
  )

  def loss(x, router, experts, cotangent):
    logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), router)
    dispatcher = jax.vmap(get_dispatcher)(jax.nn.softmax(logits))  # One group per image.
    outputs = experts.apply(dispatcher.dispatch(x))  # (E, G * C, D), vmoe's layout.
    y = dispatcher.combine(outputs)
    return jnp.sum((y * cotangent).astype(jnp.float32)), jnp.zeros((), jnp.float32)

  return loss


def _dense_loss(x, weights, cotangent):
  w1, b1, w2, b2 = (w.astype(x.dtype) for w in weights)
  h = jax.nn.gelu(jnp.einsum("gsd,dh->gsh", x, w1) + b1, approximate=False)
  y = jnp.einsum("gsh,hd->gsd", h, w2) + b2
  return jnp.sum((y * cotangent).astype(jnp.float32)), jnp.zeros((), jnp.float32)


def compile_step(loss: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, float]:
  """grad(loss) w.r.t. all but the last argument (the cotangent), compiled; and the seconds it
  took, the compiler's own (no persistent cache)."""
  step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args) - 1)), has_aux=True))
  with persistent_cache_off():
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def layer_loss(dispatch: str, capacity: int | None, top_k: int, peer: Any = None) -> Callable:
  """The loss of a row: the dense MLP's, a vmoe dispatcher's (`peer`: `import_peer_vmoe`'s
  module) or that of a key of DISPATCH_ALGORITHMS or REFERENCE."""
  if dispatch == BASELINE:
    return _dense_loss
  if dispatch in PEER_ROWS:
    return _peer_loss(peer, PEER_ROWS[dispatch], capacity, top_k)
  return _moe_loss(dispatch, capacity, top_k)


# How each capacity algorithm represents "which token goes to which slot": einsum builds one-hot
# [G, S, E, C] dispatch and combine tensors, sort an index plan of [G, E * C] slots.
_DISPATCH_PLANS = {
    "einsum": lambda idx, gates, e, c: dispatch_and_combine_masks(
        idx, gates, num_experts=e, capacity=c
    ),
    "sort": lambda idx, gates, e, c: sort_slot_plan(idx, num_experts=e, capacity=c),
}


def dispatch_plan_bytes(
    dispatch: str, groups: int, tokens: int, num_experts: int, top_k: int, capacity: int
) -> int | None:
  """Bytes of the routing-to-slots plan alone (outputs + scratch of the compiled plan function).

  This isolates what differs between the capacity algorithms; the expert activations, which
  they share, dominate whole-layer memory.
  """
  if dispatch not in _DISPATCH_PLANS:
    return None
  index = jax.ShapeDtypeStruct((groups, tokens, top_k), jnp.int32)
  gates = jax.ShapeDtypeStruct((groups, tokens, top_k), jnp.float32)
  plan = jax.jit(lambda i, g: _DISPATCH_PLANS[dispatch](i, g, num_experts, capacity))
  memory = plan.lower(index, gates).compile().memory_analysis()
  return int(memory.output_size_in_bytes + memory.temp_size_in_bytes) if memory else None


def layer_args(
    dims: tuple, num_experts: int | None, top_k: int, dispatch: str, dtype: str, seed: int = 0
) -> tuple[Any, ...]:
  """A row's step arguments for (images, tokens, dim, hidden) `dims`: the tokens and cotangent in
  `dtype`, the weights (the dense MLP's, or the router's and experts') float32."""
  groups, tokens, dim, hidden = dims
  keys = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(keys[0], (groups, tokens, dim), jnp.float32).astype(dtype)
  cotangent = jax.random.normal(keys[1], (groups, tokens, dim), jnp.float32).astype(dtype)
  if dispatch == BASELINE:
    width = top_k * hidden
    w1, w2 = _normal(keys[2], (dim, width)), _normal(keys[3], (width, dim))
    return x, (w1, jnp.zeros((width,), jnp.float32), w2, jnp.zeros((dim,), jnp.float32)), cotangent
  router = _normal(keys[2], (dim, num_experts))
  experts = ExpertWeights(
      w1=_normal(keys[3], (num_experts, dim, hidden)),
      b1=jnp.zeros((num_experts, hidden), jnp.float32),
      w2=_normal(keys[4], (num_experts, hidden, dim)),
      b2=jnp.zeros((num_experts, dim), jnp.float32),
  )
  return x, router, experts, cotangent


def case_row(shape: str, e: int | None, k: int, dispatch: str, dtype: str, factor: float) -> dict:
  """A row's case: the shape's sizes, the routing (E experts, top-k), and the capacity per image
  at capacity factor `factor` (None for the dense MLP, whose E is unused)."""
  groups, tokens, dim, hidden = SHAPES[shape]
  capacity = None if dispatch == BASELINE else compute_capacity(tokens, e, k, factor)
  row = dict(shape=shape, groups=groups, tokens=tokens, dim=dim, hidden=hidden)
  row.update(num_experts=e, top_k=k, dispatch=dispatch, dtype=dtype)
  return dict(row, capacity_factor=factor, capacity=capacity)


def compile_case(
    shape: str, e: int | None, k: int, dispatch: str, dtype: str, factor: float, peer: Any = None
) -> tuple[dict, Any, tuple[Any, ...]]:
  """One row's compile-time figures, its compiled step and arguments (`layer_loss`'s row)."""
  row = case_row(shape, e, k, dispatch, dtype, factor)
  args = layer_args(SHAPES[shape], e, k, dispatch, dtype)
  if dispatch != BASELINE:
    row["dispatch_plan_bytes"] = dispatch_plan_bytes(
        dispatch, row["groups"], row["tokens"], e, k, row["capacity"]
    )
  compiled, seconds = compile_step(layer_loss(dispatch, row["capacity"], k, peer), args)
  row.update(compile_s=seconds, flops=cost(compiled, "flops"))
  row.update(bytes_accessed=cost(compiled, "bytes accessed"), **memory_analysis(compiled))
  return row, compiled, args


def add_ratios(rows: list[dict]) -> None:
  """Each row against the equal-FLOPs dense MLP (time), the V-MoE reference (time, memory)
  and vmoe's own fastest dispatcher in the same case (time, `vs_peer`)."""
  dense = {(r["shape"], r["top_k"]): r for r in rows if r["dispatch"] == BASELINE}
  reference = {
      (r["shape"], r["num_experts"], r["top_k"]): r for r in rows if r["dispatch"] == REFERENCE
  }
  peer_best: dict[tuple, dict] = {}
  for r in rows:
    case = (r["shape"], r["num_experts"], r["top_k"])
    if r["dispatch"] in PEER_ROWS and r["time_ms"] is not None:
      if case not in peer_best or r["time_ms"] < peer_best[case]["time_ms"]:
        peer_best[case] = r
  for r in rows:
    peer = peer_best.get((r["shape"], r["num_experts"], r["top_k"]))
    r["peer_best"] = peer["dispatch"] if peer else None
    r["vs_peer"] = ratio(r["time_ms"], peer["time_ms"]) if peer else None
    d = dense.get((r["shape"], r["top_k"]))
    ref = reference.get((r["shape"], r["num_experts"], r["top_k"]))
    moe = r["dispatch"] != BASELINE
    r["vs_dense"] = ratio(r["time_ms"], d["time_ms"]) if d else None
    r["vs_reference"] = ratio(r["time_ms"], ref["time_ms"]) if ref and moe else None
    r["vs_reference_memory"] = (
        ratio(r["temp_size_in_bytes"], ref["temp_size_in_bytes"]) if ref and moe else None
    )


def fastest_dispatch(rows: list[dict], dispatches: Sequence[str], platform: str) -> dict:
  """The fastest of `dispatches` at each E (and of all rows), and whether it is what
  `moe.dispatch=auto` chooses on `platform` (`AUTO_DISPATCH`); "fastest" is None on a split."""
  fastest = {}
  for e in dict.fromkeys(r["num_experts"] for r in rows if r["num_experts"]):
    timed = [r for r in rows if r["num_experts"] == e and r.get("time_ms")]
    if ours := [r for r in timed if r["dispatch"] in dispatches]:
      best, overall = (min(rs, key=lambda r: r["time_ms"]) for rs in (ours, timed))
      fastest[str(e)] = dict(ours=best["dispatch"], ours_ms=best["time_ms"])
      fastest[str(e)].update(overall=overall["dispatch"], overall_ms=overall["time_ms"])
  winners, current = {f["ours"] for f in fastest.values()}, AUTO_DISPATCH.get(platform, "sort")
  auto = dict(platform=platform, current=current, agrees=winners == {current})
  auto["fastest"] = next(iter(winners)) if len(winners) == 1 else None
  return dict(fastest=fastest, auto=auto) if fastest else {}


# The ratio targets: (dispatch, (E, k) or None for every case, ratio key, at most, target).
DENSE = "the equal-FLOPs dense MLP at E="
REF = "the V-MoE reference's"
BLOCKSPARSE_TARGET = f"blocksparse (dropless) at most 1.15x {DENSE}64, k=2"
CHECKS = (
    ("blocksparse", (64, 2), "vs_dense", 1.15, BLOCKSPARSE_TARGET),
    ("sort", None, "vs_peer", 0.8, "sort fwd+bwd at most 0.8x vmoe's own fastest dispatcher"),
    ("sort", None, "vs_reference", 0.8, f"sort fwd+bwd at most 0.8x {REF} time"),
    ("sort", None, "vs_reference_memory", 1.0, f"sort scratch memory no higher than {REF}"),
    ("sort", (8, 2), "vs_dense", 1.3, f"sort at most 1.3x {DENSE}8, k=2"),
)
# What each ratio divides, for a target's detail.
RATIO_OF = dict(vs_dense="{dispatch}/dense_mlp time", vs_peer="sort/{peer_best} time")
RATIO_OF.update(vs_reference="sort/vmoe_ref time", vs_reference_memory="sort/vmoe_ref temp")


def evaluate_targets(rows: list[dict]) -> list[dict]:
  """The MoE-layer targets, on whichever rows are present."""
  find = {(r["shape"], r["num_experts"], r["top_k"], r["dispatch"]): r for r in rows}
  targets = []
  for (shape, num_experts, top_k, dispatch), row in find.items():
    case = f"{shape} E={num_experts} k={top_k}"
    for name, where, key, bound, target in CHECKS:
      if name == dispatch and where in (None, (num_experts, top_k)) and row[key] is not None:
        detail = f"{RATIO_OF[key].format(**row)} = {row[key]:.2f}x"
        targets.append(dict(target=target, case=case, passed=row[key] <= bound, detail=detail))
    einsum = find.get((shape, num_experts, top_k, "einsum"))
    if dispatch == "sort" and num_experts == 64 and einsum is not None:
      speedup = ratio(einsum["time_ms"], row["time_ms"])
      target = dict(target="sort at least 1.5x faster than einsum at E=64", case=case)
      passed = speedup is not None and speedup >= 1.5
      targets.append(dict(target, passed=passed, detail=f"einsum/sort time = {fmt(speedup, 2)}x"))
  return targets


# print_table's columns: (heading, key, digits, scale).
COLUMNS = (
    *(("shape", "shape"), ("E", "num_experts"), ("k", "top_k"), ("C", "capacity")),
    *(("dispatch", "dispatch"), ("time_ms", "time_ms", 2), ("vs_dense", "vs_dense", 2)),
    *(("vs_ref", "vs_reference", 2), ("vs_vmoe_best", "vs_peer", 2)),
    *(("GB_accessed", "bytes_accessed", 3, 1e-9), ("temp_MB", "temp_size_in_bytes", 2, 2**-20)),
    *(("vs_ref_memory", "vs_reference_memory", 2), ("plan_MB", "dispatch_plan_bytes", 2, 2**-20)),
)


def cases(moe: Sequence[tuple], dispatches: Sequence[str]) -> list[tuple]:
  """(shape, E, k, dispatch) of every row of the (shape, E, k) cases `moe`, the dense MLP of
  each (shape, k) first."""
  rows = [(shape, None, k, BASELINE) for shape, k in dict.fromkeys((s, k) for s, _, k in moe)]
  return rows + [(shape, e, k, d) for shape, e, k in moe for d in dispatches]


def main() -> None:
  parser = bench_utils.parser(__doc__, "moe_layer")
  parser.add_argument("--shape", default="cpu", choices=sorted(SHAPES))
  parser.add_argument("--experts", type=int, nargs="+", default=[4, 8, 32, 64])
  parser.add_argument("--top_k", type=int, nargs="+", default=[1, 2])
  parser.add_argument(
      "--cases",
      default="grid",
      choices=["grid", "vmoe"],
      help="grid: --shape x --experts x --top_k; vmoe: the three cases of the V-MoE comparison "
      f"{VMOE_CASES} (overrides --shape, --experts and --top_k)",
  )
  parser.add_argument(
      "--dispatch",
      nargs="+",
      default=[REFERENCE, *DISPATCH_ALGORITHMS],
      choices=[REFERENCE, *DISPATCH_ALGORITHMS],
      help="algorithms to time; the equal-FLOPs dense MLP baseline always runs",
  )
  parser.add_argument(
      "--peer-vmoe",
      default="",
      metavar="PATH",
      help="a google-research/vmoe checkout (the folder holding vmoe/, e.g. ../shared/peers/vmoe"
      " or a `fetch`ed snapshot): adds rows for vmoe's own router and dispatchers (vmoe_einsum, "
      "vmoe_indices) to every case, and vs_vmoe_best, each row's time over the faster of them",
  )
  parser.add_argument("--capacity_factor", type=float, default=1.25)
  parser.add_argument(
      "--repeats",
      type=int,
      default=10,
      help="timed calls per case, alternated between cases; 0 compiles only (memory)",
  )
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args()

  peer = import_peer_vmoe(args.peer_vmoe) if args.peer_vmoe else None
  moe = [(args.shape, e, k) for k in args.top_k for e in args.experts if k <= e]
  moe = VMOE_CASES if args.cases == "vmoe" else moe
  rows, runs = [], []
  for shape, e, k, dispatch in cases(moe, [*(PEER_ROWS if peer else []), *args.dispatch]):
    row, compiled, call_args = compile_case(
        shape, e, k, dispatch, args.dtype, args.capacity_factor, peer=peer
    )
    print(f"  {shape} E={e} k={k} {dispatch}: compiled in {row['compile_s']:.1f} s", flush=True)
    rows.append(row)
    runs.append((compiled, call_args))
  outputs, times = [None] * len(rows), [[]] * len(rows)
  if args.repeats > 0:  # 0: compile only, for memory figures of shapes too big to run here.
    calls = [functools.partial(compiled, *call_args) for compiled, call_args in runs]
    outputs, times = bench_utils.time_interleaved(calls, args.repeats)  # Alternated rounds.
  for row, output, t in zip(rows, outputs, times):
    row.update(time_ms=1e3 * statistics.median(t) if t else None)
    row.update(time_min_ms=1e3 * min(t) if t else None)
    row.update(fraction_dropped=float(output[0][1]) if output else None)  # The warm-up call's.
  add_ratios(rows)
  how = f"dtype {args.dtype}, capacity factor {args.capacity_factor}, median of {args.repeats}"
  bench_utils.finish(args, rows, COLUMNS, evaluate_targets(rows), f"{how} alternated calls")


if __name__ == "__main__":
  main()
