"""`dropless` on TPU: megablox's grouped-matmul kernels (`moe_dropless(matmul="megablox")`).

The kernels run here in Pallas' interpret mode (`interpret=True`), on CPU. Values and gradients
(tokens, gates and the four expert weights) are checked against the dense oracle `moe_dense` and
a float64 NumPy reference, top-2 of 4 experts with uneven loads: one expert takes most choices
and one none. Tolerances come from the computation: a float error bound relative to the same
computation on absolute values (`_reference(absolute=True)`, see `_bound`).

Beside them: `matmul="auto"` lowers the kernels for a TPU and `ragged_dot` for CPU and GPU.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from fairmoe_jax.moe.dispatch import ExpertWeights, moe_dense, moe_dropless
from fairmoe_jax.moe.dispatch import dropless as dropless_module

# 2 images x 7 tokens, top-2: 28 rows, not a multiple of a row tile (padding is exercised).
G, S, D, H, E, K = 2, 7, 8, 16, 4, 2
# The largest |GELU'(x)| (at x = +-sqrt(2)): the factor by which GELU can grow an error.
GELU_SLOPE = 1.13

pytestmark = [
    pytest.mark.skipif(
        dropless_module._megablox_kernels() is None,  # pylint: disable=protected-access
        reason="this jax has no jax.experimental.pallas.ops.tpu.megablox",
    ),
    # Checked against float64 at float32's rounding (tests/conftest.py).
    pytest.mark.float32_reference,
]


def _routing(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Distinct top-2 experts per token: expert 0 takes most choices, 1 and 2 fewer, 3 none."""
  rng = np.random.default_rng(seed)
  pairs = np.array([(0, 1), (0, 2), (1, 0), (0, 1), (2, 0), (0, 1), (1, 2)] * 2, np.int32)
  index = rng.permutation(pairs).reshape(G, S, K)
  gates = rng.uniform(0.1, 1.0, size=(G, S, K)).astype(np.float32)
  np.testing.assert_array_equal(np.bincount(index.ravel(), minlength=E), [12, 10, 6, 0])
  return index, gates


def _inputs(seed: int = 1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(G, S, D)).astype(np.float32)
  shapes = [(E, D, H), (E, H), (E, H, D), (E, D)]
  experts = [(0.3 * rng.normal(size=s)).astype(np.float32) for s in shapes]
  cotangent = rng.normal(size=(G, S, D)).astype(np.float32)
  return x, experts, cotangent


def _reference(x, index, gates, experts, cotangent, absolute=False):
  """Float64 NumPy: y and the gradients of sum(y * cotangent) w.r.t. x, gates, w1, b1, w2, b2.

  With `absolute`, every operand is replaced by its absolute value, GELU by the identity
  (|GELU(p)| <= |p|) and GELU' by its bound `GELU_SLOPE`: each result is then the sum of the
  magnitudes of the terms that make up the true one (its "condition" magnitude), which bounds
  the rounding error of any order of summation (`_bound`).
  """
  f = np.abs if absolute else (lambda a: a)
  x, gates, cotangent = (f(np.asarray(a, np.float64)) for a in (x, gates, cotangent))
  w1, b1, w2, b2 = (f(np.asarray(a, np.float64)) for a in experts)
  tokens = x.reshape(-1, D)
  flat_index, flat_gates = index.reshape(-1, K), gates.reshape(-1, K)
  d_y = cotangent.reshape(-1, D)
  y, d_x, d_gates = np.zeros_like(tokens), np.zeros_like(tokens), np.zeros_like(flat_gates)
  grads = [np.zeros_like(a) for a in (w1, b1, w2, b2)]
  for t in range(tokens.shape[0]):
    for j in range(K):
      e, g = flat_index[t, j], flat_gates[t, j]
      pre = tokens[t] @ w1[e] + b1[e]
      if absolute:
        h, slope = pre, GELU_SLOPE
      else:
        cdf = 0.5 * (1.0 + scipy.special.erf(pre / np.sqrt(2.0)))
        h, slope = pre * cdf, cdf + pre * np.exp(-0.5 * pre**2) / np.sqrt(2.0 * np.pi)
      out = h @ w2[e] + b2[e]
      y[t] += g * out
      d_gates[t, j] = out @ d_y[t]
      d_out = g * d_y[t]
      d_pre = (w2[e] @ d_out) * slope
      d_x[t] += w1[e] @ d_pre
      for grad, value in zip(grads, (np.outer(tokens[t], d_pre), d_pre, np.outer(h, d_out), d_out)):
        grad[e] += value
  return [y.reshape(G, S, D), d_x.reshape(G, S, D), d_gates.reshape(G, S, K), *grads]


