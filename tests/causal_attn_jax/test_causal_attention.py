"""Causal GCN attention and baselines (causal_attn_jax.layers): masks, kinds, GCN, KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from causal_attn_jax.layers.attention import MultiHeadAttention, masked_softmax, sinkhorn_softmax
from causal_attn_jax.layers.masks import ATTENTION_KINDS, causal_mask, padding_mask, sparse_mask

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

DIM, HEADS = 8, 2


def _pattern(kind: str, n: int, **kw) -> np.ndarray:
  m = np.asarray(sparse_mask(kind, n, **kw))
  assert m.shape == (1, 1, n, n) and m.dtype == bool
  return m[0, 0].astype(int)


def test_padding_and_causal_masks():
  valid_q = np.array([[True, True, False]])
  valid_k = np.array([[True, False, True, True]])
  m = np.asarray(padding_mask(valid_q, valid_k))
  assert m.shape == (1, 1, 3, 4)
  np.testing.assert_array_equal(m[0, 0], [[1, 0, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(causal_mask(3))[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_sparse_patterns_by_hand():
  band = [
      [1, 1, 0, 0, 0, 0],
      [1, 1, 1, 0, 0, 0],
      [0, 1, 1, 1, 0, 0],
      [0, 0, 1, 1, 1, 0],
      [0, 0, 0, 1, 1, 1],
      [0, 0, 0, 0, 1, 1],
  ]
  np.testing.assert_array_equal(_pattern("band", 6, band_width=1), band)
  dilated = [
      [1, 0, 1, 0, 0, 0],
      [0, 1, 0, 1, 0, 0],
      [1, 0, 1, 0, 1, 0],
      [0, 1, 0, 1, 0, 1],
      [0, 0, 1, 0, 1, 0],
      [0, 0, 0, 1, 0, 1],
  ]
  np.testing.assert_array_equal(_pattern("dilated", 6, band_width=1, dilation=2), dilated)
  block = [
      [1, 1, 0, 0, 0, 0],
      [1, 1, 0, 0, 0, 0],
      [0, 0, 1, 1, 0, 0],
      [0, 0, 1, 1, 0, 0],
      [0, 0, 0, 0, 1, 1],
      [0, 0, 0, 0, 1, 1],
  ]
  np.testing.assert_array_equal(_pattern("block", 6, block_size=2), block)
  # Random: the diagonal plus num_random distinct keys per row, fixed by the seed.
  rnd = _pattern("random", 8, num_random=2, seed=5)
  assert np.all(np.diag(rnd) == 1)
  off = rnd.sum(1)
  assert np.all((off >= 2) & (off <= 3))
  np.testing.assert_array_equal(rnd, _pattern("random", 8, num_random=2, seed=5))
  assert not np.array_equal(rnd, _pattern("random", 8, num_random=2, seed=6))
  with pytest.raises(ValueError):
    sparse_mask("strided", 4)


def _inputs(n: int = 6, batch: int = 2):
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, n, DIM))
  valid = np.arange(n)[None, :] < np.array([n, n - 2])[:, None]
  return x, valid


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_every_kind_runs_under_jit_with_padding(kind):
  x, valid = _inputs()
  model = MultiHeadAttention(DIM, HEADS, kind=kind, rngs=nnx.Rngs(0), band_width=1, block_size=3)
  mask = padding_mask(valid, valid)

  @nnx.jit
  def fwd(model, x, mask):
    return model(x, mask=mask)

  out, probs = fwd(model, x, mask)
  assert out.shape == x.shape and probs.shape == (2, HEADS, 6, 6)
  assert probs.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
  row_sums = np.asarray(probs.sum(-1))
  np.testing.assert_allclose(row_sums[0], 1.0, rtol=1e-5)
  np.testing.assert_allclose(row_sums[1, :, :4], 1.0, rtol=1e-5)
  np.testing.assert_array_equal(row_sums[1, :, 4:], 0.0)  # padded queries attend nowhere
  np.testing.assert_array_equal(np.asarray(probs)[1, :, :, 4:], 0.0)  # nor to padded keys
  if kind in ("band", "block"):
    allowed = np.asarray(sparse_mask(kind, 6, band_width=1, block_size=3))[0, 0]
    assert np.all(np.asarray(probs)[:, :, ~allowed] == 0.0)
  # Real tokens do not see padding: changing padded inputs leaves them unchanged.
  x2 = x.at[1, 4:].set(100.0)
  out2, _ = fwd(model, x2, mask)
  np.testing.assert_allclose(out2[1, :4], out[1, :4], rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_keeps_float32_probabilities():
  x, valid = _inputs()
  model = MultiHeadAttention(DIM, HEADS, kind="causal", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  out, probs = nnx.jit(lambda m, x: m(x, mask=padding_mask(valid, valid)))(model, x)
  assert out.dtype == jnp.bfloat16 and probs.dtype == jnp.float32


def _np_gcn_one_head(model: MultiHeadAttention, x: np.ndarray, hops: int) -> np.ndarray:
  """float64 numpy Eq. 4 (hops=1) / Kipf two-layer GCN (hops=2) for one head, no mask."""
  p = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
  relu = lambda v: np.maximum(v, 0.0)  # noqa: E731
  q = x @ p(model.query.kernel) + p(model.query.bias)
  k = x @ p(model.key.kernel) + p(model.key.bias)
  logits = q @ k.T / np.sqrt(q.shape[-1])
  a = np.exp(logits - logits.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  xw0 = x @ p(model.gcn_in.kernel)
  w1 = p(model.gcn_hidden)[0]
  h = relu(a @ relu(xw0) @ w1) if hops == 1 else relu(a @ relu(a @ xw0) @ w1)
  return h @ p(model.out.kernel) + p(model.out.bias)


def test_gcn_hops_match_numpy_reference_and_differ():
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (5, DIM)), np.float64)
  outs = {}
  for hops in (1, 2):
    model = MultiHeadAttention(DIM, 1, kind="causal", gcn_hops=hops, rngs=nnx.Rngs(0))
    out, _ = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x, jnp.float32)[None])
    ref = _np_gcn_one_head(model, x, hops)
    np.testing.assert_allclose(out[0], ref, rtol=1e-4, atol=1e-5)
    outs[hops] = np.asarray(out[0])
  # Same parameters (same seed), different propagation.
  assert np.abs(outs[1] - outs[2]).max() > 1e-3


@pytest.mark.parametrize("kind, hops", [("causal", 1), ("causal", 2), ("vanilla", 1), ("band", 1)])
def test_decode_with_cache_equals_full_causal_forward(kind, hops):
  n = 6
  x, _ = _inputs(n)
  model = MultiHeadAttention(DIM, HEADS, kind=kind, gcn_hops=hops, rngs=nnx.Rngs(0), band_width=1)
  full_out, full_probs = nnx.jit(lambda m, x: m(x, mask=causal_mask(n)))(model, x)

  @nnx.jit
  def step(model, x):
    return model(x, decode=True)

  model.init_cache(batch=2, max_len=n)
  # A prefill chunk of 3 positions, then one position at a time.
  outs, probs = [], []
  o, p = step(model, x[:, :3])
  outs.append(o)
  probs.append(p)
  for t in range(3, n):
    o, p = step(model, x[:, t : t + 1])
    outs.append(o)
    probs.append(p)
  assert int(model.cache_index[...]) == n
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jnp.concatenate(probs, 2), full_probs, rtol=1e-5, atol=1e-7)


def test_cross_attention_and_argument_checks():
  x, valid = _inputs()
  enc = jax.random.normal(jax.random.PRNGKey(3), (2, 4, DIM))
  model = MultiHeadAttention(DIM, HEADS, kind="vanilla", rngs=nnx.Rngs(0))
  out, probs = model(x, enc, mask=padding_mask(valid, np.ones((2, 4), bool)))
  assert out.shape == (2, 6, DIM) and probs.shape == (2, HEADS, 6, 4)
  hops2 = MultiHeadAttention(DIM, HEADS, kind="causal", gcn_hops=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="self-attention"):
    hops2(x, enc)
  with pytest.raises(ValueError, match="init_cache"):
    model(x, decode=True)
  with pytest.raises(TypeError):
    MultiHeadAttention(DIM, HEADS, rngs=nnx.Rngs(0), band=3)
  with pytest.raises(ValueError):
    MultiHeadAttention(DIM, HEADS, kind="sparse", rngs=nnx.Rngs(0))


def test_sinkhorn_attention_normalises_columns_and_keeps_rows_exact():
  rng = np.random.default_rng(0)
  n = 7
  logits = jnp.asarray(rng.normal(size=(2, 3, n, n)) * 2.0, jnp.float32)
  valid = np.array([[True] * n, [True] * 5 + [False] * 2])
  mask = padding_mask(valid, valid)
  plain = masked_softmax(logits, mask)
  doubly = sinkhorn_softmax(logits, mask, 200)
  cols = np.asarray(doubly.sum(-2))
  np.testing.assert_allclose(np.asarray(doubly.sum(-1))[0], 1.0, atol=1e-6)
  np.testing.assert_allclose(cols[0], 1.0, atol=1e-2)
  np.testing.assert_allclose(cols[1, :, :5], 1.0, atol=1e-2)
  np.testing.assert_array_equal(np.asarray(doubly)[1, :, 5:], 0.0)  # padded rows stay empty
  np.testing.assert_array_equal(np.asarray(doubly)[1, :, :, 5:], 0.0)
  # A softmax's columns are far from 1; more iterations bring them closer.
  err = lambda p: float(np.abs(np.asarray(p.sum(-2))[0] - 1.0).max())
  assert err(plain) > 0.3 and err(sinkhorn_softmax(logits, mask, 3)) > err(doubly)
  # Zero iterations is the softmax.
  np.testing.assert_allclose(sinkhorn_softmax(logits, mask, 0), plain, atol=1e-7)
