"""Markov-blanket constraint (causal_attn_jax.constraints): sums, bounds, Lagrangian, duals."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_attn_jax import constraints as C
from causal_attn_jax.layers import causal_mask, masked_softmax, padding_mask, sparse_mask

E = math.e


def _probs_and_mask(seed: int = 0, batch: int = 2, heads: int = 3, n: int = 6, causal: bool = True):
  """Random masked attention with padding (second sequence has 4 valid tokens)."""
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(batch, heads, n, n)) * 2.0, jnp.float32)
  lengths = np.array([n, 4])[:batch]
  valid = np.arange(n)[None, :] < lengths[:, None]
  mask = padding_mask(valid, valid)
  if causal:
    mask = mask & causal_mask(n)
  return masked_softmax(logits, mask), mask, valid


def _np_sums(probs: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  e = np.where(np.broadcast_to(mask, probs.shape), np.expm1(probs.astype(np.float64)), 0.0)
  return e.sum(-1), e.sum(-2)


@pytest.mark.parametrize("causal", [False, True])
def test_blanket_sums_match_float64_reference(causal):
  probs, mask, _ = _probs_and_mask(causal=causal)
  r, c = jax.jit(C.blanket_sums)(probs, mask)
  assert r.dtype == jnp.float32 and c.dtype == jnp.float32
  r_ref, c_ref = _np_sums(np.asarray(probs), np.asarray(mask))
  np.testing.assert_allclose(r, r_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(c, c_ref, rtol=1e-6, atol=1e-6)
  # Padded rows and columns contribute nothing, whatever their probabilities.
  np.testing.assert_array_equal(r[1, :, 4:], 0.0)
  np.testing.assert_array_equal(c[1, :, 4:], 0.0)
  # bfloat16 inputs are summed in float32.
  r16, _ = C.blanket_sums(probs.astype(jnp.bfloat16), mask)
  assert r16.dtype == jnp.float32


def test_bounds_are_reached_by_the_paper_configurations():
  lower, upper = C.BOUNDS.lower, C.BOUNDS.upper
  one_hot = jnp.array([[[[1.0, 0.0, 0.0, 0.0]]]])  # one parent
  halves = jnp.array([[[[0.5, 0.5, 0.0, 0.0]]]])  # two parents
  assert float(C.blanket_sums(one_hot, None)[0][0, 0, 0]) == pytest.approx(upper, rel=1e-6)
  assert float(C.blanket_sums(halves, None)[0][0, 0, 0]) == pytest.approx(lower, rel=1e-6)
  # tau - N form of Definition 1: N - 2 + 2 e^(1/2) and N - 1 + e, for any N.
  for n in (4, 9):
    assert lower == pytest.approx((n - 2 + 2 * math.sqrt(E)) - n)
    assert upper == pytest.approx((n - 1 + E) - n)
  # Any softmax row has r <= e - 1 (convexity), so row-upper never binds.
  rows = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (64, 7)) * 4.0, axis=-1)
  assert float(jnp.max(jnp.expm1(rows).sum(-1))) <= upper + 1e-6


def test_self_loop_thirds_and_slack_values():
  lower, upper = C.BOUNDS.lower, C.BOUNDS.upper
  # The slacks of the paper, as printed.
  assert (C.BOUNDS.slack_lower, C.BOUNDS.slack_upper) == (0.7045, 0.5062)
  # eps''_max = 0.5062 = 2 (e^(1/2) - e^(1/3)) = lower - 2 expm1(1/3): the shortfall of a row
  # whose two parents keep 1/3 each once a 1/3 self-loop is set (self entry not counted).
  assert round(2 * (math.sqrt(E) - E ** (1 / 3)), 4) == 0.5062
  assert round(lower - 2 * math.expm1(1 / 3), 4) == 0.5062
  # A doubly stochastic "self-loop 1/3 + two neighbours 1/3" graph (circulant, n = 5): every
  # row and column has r = c = 3 expm1(1/3) ~ 1.1868 < lower, within the encoder's relaxed
  # bounds but not the decoder's (no slack).
  n = 5
  a = np.zeros((n, n))
  for i in range(n):
    for j in (i - 1, i, i + 1):
      a[i, j % n] = 1 / 3
  probs = jnp.asarray(a, jnp.float32)[None, None]
  r, c = C.blanket_sums(probs, None)
  np.testing.assert_allclose(r, 3 * math.expm1(1 / 3), rtol=1e-6)
  np.testing.assert_allclose(c, 3 * math.expm1(1 / 3), rtol=1e-6)
  assert 3 * math.expm1(1 / 3) < lower
  enc = C.constraint_violations(probs, None, self_attention=True, decoder=False)
  np.testing.assert_array_equal(enc.violations, 0.0)
  assert float(enc.rows_within) == 1.0 and float(enc.cols_within) == 1.0
  cross = C.constraint_violations(probs, None, self_attention=False, decoder=False)
  np.testing.assert_allclose(cross.violations[0, 0], lower - 3 * math.expm1(1 / 3), rtol=1e-5)
  assert float(cross.rows_within) == 0.0
  # Encoder bounds are the paper's bounds relaxed by the slacks.
  enc_lo, enc_hi = C.BOUNDS.for_attention(self_attention=True, decoder=False)
  assert enc_lo == pytest.approx(lower - 0.7045) and enc_hi == pytest.approx(upper + 0.5062)
  assert C.BOUNDS.for_attention(self_attention=True, decoder=True) == (lower, upper)


def _np_violations(probs, mask, valid, lower, upper, decoder):
  """float64 reference: hinge means over valid rows / constrained columns and batch."""
  probs = np.asarray(probs, np.float64)
  b, h, n, _ = probs.shape
  allowed = np.broadcast_to(np.asarray(mask), probs.shape) & valid[:, None, :, None]
  allowed = allowed & valid[:, None, None, :]
  r, c = _np_sums(probs, allowed)
  out = np.zeros((h, 4))
  for head in range(h):
    rows = [(bi, i) for bi in range(b) for i in range(n) if allowed[bi, head, i].any()]
    cols = []
    for bi in range(b):
      for j in range(n):
        feeders = [i for i in range(n) if allowed[bi, head, i, j] and (not decoder or i != j)]
        if feeders:
          cols.append((bi, j))
    rv = np.array([r[bi, head, i] for bi, i in rows])
    cv = np.array([c[bi, head, j] for bi, j in cols])
    out[head] = [
        np.maximum(lower - rv, 0).mean(),
        np.maximum(rv - upper, 0).mean(),
        np.maximum(lower - cv, 0).mean(),
        np.maximum(cv - upper, 0).mean(),
    ]
  return out


@pytest.mark.parametrize("decoder", [False, True])
def test_violations_match_reference_with_padding(decoder):
  probs, mask, valid = _probs_and_mask(seed=1, causal=decoder)
  fn = jax.jit(functools.partial(C.constraint_violations, self_attention=True, decoder=decoder))
  stats = fn(probs, mask, valid_q=valid, valid_k=valid)
  lower, upper = C.BOUNDS.for_attention(self_attention=True, decoder=decoder)
  ref = _np_violations(probs, mask, valid, lower, upper, decoder)
  assert stats.violations.shape == (3, 4)
  np.testing.assert_allclose(stats.violations, ref, rtol=1e-5, atol=1e-6)
  assert 0.0 <= float(stats.rows_within) <= 1.0 and 0.0 <= float(stats.cols_within) <= 1.0


def test_decoder_excludes_exactly_the_columns_no_later_row_can_see():
  n = 6
  valid = np.array([[True] * 6, [True] * 4 + [False] * 2])
  mask = padding_mask(valid, valid) & causal_mask(n)
  # Uniform causal attention: column j of a length-m sequence gets sum_{i=j..m-1} expm1(1/(i+1)).
  probs = masked_softmax(jnp.zeros((2, 1, n, n)), mask)
  stats = C.constraint_violations(
      probs, mask, self_attention=True, decoder=True, valid_q=valid, valid_k=valid
  )
  lower = C.BOUNDS.lower
  expected = []
  for m, bi in ((6, 0), (4, 1)):
    for j in range(m - 1):  # the last valid column (j = m - 1) is excluded
      expected.append(max(lower - sum(math.expm1(1 / (i + 1)) for i in range(j, m)), 0.0))
  assert float(stats.violations[0, 2]) == pytest.approx(np.mean(expected), rel=1e-5)
  # With a local-block pattern ANDed in, the last column of every block is unsatisfiable too.
  block = sparse_mask("block", n, block_size=3) & causal_mask(n)
  probs = masked_softmax(jnp.zeros((1, 1, n, n)), block)
  chain = np.zeros((n, n))  # row i -> column i - 1 inside each block, block starts self-attend
  for i in range(n):
    chain[i, i - 1 if i % 3 else i] = 1.0
  stats = C.constraint_violations(
      jnp.asarray(chain)[None, None], block, self_attention=True, decoder=True
  )
  # Counted columns: 0, 1 (block 0) and 3, 4 (block 1). Column 0 gets rows 0 and 1 (2 (e - 1),
  # over the upper bound); 1 gets row 2; 3 gets rows 3, 4; 4 gets row 5.
  over = 2 * (E - 1) - (E - 1)
  assert float(stats.violations[0, 2]) == pytest.approx(0.0, abs=1e-6)
  assert float(stats.violations[0, 3]) == pytest.approx(2 * over / 4, rel=1e-5)
  assert float(stats.cols_within) == pytest.approx(0.5)


def test_lagrangian_gradient_matches_finite_differences():
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    n, heads = 5, 2
    # [2 "layers" (encoder, decoder), B, H, N, N] logits.
    logits0 = jnp.asarray(rng.normal(size=(2, 2, heads, n, n)) * 1.5, jnp.float64)
    valid = np.array([[True] * 5, [True] * 3 + [False] * 2])
    mask_enc = padding_mask(valid, valid)
    mask_dec = mask_enc & causal_mask(n)
    gammas = jnp.asarray(rng.uniform(0.5, 2.0, size=(2, heads, 4)), jnp.float64)

    def loss(logits):
      stats = [
          C.constraint_violations(
              masked_softmax(lg, m),
              m,
              self_attention=True,
              decoder=dec,
              valid_q=valid,
              valid_k=valid,
          )
          for lg, m, dec in ((logits[0], mask_enc, False), (logits[1], mask_dec, True))
      ]
      violations = jnp.stack([s.violations for s in stats])
      assert violations.dtype == jnp.float64
      return C.lagrangian_term(violations, gammas, penalty=0.7)

    f = jax.jit(loss)
    g = jax.jit(jax.grad(loss))(logits0)
    assert float(f(logits0)) > 0.0  # some hinge is active, so the test is not vacuous
    eps = 1e-6
    for ix in [(0, 0, 0, 1, 2), (0, 1, 1, 2, 0), (1, 0, 0, 3, 1), (1, 0, 1, 4, 4), (1, 1, 0, 2, 2)]:
      d = jnp.zeros_like(logits0).at[ix].set(eps)
      fd = (f(logits0 + d) - f(logits0 - d)) / (2 * eps)
      assert float(g[ix]) == pytest.approx(float(fd), rel=1e-5, abs=1e-9)
    # Masked (future) logits of the decoder get no gradient.
    assert float(jnp.abs(g[1, :, :, 0, 1:]).max()) == 0.0


def test_lagrangian_term_value():
  v = jnp.array([[[0.5, 0.0, 1.0, 2.0]]])
  gamma = jnp.array([[[1.0, 3.0, 0.0, 0.5]]])
  assert float(C.lagrangian_term(v, gamma)) == pytest.approx(1.5)
  assert float(C.lagrangian_term(v, gamma, penalty=2.0)) == pytest.approx(1.5 + 5.25)
  # Multipliers are not differentiated through.
  assert float(jnp.abs(jax.grad(lambda g: C.lagrangian_term(v, g))(gamma)).max()) == 0.0


def test_dual_update_is_projected_ascent():
  gamma = C.init_multipliers(2, 3)
  assert gamma.shape == (2, 3, 4) and gamma.dtype == jnp.float32
  v = jnp.zeros((2, 3, 4)).at[0, 1, 2].set(0.4).at[1, 0, 0].set(2.0)
  update = jax.jit(functools.partial(C.dual_update, step_size=0.5))
  g1 = update(gamma, v)
  assert float(g1[0, 1, 2]) == pytest.approx(0.2) and float(g1[1, 0, 0]) == pytest.approx(1.0)
  assert float(g1.sum()) == pytest.approx(1.2)  # satisfied constraints keep gamma = 0
  g2 = update(g1, v)
  assert bool(jnp.all(g2 >= g1)) and float(g2[1, 0, 0]) > float(g1[1, 0, 0])
  # Negative inputs (e.g. a signed residual) can never push gamma below zero.
  assert bool(jnp.all(update(g1, -10.0 * jnp.ones_like(v)) == 0.0))
  capped = C.dual_update(g2, v, step_size=10.0, penalty_cap=3.0)
  assert float(capped.max()) == 3.0 and float(capped.min()) == 0.0
  assert float(C.grow_penalty(4.0, factor=2.0, cap=5.0)) == 5.0