def _bound(magnitude: np.ndarray, unit_roundoff: float, roundings: float) -> np.ndarray:
  """|computed - exact| <= roundings * u * magnitude (first order): every rounding of a partial
  sum or product changes it by at most u times its magnitude, and each result goes through at
  most `roundings` of them along any path from the inputs. A tiny absolute floor covers results
  whose terms all vanish (the empty expert's gradients are exactly 0 either way)."""
  return roundings * unit_roundoff * magnitude + 1e-30


def _value_and_grads(algorithm, x, index, gates, experts, cotangent, dtype):
  """y and the gradients of sum(y * cotangent) w.r.t. x, gates and the four expert weights."""

  def loss(x, gates, experts):
    y, stats = algorithm(x.astype(dtype), index, gates, experts)
    return jnp.sum(y.astype(jnp.float32) * cotangent), (y, stats)

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, (y, stats)), (d_x, d_gates, d_experts) = grad_fn(x, gates, ExpertWeights(*experts))
  assert bool(np.all(stats.kept)) and float(stats.fraction_dropped) == 0.0
  results = [y, d_x, d_gates, d_experts.w1, d_experts.b1, d_experts.w2, d_experts.b2]
  return [np.asarray(a, np.float64) for a in results]


NAMES = ("y", "d_x", "d_gates", "d_w1", "d_b1", "d_w2", "d_b2")
MEGABLOX = functools.partial(moe_dropless, matmul="megablox", interpret=True)
# Row tiles of 8 rows and 8-wide feature tiles: several row tiles, experts starting inside a
# tile, and two tiles over H (the default tiling has one row tile of 32 at these shapes).
MEGABLOX_SMALL_TILES = functools.partial(MEGABLOX, tiling=(8, 8, 8))


@pytest.mark.parametrize("name", ["default_tiles", "small_tiles"])
def test_megablox_float32_matches_dense_and_float64(name):
  """Float32: within the float32 rounding bound of the float64 reference, as the oracle is.

  Along any path a result is rounded at most D + H + G S K times (a row of W1, a row of W2,
  the sum of a weight gradient over an expert's rows, at most G S K) plus a few elementwise
  roundings (biases, GELU, the gates): 2 (D + H + G S K) roundings of u = 2^-24 is generous
  and still 1e-5 of the magnitude at most.
  """
  algorithm = {"default_tiles": MEGABLOX, "small_tiles": MEGABLOX_SMALL_TILES}[name]
  index, gates = _routing()
  x, experts, cotangent = _inputs()
  exact = _reference(x, index, gates, experts, cotangent)
  magnitude = _reference(x, index, gates, experts, cotangent, absolute=True)
  roundings = 2 * (D + H + G * S * K)
  got = _value_and_grads(algorithm, x, index, gates, experts, cotangent, jnp.float32)
  oracle = _value_and_grads(moe_dense, x, index, gates, experts, cotangent, jnp.float32)
  for what, g, o, e, m in zip(NAMES, got, oracle, exact, magnitude):
    bound = _bound(m, 2.0**-24, roundings)
    assert np.all(np.abs(o - e) <= bound), f"the oracle's {what} is off its own bound"
    assert np.all(np.abs(g - e) <= bound), (what, np.max(np.abs(g - e) / bound))
    np.testing.assert_allclose(g, o, rtol=0, atol=2 * bound.max(), err_msg=what)
  # The expert nobody chose gets exactly zero gradient.
  for what, g in zip(NAMES[3:], got[3:]):
    np.testing.assert_array_equal(g[3], 0.0, err_msg=what)


