r"""Forward+backward time and memory of one MoE layer, by dispatch algorithm, on this machine.

  python benchmarks/moe_layer.py --shape cpu                 # reduced shape, all E and k
  python benchmarks/moe_layer.py --shape deit_s --dtype bfloat16   # DeiT-S last block (accelerator)

Each case jits `jax.value_and_grad` of sum(y * cotangent) with respect to the tokens x, the
router kernel and the four expert weights, where y is the MoE layer output: float32 router
logits -> `route_from_logits` (softmax, top-k) -> `DISPATCH_ALGORITHMS[dispatch]` with capacity
`compute_capacity(S, E, k, capacity_factor)` per group (one group = one image). The baseline
`dense_mlp` is a single GELU MLP of hidden width k * H: what each token computes when routed to
k experts of hidden H, i.e. the same active FLOPs without any routing or dispatch.

Time: median of `--repeats` calls, each ended by `block_until_ready`, after compilation and one
warm-up call. Memory: the compiled executable's `memory_analysis()` (temp_size_in_bytes is the
scratch the step needs besides its arguments and outputs; available on CPU too) is the primary
figure. Where the device has `memory_stats()` its peak_bytes_in_use is recorded too, but it
cannot be reset between cases, so it is a running maximum over the cases run so far.

Prints a table and the issue's two targets evaluated on the rows, and writes JSON (default
benchmarks/results/moe_layer.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    ExpertWeights,
    compute_capacity,
    dispatch_and_combine_masks,
    sort_slot_plan,
)
from fairmoe_jax.moe.routers import route_from_logits

from bench_utils import flops, memory_analysis, write_results

SHAPES = {  # images (groups), tokens per image, dim, expert hidden width
    "deit_s": (256, 197, 384, 1536),
    "cpu": (32, 65, 128, 512),
}
BASELINE = "dense_mlp"
_INIT_STD = 0.02  # timm / DeiT linear init, also the router's


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return _INIT_STD * jax.random.normal(key, shape, jnp.float32)


def _moe_loss(dispatch: str, capacity: int, top_k: int) -> Callable[..., Any]:
  algorithm = DISPATCH_ALGORITHMS[dispatch]

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


def _dense_loss(x, weights, cotangent):
  w1, b1, w2, b2 = (w.astype(x.dtype) for w in weights)
  h = jax.nn.gelu(jnp.einsum("gsd,dh->gsh", x, w1) + b1, approximate=False)
  y = jnp.einsum("gsh,hd->gsd", h, w2) + b2
  return jnp.sum((y * cotangent).astype(jnp.float32)), jnp.zeros((), jnp.float32)


def _time_and_memory(loss: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> dict:
  """Compiles grad(loss) w.r.t. all but the last argument; times it; reads its memory."""
  step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args) - 1)), has_aux=True))
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  times, dropped = [], None
  if repeats > 0:  # repeats == 0: compile only, for memory figures of shapes too big to run here.
    (_, dropped), _ = jax.block_until_ready(compiled(*args))  # warm-up, excluded
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - t0)
  memory = memory_analysis(compiled)
  stats = jax.devices()[0].memory_stats() or {}
  return dict(
      time_ms=1e3 * statistics.median(times) if times else None,
      time_min_ms=1e3 * min(times) if times else None,
      compile_s=compile_s,
      fraction_dropped=float(dropped) if dropped is not None else None,
      flops=flops(compiled),
      peak_bytes_in_use_so_far=stats.get("peak_bytes_in_use"),
      **memory,
  )


# How each capacity algorithm represents "which token goes to which slot": einsum builds one-hot
# [G, S, E, C] dispatch and combine tensors, sort an index plan of [G, E * C] slots.
_DISPATCH_PLANS = {
    "einsum": lambda idx, gates, e, c: dispatch_and_combine_masks(
        idx, gates, num_experts=e, capacity=c
    ),
    "sort": lambda idx, gates, e, c: sort_slot_plan(idx, gates, num_experts=e, capacity=c),
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
  if memory is None:
    return None
  return int(memory.output_size_in_bytes + memory.temp_size_in_bytes)


def benchmark_case(
    shape: str,
    num_experts: int | None,
    top_k: int,
    dispatch: str,
    dtype: str,
    capacity_factor: float,
    repeats: int,
    seed: int = 0,
) -> dict:
  """One row: `dispatch` in DISPATCH_ALGORITHMS, or BASELINE (then num_experts is unused)."""
  groups, tokens, dim, hidden = SHAPES[shape]
  keys = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(keys[0], (groups, tokens, dim), jnp.float32).astype(dtype)
  cotangent = jax.random.normal(keys[1], (groups, tokens, dim), jnp.float32).astype(dtype)
  row = dict(
      shape=shape,
      groups=groups,
      tokens=tokens,
      dim=dim,
      hidden=hidden,
      num_experts=num_experts,
      top_k=top_k,
      dispatch=dispatch,
      dtype=dtype,
      capacity_factor=capacity_factor,
      capacity=None,
  )
  if dispatch == BASELINE:
    width = top_k * hidden
    weights = (
        _normal(keys[2], (dim, width)),
        jnp.zeros((width,), jnp.float32),
        _normal(keys[3], (width, dim)),
        jnp.zeros((dim,), jnp.float32),
    )
    row.update(_time_and_memory(_dense_loss, (x, weights, cotangent), repeats))
    return row
  capacity = compute_capacity(tokens, num_experts, top_k, capacity_factor)
  router = _normal(keys[2], (dim, num_experts))
  experts = ExpertWeights(
      w1=_normal(keys[3], (num_experts, dim, hidden)),
      b1=jnp.zeros((num_experts, hidden), jnp.float32),
      w2=_normal(keys[4], (num_experts, hidden, dim)),
      b2=jnp.zeros((num_experts, dim), jnp.float32),
  )
  row["capacity"] = capacity
  row["dispatch_plan_bytes"] = dispatch_plan_bytes(
      dispatch, groups, tokens, num_experts, top_k, capacity
  )
  loss = _moe_loss(dispatch, capacity, top_k)
  row.update(_time_and_memory(loss, (x, router, experts, cotangent), repeats))
  return row


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def add_ratios(rows: list[dict]) -> None:
  """vs_dense: time / the equal-FLOPs dense MLP's; vs_einsum_memory: temp / einsum's temp."""
  dense = {(r["shape"], r["top_k"]): r for r in rows if r["dispatch"] == BASELINE}
  einsum = {
      (r["shape"], r["num_experts"], r["top_k"]): r for r in rows if r["dispatch"] == "einsum"
  }
  for r in rows:
    d = dense.get((r["shape"], r["top_k"]))
    e = einsum.get((r["shape"], r["num_experts"], r["top_k"]))
    r["vs_dense"] = _ratio(r["time_ms"], d["time_ms"]) if d else None
    r["vs_einsum_memory"] = (
        _ratio(r["temp_size_in_bytes"], e["temp_size_in_bytes"])
        if e and r["dispatch"] != BASELINE
        else None
    )


def evaluate_targets(rows: list[dict]) -> list[dict]:
  """The issue's two targets, on whichever rows are present."""
  find = {(r["shape"], r["num_experts"], r["top_k"], r["dispatch"]): r for r in rows}
  targets = []
  for shape in dict.fromkeys(r["shape"] for r in rows):
    sort = find.get((shape, 8, 2, "sort"))
    if sort is not None and sort["vs_dense"] is not None:
      targets.append(
          dict(
              target="sort within 1.3x of equal-FLOPs dense at E=8,k=2",
              shape=shape,
              passed=sort["vs_dense"] <= 1.3,
              detail=f"sort/dense time = {sort['vs_dense']:.2f}x (target <= 1.30x)",
          )
      )
    for k in sorted({r["top_k"] for r in rows if r["shape"] == shape}):
      sort = find.get((shape, 64, k, "sort"))
      einsum = find.get((shape, 64, k, "einsum"))
      if sort is None or einsum is None:
        continue
      speedup = _ratio(einsum["time_ms"], sort["time_ms"])
      leaner = _ratio(einsum["temp_size_in_bytes"], sort["temp_size_in_bytes"])
      plan_leaner = _ratio(einsum.get("dispatch_plan_bytes"), sort.get("dispatch_plan_bytes"))
      passed = speedup is not None and plan_leaner is not None and speedup >= 2 and plan_leaner >= 4
      targets.append(
          dict(
              target="sort >= 2x faster and >= 4x leaner than einsum at E=64",
              shape=shape,
              top_k=k,
              passed=passed,
              detail=(
                  f"k={k}: einsum/sort time = {_fmt(speedup, 2)}x (target >= 2x), "
                  f"einsum/sort dispatch-plan memory = {_fmt(plan_leaner, 1)}x (target >= 4x; "
                  f"whole-layer scratch {_fmt(leaner, 2)}x)"
              ),
          )
      )
  return targets


