r"""Forward+backward time and memory of one attention layer: causal (GCN updater) vs vanilla.

  python benchmarks/attention.py                                    # N in {128, 256, 512, 2048}
  python benchmarks/attention.py --dtype bfloat16                   # accelerator
  python benchmarks/attention.py --lengths 128 256 512 --repeats 3  # CPU-sized
  python benchmarks/attention.py --lengths 2048 --repeats 0         # compile only (memory)

One `MultiHeadAttention` (the paper's NMT shape by default), `jax.value_and_grad` of
sum(y * cotangent): "vanilla" softmax attention; "causal" the Eq. 4 GCN updater plus the
Markov-blanket term of Eq. 6 as a training step computes it (`--decoder`: causal mask and the
decoder rules; `CASE`'s multiplier and penalty); "causal_unconstrained"
(`--kinds`) the updater alone. Time: median of `--repeats` calls after a warm-up; memory: the
executable's temp_size_in_bytes. Prints a table and the target (causal at most 1.15x vanilla at
N=256 on GPU); writes JSON (default benchmarks/results/attention.json).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import bench_utils
from bench_utils import fmt, memory_analysis, ratio, time_interleaved
from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax.layers.attention import MultiHeadAttention

KINDS = ("vanilla", "causal", "causal_unconstrained")
BASELINE = "vanilla"
TARGET_LENGTH = 256
TARGET_RATIO = 1.15
# The paper's NMT layer; every Lagrange multiplier 1, no augmented-Lagrangian penalty.
CASE = dict(batch=8, dim=512, heads=8, gcn_hops=1, multiplier=1.0, penalty=0.0)


def _make_loss(
    graphdef: Any, kind: str, decoder: bool, n: int, multipliers: jax.Array, penalty: float
):
  """loss(params, x, cotangent) -> (loss, (rows_within, cols_within)) for one case."""
  mask = jnp.tril(jnp.ones((n, n), bool))[None, None] if decoder else None
  constrained = kind == "causal"

  def loss(params, x, cotangent):
    layer = nnx.merge(graphdef, params)
    y, probs = layer(x, mask=mask)
    value = jnp.sum((y * cotangent).astype(jnp.float32))
    if not constrained:
      return value, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    stats = constraints_lib.constraint_violations(probs, mask, decoder=decoder)
    term = constraints_lib.lagrangian_term(stats.violations, multipliers, penalty=penalty)
    return value + term, (stats.rows_within, stats.cols_within)

  return loss


def benchmark_case(n: int, kind: str, *, dtype: str, decoder: bool, repeats: int) -> dict:
  """One row: `CASE`'s layer of `kind` at length `n`, compiled and timed."""
  batch, dim, heads, gcn_hops, multiplier, penalty = CASE.values()  # In CASE's order.
  seed = 0
  layer = MultiHeadAttention(
      dim,
      heads,
      kind="vanilla" if kind == BASELINE else "causal",
      gcn_hops=gcn_hops,
      dtype=jnp.dtype(dtype),
      rngs=nnx.Rngs(seed),
  )
  graphdef, params = nnx.split(layer)
  keys = jax.random.split(jax.random.key(seed + 1), 2)
  x = jax.random.normal(keys[0], (batch, n, dim), jnp.float32).astype(dtype)
  cotangent = jax.random.normal(keys[1], (batch, n, dim), jnp.float32).astype(dtype)
  multipliers = jnp.full((heads, len(constraints_lib.DEFAULT_SPEC.names)), multiplier, jnp.float32)
  loss = _make_loss(graphdef, kind, decoder, n, multipliers, penalty)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  t0 = time.perf_counter()
  compiled = step.lower(params, x, cotangent).compile()
  compile_s = time.perf_counter() - t0
  times, aux = [], None
  if repeats > 0:  # repeats == 0: compile only, for memory figures of shapes too big to run here.
    call = lambda: compiled(params, x, cotangent)  # noqa: E731
    [((_, aux), _)], [times] = time_interleaved([call], repeats)  # After a warm-up call.
  stats = jax.devices()[0].memory_stats() or {}
  constrained = kind == "causal" and aux is not None
  causal = kind == "causal"
  row = dict(n=n, kind=kind, batch=batch, dim=dim, heads=heads, head_dim=dim // heads)
  row.update(gcn_hops=gcn_hops if kind != BASELINE else None, dtype=dtype, decoder=decoder)
  row.update(multiplier=multiplier if causal else None, penalty=penalty if causal else None)
  row.update(time_ms=1e3 * statistics.median(times) if times else None)
  row.update(time_min_ms=1e3 * min(times) if times else None, compile_s=compile_s)
  row.update(rows_within=float(aux[0]) if constrained else None)
  row.update(cols_within=float(aux[1]) if constrained else None)
  row.update(flops=bench_utils.cost(compiled, "flops"))
  row.update(peak_bytes_in_use_so_far=stats.get("peak_bytes_in_use"))
  return dict(row, **memory_analysis(compiled))


def add_ratios(rows: list[dict]) -> None:
  """vs_vanilla: time / vanilla's time; vs_vanilla_memory: temp / vanilla's temp (same N)."""
  vanilla = {r["n"]: r for r in rows if r["kind"] == BASELINE}
  for r in rows:
    v = vanilla.get(r["n"])
    r["vs_vanilla"] = ratio(r["time_ms"], v["time_ms"]) if v else None
    r["vs_vanilla_memory"] = ratio(r["temp_size_in_bytes"], v["temp_size_in_bytes"]) if v else None


def evaluate_targets(rows: list[dict]) -> list[dict]:
  """The speed target (causal at most TARGET_RATIO x vanilla at N=TARGET_LENGTH), on the rows."""
  ratios = [r["vs_vanilla"] for r in rows if (r["n"], r["kind"]) == (TARGET_LENGTH, "causal")]
  if not ratios or ratios[-1] is None:
    return []
  target = f"causal at most {TARGET_RATIO}x vanilla at N={TARGET_LENGTH} on GPU"
  detail = f"causal/vanilla time = {ratios[-1]:.2f}x (target <= {TARGET_RATIO:.2f}x)"
  return [dict(target=target, passed=ratios[-1] <= TARGET_RATIO, detail=detail)]


# The printed table's columns: (heading, key, digits, scale).
COLUMNS = (
    *(("N", "n"), ("kind", "kind"), ("time_ms", "time_ms", 2), ("vs_vanilla", "vs_vanilla", 2)),
    *(("temp_MB", "temp_size_in_bytes", 2, 2**-20), ("vs_vanilla_memory", "vs_vanilla_memory", 2)),
)


def main() -> None:
  parser = bench_utils.parser(__doc__, "attention")
  parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 2048])
  parser.add_argument(
      "--kinds",
      nargs="+",
      default=["vanilla", "causal"],
      choices=KINDS,
      help="vanilla always runs (it is the baseline of vs_vanilla)",
  )
  parser.add_argument(
      "--decoder",
      action="store_true",
      help="causal mask and decoder constraint rules (default: encoder self-attention)",
  )
  parser.add_argument(
      "--repeats", type=int, default=10, help="timed calls per case; 0 compiles only (memory)"
  )
  parser.add_argument(
      "--compile_only_above",
      type=int,
      default=0,
      help="lengths above this are compiled only (memory, no time); 0 = time every length",
  )
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args()

  kinds = [BASELINE] + [k for k in dict.fromkeys(args.kinds) if k != BASELINE]
  rows = []
  for n in args.lengths:
    repeats = 0 if args.compile_only_above and n > args.compile_only_above else args.repeats
    for kind in kinds:
      row = benchmark_case(n, kind, repeats=repeats, dtype=args.dtype, decoder=args.decoder)
      print(
          f"  N={n} {kind}: {fmt(row['time_ms'], 2)} ms, compile {row['compile_s']:.1f} s",
          flush=True,
      )
      rows.append(row)
  add_ratios(rows)
  if jax.devices()[0].platform == "cpu":
    print(f"note: CPU figures do not decide the GPU target; run on a GPU (N={TARGET_LENGTH} row).")
  how = (
      f"dtype {args.dtype}, B {CASE['batch']}, D {CASE['dim']}, H {CASE['heads']}, "
      f"gcn_hops {CASE['gcn_hops']}, {'decoder' if args.decoder else 'encoder'} self-attention, "
      f"multipliers {CASE['multiplier']}, median of {args.repeats}"
  )
  bench_utils.finish(args, rows, COLUMNS, evaluate_targets(rows), how)


if __name__ == "__main__":
  main()