def test_megablox_bfloat16_matches_dense_and_float64():
  """Bfloat16 tokens (float32 weights cast in the layer, float32 accumulation in the kernels).

  The reference is float64 on the bfloat16-rounded tokens and weights, so only the computation's
  roundings count. They are bfloat16 roundings (u = 2^-8) of intermediate results and the
  cotangent, each relative to the magnitude: the matmul outputs, GELU computed in bfloat16 (a
  few ulps), the expert output, and y; backwards the cotangent, d_h, d_pre and d_x. At most
  about 6 along any path: the bound takes 8 (about 3% of the magnitude), the sums themselves
  being float32 (negligible at u = 2^-24). The oracle `moe_dense` rounds its operands to
  bfloat16 as well and is held to the same bound.
  """
  index, gates = _routing()
  x, experts, cotangent = _inputs()

  def rounded(a):
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))

  exact = _reference(rounded(x), index, gates, [rounded(w) for w in experts], cotangent)
  magnitude = _reference(
      rounded(x), index, gates, [rounded(w) for w in experts], cotangent, absolute=True
  )
  got = _value_and_grads(MEGABLOX, x, index, gates, experts, cotangent, jnp.bfloat16)
  oracle = _value_and_grads(moe_dense, x, index, gates, experts, cotangent, jnp.bfloat16)
  for what, g, o, e, m in zip(NAMES, got, oracle, exact, magnitude):
    bound = _bound(m, 2.0**-8, 8)
    assert np.all(np.abs(o - e) <= bound), f"the oracle's {what} is off its own bound"
    assert np.all(np.abs(g - e) <= bound), (what, np.max(np.abs(g - e) / bound))
  for what, g in zip(NAMES[3:], got[3:]):
    np.testing.assert_array_equal(g[3], 0.0, err_msg=what)


def test_megablox_weight_gradients_stay_float32():
  """The weight gradients come back in the weights' dtype (float32), summed in float32: not
  rounded to the bfloat16 compute dtype (whose 8 bits would leave most of them on a grid of
  2^-8 relative steps)."""
  index, gates = _routing()
  x, experts, cotangent = _inputs()
  got = _value_and_grads(MEGABLOX, x, index, gates, experts, cotangent, jnp.bfloat16)
  d_w1 = got[3].astype(np.float32)
  as_bf16 = np.asarray(jnp.asarray(d_w1).astype(jnp.bfloat16).astype(jnp.float32))
  assert np.mean(d_w1 != as_bf16) > 0.5