def _fmt(value: Any, digits: int) -> str:
  if value is None:
    return "-"
  return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
  header = [
      "shape",
      "E",
      "k",
      "dispatch",
      "time_ms",
      "vs_dense",
      "temp_MB",
      "vs_einsum_memory",
      "plan_MB",
  ]
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for r in rows:
    temp = r["temp_size_in_bytes"]
    cells = [
        r["shape"],
        _fmt(r["num_experts"], 0),
        str(r["top_k"]),
        r["dispatch"],
        _fmt(r["time_ms"], 2),
        _fmt(r["vs_dense"], 2),
        _fmt(temp / 2**20 if temp is not None else None, 2),
        _fmt(r["vs_einsum_memory"], 2),
        _fmt(r["dispatch_plan_bytes"] / 2**20 if r.get("dispatch_plan_bytes") else None, 2),
    ]
    print("| " + " | ".join(cells) + " |")


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--shape", default="cpu", choices=sorted(SHAPES))
  parser.add_argument("--experts", type=int, nargs="+", default=[4, 8, 32, 64])
  parser.add_argument("--top_k", type=int, nargs="+", default=[1, 2])
  parser.add_argument(
      "--dispatch",
      nargs="+",
      default=list(DISPATCH_ALGORITHMS),
      choices=list(DISPATCH_ALGORITHMS),
      help="dispatch algorithms to time; the equal-FLOPs dense MLP baseline always runs",
  )
  parser.add_argument("--capacity_factor", type=float, default=1.25)
  parser.add_argument(
      "--repeats", type=int, default=10, help="timed calls per case; 0 compiles only (memory)"
  )
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument(
      "--output", default=os.path.join(os.path.dirname(__file__), "results", "moe_layer.json")
  )
  args = parser.parse_args()

  rows = []
  for k in args.top_k:
    cases = [(None, BASELINE)] + [(e, d) for e in args.experts for d in args.dispatch]
    for e, dispatch in cases:
      if e is not None and k > e:
        continue
      row = benchmark_case(
          args.shape, e, k, dispatch, args.dtype, args.capacity_factor, args.repeats
      )
      print(
          f"  {args.shape} E={e} k={k} {dispatch}: {_fmt(row['time_ms'], 2)} ms, "
          f"compile {row['compile_s']:.1f} s",
          flush=True,
      )
      rows.append(row)
  add_ratios(rows)
  device = jax.devices()[0]
  print(
      f"\ndevice: {device.device_kind} ({device.platform}), JAX {jax.__version__}, "
      f"dtype {args.dtype}, capacity factor {args.capacity_factor}, median of {args.repeats}"
  )
  print_table(rows)
  targets = evaluate_targets(rows)
  if targets:
    print()
    for t in targets:
      print(f"[{'PASS' if t['passed'] else 'FAIL'}] {t['target']} ({t['shape']}): {t['detail']}")
    if device.platform == "cpu":
      print("note: CPU figures do not decide the GPU targets; run --shape deit_s on a GPU.")
  write_results(args.output, args, rows, targets)


if __name__ == "__main__":
  main()