@pytest.mark.parametrize(
    ("matmul", "experts_vary"), [("megablox", False), ("megablox", True), ("auto", True)]
)
def test_inside_shard_map_each_device_on_its_own_groups(matmul, experts_vary):
  """Under `jax.shard_map(check_vma=True)`, each of 2 devices on its own group: the kernels'
  outputs are typed as varying like their inputs, and the gradients equal the whole batch's.

  With replicated experts the kernels' weight gradients are summed over the devices by the
  custom VJP; with experts marked varying (as `data_parallel.py` does) by the transpose of that
  mark. `auto` traces the TPU branch too, which must type-check on any platform.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  spec = jax.sharding.PartitionSpec("data")
  index, gates = _routing()
  x, experts, cotangent = _inputs()
  algorithm = functools.partial(moe_dropless, matmul=matmul, interpret=True)

  def body(x, index, gates, experts):
    if experts_vary:
      experts = jax.tree.map(lambda w: jax.lax.pcast(w, ("data",), to="varying"), experts)
    return algorithm(x, index, gates, experts)[0]

  layer = jax.shard_map(
      body, mesh=mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()), out_specs=spec
  )

  def sharded(x, index, gates, experts):
    y = layer(x, index, gates, experts)
    return y, dropless_module.dropless_stats(index, E)

  exact = _reference(x, index, gates, experts, cotangent)
  magnitude = _reference(x, index, gates, experts, cotangent, absolute=True)
  got = _value_and_grads(sharded, x, index, gates, experts, cotangent, jnp.float32)
  for what, g, e, m in zip(NAMES, got, exact, magnitude):
    bound = _bound(m, 2.0**-24, 2 * (D + H + G * S * K) + 2)
    assert np.all(np.abs(g - e) <= bound), (what, np.max(np.abs(g - e) / bound))


def _lowered_text(matmul: str, platform: str) -> str:
  index, gates = map(jnp.asarray, _routing())
  x = jax.ShapeDtypeStruct((G, S, 128), jnp.float32)
  experts = ExpertWeights(
      jax.ShapeDtypeStruct((E, 128, 256), jnp.float32),
      jax.ShapeDtypeStruct((E, 256), jnp.float32),
      jax.ShapeDtypeStruct((E, 256, 128), jnp.float32),
      jax.ShapeDtypeStruct((E, 128), jnp.float32),
  )

  def loss(x, experts):
    return jnp.sum(moe_dropless(x, index, gates, experts, matmul=matmul)[0])

  traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, experts)
  try:
    return traced.lower(lowering_platforms=(platform,)).as_text()
  except TypeError as e:  # A jax whose `lower` takes no platforms.
    pytest.skip(f"no cross-platform lowering in this jax: {e}")


@pytest.mark.parametrize(("platform", "kernels"), [("tpu", True), ("cpu", False), ("cuda", False)])
def test_auto_picks_megablox_where_lowered_for_tpu(platform, kernels):
  """`auto` decides by the platform the step is lowered for, not where Python runs: a TPU gets
  the Pallas kernels (Mosaic custom calls) forward and backward, CPU and GPU `ragged_dot`."""
  text = _lowered_text("auto", platform)
  assert ("tpu_custom_call" in text) == kernels
  if kernels:
    # Backwards `gmm` and `tgmm` for each layer, and the first layer's forward `gmm` (the second
    # one's output is not needed for the gradients of x and the weights); no `ragged_dot` left.
    assert text.count("tpu_custom_call") >= 5 and "ragged_dot" not in text
  if platform == "cuda":  # XLA's CPU lowering expands ragged_dot; the GPU's keeps the op.
    assert "ragged_dot" in text


def test_auto_says_once_where_the_kernels_cannot_run(monkeypatch, caplog):
  """Where megablox cannot run (here as if this jax lacked shard_map's check switch), `auto`
  lowers `ragged_dot` for a TPU too, and says so once: the dispatch, the platform, the cost."""
  monkeypatch.setattr(dropless_module.spmd, "kernels_can_run", lambda *values, report: False)
  monkeypatch.setattr(dropless_module.spmd, "FALLBACKS", [])
  with caplog.at_level(logging.WARNING):
    texts = [_lowered_text("auto", "tpu") for _ in range(2)]
  assert not any("tpu_custom_call" in text for text in texts)
  notes = [r.getMessage() for r in caplog.records if "dropless" in r.getMessage()]
  assert len(notes) == 1 and "\n" not in notes[0], notes
  assert "on a TPU" in notes[0] and f"{E} times the expert FLOPs" in notes[0]
  assert dropless_module.spmd.FALLBACKS == [notes[0].removeprefix("fall-back: ")]  # run_info.json


def test_auto_keeps_ragged_dot_where_megablox_does_not_fit():
  """Widths that are neither at most 128 nor multiples of 128 have no TPU tile: `ragged_dot`."""
  assert dropless_module.megablox_fits(jnp.bfloat16, 384, 1536)
  assert dropless_module.megablox_fits(jnp.float32, 32, 64)
  assert not dropless_module.megablox_fits(jnp.float32, 384, 200)
  assert not dropless_module.megablox_fits(jnp.float16, 384, 1536)


def test_tiles():
  """Row tiles near an expert's load in [128, 512]; width tiles as wide as VMEM allows, the
  reduction tile shrinking first (the DeiT-S widths of `benchmarks/dispatch_compile.py`)."""
  row_tile, width_tiles = dropless_module.row_tile, dropless_module.width_tiles
  assert row_tile(28, 4) == 32  # Fewer rows than a tile: all of them, rounded up to 16.
  assert row_tile(12608, 4) == 512 and row_tile(12608, 64) == 128
  assert width_tiles(128, 384, 1536) == (384, 1536)  # Whole widths: the rows are read once.
  assert width_tiles(512, 384, 1536) == (128, 1536)
  assert width_tiles(512, 1536, 384) == (768, 384)
  assert width_tiles(32, 8, 16) == (8, 16)
  for tm, k, n in [(512, 384, 1536), (512, 1536, 384), (512, 4096, 4096), (128, 1024, 4096)]:
    tk, tn = width_tiles(tm, k, n)
    assert k % tk == 0 and n % tn == 0 and tk % 128 == 0 and tn % 128 == 0
    assert dropless_module._vmem_bytes(tm, tk, tn) <= dropless_module.VMEM_BUDGET  # pylint: disable=protected-access


def test_unknown_matmul_is_an_error():
  index, gates = _routing()
  x, experts, _ = _inputs()
  with pytest.raises(ValueError, match="matmul"):
    moe_dropless(jnp.asarray(x), index, gates, ExpertWeights(*experts), matmul="pallas")
