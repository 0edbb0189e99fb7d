"""Markov-blanket constraint (causal_attn_jax.constraints): sums, bounds, Lagrangian, duals."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_attn_jax import config as config_lib
from causal_attn_jax import constraints as C
from causal_attn_jax.layers.attention import masked_softmax
from causal_attn_jax.layers.masks import causal_mask, padding_mask, sparse_mask
from trainkit.errors import ConfigError

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

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


def _circulant(n: int, offsets: tuple[int, ...]) -> jax.Array:
  """[1, 1, n, n] doubly stochastic attention: row i puts 1/len(offsets) on i + each offset."""
  a = np.zeros((n, n))
  for i in range(n):
    for o in offsets:
      a[i, (i + o) % n] += 1 / len(offsets)
  return jnp.asarray(a, jnp.float32)[None, None]


def _violated(stats) -> bool:
  return float(stats.violations.sum()) > 1e-4


ENCODER = dict(decoder=False)
DECODER = dict(decoder=True)


def test_bands_are_the_row_shapes_of_definition_1_and_figure_5():
  dec = C.band(decoder=True)
  # tau - N of Definition 1: N - 2 + 2 e^(1/2) and N - 1 + e, for any N.
  for n in (4, 9):
    assert dec.lower == pytest.approx((n - 2 + 2 * math.sqrt(E)) - n)
    assert dec.upper == pytest.approx((n - 1 + E) - n)
  assert not dec.count_diagonal
  enc = C.band(decoder=False)
  # Self-loop 1/3 beside two parents at 1/3 (lower) or one parent at 2/3 (upper).
  assert enc.lower == pytest.approx(3 * math.expm1(1 / 3))
  assert enc.upper == pytest.approx(math.expm1(1 / 3) + math.expm1(2 / 3))
  # Inside [1, e - 1], the range of a softmax row: neither bound is vacuous.
  assert 1.0 < enc.lower < enc.upper < E - 1
  # The printed slacks are what the 1/3 self-loop costs the off-diagonal sums.
  paper = C.band(decoder=False, encoder_band="paper_slack")
  assert round(dec.lower - paper.lower, 4) == 0.5062 == C.PAPER_SLACK_UPPER
  assert round(dec.upper - paper.upper, 4) == 0.7045 == C.PAPER_SLACK_LOWER
  assert paper.lower == pytest.approx(2 * math.expm1(1 / 3))


@pytest.mark.parametrize("form", C.FORMS)
@pytest.mark.parametrize("n", [4, 5, 8, 32])
def test_uniform_attention_violates_encoder_and_decoder(n, form):
  spec = C.ConstraintSpec(form=form)
  uniform = jnp.full((1, 1, n, n), 1.0 / n)
  enc = C.constraint_violations(uniform, None, spec=spec, **ENCODER)
  assert _violated(enc) and float(enc.rows_within) == 0.0
  causal = causal_mask(n)
  dec = C.constraint_violations(
      masked_softmax(jnp.zeros((1, 1, n, n)), causal), causal, spec=spec, **DECODER
  )
  assert _violated(dec)


@pytest.mark.parametrize("form", C.FORMS)
def test_self_loop_graph_violates_encoder_and_decoder(form):
  spec = C.ConstraintSpec(form=form)
  eye = jnp.eye(6)[None, None]
  assert _violated(C.constraint_violations(eye, None, spec=spec, **ENCODER))
  assert _violated(C.constraint_violations(eye, causal_mask(6), spec=spec, **DECODER))


@pytest.mark.parametrize("form", C.FORMS)
@pytest.mark.parametrize("n", [5, 9])
def test_self_loop_third_with_two_parents_satisfies_encoder(n, form):
  spec = C.ConstraintSpec(form=form)
  thirds = _circulant(n, (-1, 0, 1))
  stats = C.constraint_violations(thirds, None, spec=spec, **ENCODER)
  assert not _violated(stats)
  assert float(stats.rows_within) == float(stats.cols_within) == float(stats.nodes_within) == 1
  # One parent at 2/3 beside the self-loop: the other end of the band.
  one_parent = jnp.asarray(_circulant(n, (0,)) / 3 + 2 * _circulant(n, (1,)) / 3)
  assert not _violated(C.constraint_violations(one_parent, None, spec=spec, **ENCODER))
  # A row that ignores its own token (one-hot on a neighbour) leaves the encoder band.
  assert _violated(C.constraint_violations(_circulant(n, (1,)), None, spec=spec, **ENCODER))


@pytest.mark.parametrize("form", C.FORMS)
def test_decoder_rows_with_one_or_two_earlier_parents_satisfy(form):
  spec = C.ConstraintSpec(form=form)
  n = 7
  mask = causal_mask(n)
  one = np.zeros((n, n))
  one[0, 0] = 1.0  # the first token has nothing earlier
  for i in range(1, n):
    one[i, i - 1] = 1.0
  stats = C.constraint_violations(jnp.asarray(one)[None, None], mask, spec=spec, **DECODER)
  assert not _violated(stats) and float(stats.rows_within) == 1.0
  two = np.zeros((n, n))
  two[0, 0], two[1, 0] = 1.0, 1.0
  for i in range(2, n):
    two[i, i - 1] = two[i, i - 2] = 0.5
  stats = C.constraint_violations(jnp.asarray(two)[None, None], mask, spec=spec, **DECODER)
  # Column sums of this chain can exceed the band; the rows themselves are Markov blankets.
  assert float(stats.rows_within) == 1.0
  if form == "separate":
    assert float(stats.violations[:, :2].sum()) < 1e-5
  # Row 3 attends only to itself although it has three earlier tokens: violated.
  selfish = one.copy()
  selfish[3] = 0.0
  selfish[3, 3] = 1.0
  stats = C.constraint_violations(
      jnp.asarray(selfish)[None, None], mask, spec=C.ConstraintSpec(form="separate"), **DECODER
  )
  assert float(stats.violations[0, 0]) == pytest.approx(C.band(decoder=True).lower / (n - 1))


def test_paper_slack_reading_cannot_reject_uniform_attention():
  """Its defining property, and why it is not the default (docs/design.md)."""
  spec = C.ConstraintSpec(form="separate", encoder_band="paper_slack")
  for n in (3, 4, 8, 64):
    uniform = jnp.full((1, 1, n, n), 1.0 / n)
    assert not _violated(C.constraint_violations(uniform, None, spec=spec, **ENCODER))
  thirds = _circulant(7, (-1, 0, 1))
  assert not _violated(C.constraint_violations(thirds, None, spec=spec, **ENCODER))
  assert _violated(C.constraint_violations(jnp.eye(7)[None, None], None, spec=spec, **ENCODER))


def test_an_unknown_band_is_refused_naming_the_bands():
  """The derived band is derived_self_loop; any other name (its old name self_loop included)
  runs nothing and is one error naming the key and the bands."""
  assert C.ConstraintSpec().encoder_band == "derived_self_loop"
  with pytest.raises(ValueError, match="derived_self_loop"):
    C.ConstraintSpec(encoder_band="self_loop")
  with pytest.raises(ValueError, match="unknown encoder_band 'self_loop'"):
    C.band(decoder=False, encoder_band="self_loop")
  config = config_lib.base_config()
  config.constraints.encoder_band = "self_loop"
  with pytest.raises(ConfigError, match="'derived_self_loop', 'paper_slack'.*got 'self_loop'") as e:
    config_lib.validate(config, num_devices=1)
  assert e.value.key == "constraints.encoder_band"
  # Both current names pass the constraint's checks (validation stops later, at the data).
  for name in C.ENCODER_BANDS:
    config.constraints.encoder_band = name
    with pytest.raises(ConfigError) as e:
      config_lib.validate(config, num_devices=1)
    assert e.value.key == "data.train_file"


def test_node_form_is_row_plus_column():
  """Eq. 2: a node whose row is short of the band and whose column is over it by as much is fine."""
  n = 4
  lower, upper = C.band(decoder=True).lower, C.band(decoder=True).upper
  # Decoder, 4 tokens. Row i's measure counts earlier tokens only.
  a = np.zeros((n, n))
  a[0, 0] = 1.0
  a[1, 0] = 1.0
  a[2, 0], a[2, 1] = 0.5, 0.5
  a[3, 1], a[3, 2] = 0.5, 0.5
  probs = jnp.asarray(a)[None, None]
  r, c = C.blanket_sums(probs, jnp.asarray(np.tril(np.ones((n, n)), -1), bool))
  node = C.constraint_violations(
      probs, causal_mask(n), spec=C.ConstraintSpec(form="node"), **DECODER
  )
  separate = C.constraint_violations(
      probs, causal_mask(n), spec=C.ConstraintSpec(form="separate"), **DECODER
  )
  # Column 0 gets e - 1 + expm1(1/2) > upper; as a node (row 0 is empty) it is held to it alone.
  assert float(c[0, 0, 0]) > upper and float(separate.violations[0, 3]) > 0
  # Node 1: row e - 1 (in band), column 2 expm1(1/2) = lower: mean in band.
  assert float(r[0, 0, 1]) == pytest.approx(upper, rel=1e-6)
  assert float(c[0, 0, 1]) == pytest.approx(lower, rel=1e-6)
  expected_upper = (float(c[0, 0, 0]) - upper) / 4  # only node 0 is over
  node_means = [float(c[0, 0, 0]), (upper + lower) / 2, (lower + math.expm1(0.5)) / 2, lower]
  expected_lower = sum(max(lower - m, 0) for m in node_means) / 4
  np.testing.assert_allclose(
      node.violations[0], [expected_lower, expected_upper], rtol=1e-5, atol=1e-6
  )


def _np_node_violations(probs, mask, valid, spec, decoder):
  """float64 reference of the node hinge form, written out loop by loop."""
  b = C.band(decoder=decoder, encoder_band=spec.encoder_band)
  probs = np.asarray(probs, np.float64)
  nb, h, n, _ = probs.shape
  allowed = np.broadcast_to(np.asarray(mask), probs.shape) & valid[:, None, :, None]
  allowed = allowed & valid[:, None, None, :]
  out = np.zeros((h, 2))
  for head in range(h):
    lows, highs = [], []
    for bi in range(nb):
      for i in range(n):
        keys = [j for j in range(n) if allowed[bi, head, i, j] and (b.count_diagonal or j != i)]
        feeders = [k for k in range(n) if allowed[bi, head, k, i] and (b.count_diagonal or k != i)]
        row_ok = len(keys) >= 1 and (
            not b.count_diagonal or len(keys) * math.expm1(1 / len(keys)) <= b.upper
        )
        col_ok = len(feeders) * (E - 1) >= b.lower
        measures = []
        if row_ok:
          measures.append(sum(math.expm1(probs[bi, head, i, j]) for j in keys))
        if col_ok:
          measures.append(sum(math.expm1(probs[bi, head, k, i]) for k in feeders))
        if measures:
          m = np.mean(measures)
          lows.append(max(b.lower - m, 0.0))
          highs.append(max(m - b.upper, 0.0))
    out[head] = [np.mean(lows), np.mean(highs)]
  return out


@pytest.mark.parametrize("decoder", [False, True])
def test_node_violations_match_float64_reference_with_padding(decoder):
  probs, mask, valid = _probs_and_mask(seed=1, causal=decoder)
  spec = C.ConstraintSpec()
  fn = jax.jit(functools.partial(C.constraint_violations, decoder=decoder, spec=spec))
  stats = fn(probs, mask, valid_q=valid, valid_k=valid)
  ref = _np_node_violations(probs, mask, valid, spec, decoder)
  assert stats.violations.shape == (3, 2)
  assert float(stats.violations.sum()) > 0.01  # random attention is outside the band
  np.testing.assert_allclose(stats.violations, ref, rtol=1e-5, atol=1e-6)


def test_decoder_excludes_exactly_the_columns_no_later_row_can_see():
  n = 6
  # With a local-block pattern ANDed in, the last column of every block has no later feeder.
  block = sparse_mask("block", n, block_size=3) & causal_mask(n)
  chain = np.zeros((n, n))  # row i -> column i - 1 inside each block, block starts self-attend
  for i in range(n):
    chain[i, i - 1 if i % 3 else i] = 1.0
  stats = C.constraint_violations(
      jnp.asarray(chain)[None, None], block, spec=C.ConstraintSpec(form="separate"), **DECODER
  )
  # Counted columns: 0, 1 (block 0) and 3, 4 (block 1), each fed e - 1 by one later row; the
  # block starts have no earlier key, so rows 1, 2, 4, 5 are the constrained rows.
  np.testing.assert_allclose(stats.violations, 0.0, atol=1e-6)
  assert float(stats.rows_within) == 1.0 and float(stats.cols_within) == 1.0


def test_hinge_lagrangian_with_dual_ascent_drives_free_attention_into_the_band():
  """What the constraint is minimised by: from uniform logits, attention becomes a blanket."""
  n, heads = 12, 2
  spec = C.ConstraintSpec()
  logits = jax.random.normal(jax.random.key(0), (1, heads, n, n)) * 0.01

  def lagrangian(lg, gamma):
    stats = C.constraint_violations(jax.nn.softmax(lg, -1), None, spec=spec, **ENCODER)
    return C.lagrangian_term(stats.violations, gamma), stats

  grad = jax.jit(jax.grad(lagrangian, has_aux=True))
  gamma = C.init_multipliers(1, heads, spec=spec)[0]
  before = C.constraint_violations(jax.nn.softmax(logits, -1), None, spec=spec, **ENCODER)
  for _ in range(400):
    g, stats = grad(logits, gamma)
    logits = logits - 5.0 * g
    gamma = C.dual_update(gamma, stats.violations, step_size=1.0)
  probs = jax.nn.softmax(logits, -1)
  after = C.constraint_violations(probs, None, spec=spec, **ENCODER)
  assert float(before.nodes_within) == 0.0
  assert float(after.nodes_within) > 0.9, float(after.nodes_within)
  effective = jnp.exp(-(probs * jnp.log(probs)).sum(-1)).mean()
  assert float(effective) < 6.0  # from 12 keys to a few (a band row is 2-3 keys plus a tail)


def test_linear_eq3_terms_are_signed_sums_and_their_gradient_follows_the_multiplier_gap():
  spec = C.ConstraintSpec(loss="linear")
  assert spec.names == ("slack_lower", "slack_upper", "node_lower", "node_upper")
  n = 5
  thirds = _circulant(n, (-1, 0, 1))  # every node at the lower bound exactly
  v = C.constraint_violations(thirds, None, spec=spec, **ENCODER).violations
  b = C.band(decoder=False)
  np.testing.assert_allclose(
      v[0], [-n * 0.7045, -n * 0.5062, 0.0, n * (b.lower - b.upper)], atol=1e-5
  )
  # Satisfied with room to spare: the dual step lowers the node-upper multiplier.
  gamma = jnp.ones((1, 4))
  assert float(C.dual_update(gamma, v, step_size=0.1)[0, 3]) < 1.0

  def h(lg, gamma):
    stats = C.constraint_violations(jax.nn.softmax(lg, -1), None, spec=spec, **ENCODER)
    return C.lagrangian_term(stats.violations, gamma)

  logits = jax.random.normal(jax.random.key(1), (1, 1, n, n))
  # Equal lower and upper multipliers cancel: the linear form exerts no pull on A.
  g_equal = jax.grad(h)(logits, jnp.array([[0.3, 0.3, 2.0, 2.0]]))
  assert float(jnp.abs(g_equal).max()) < 1e-6
  g_lower = jax.grad(h)(logits, jnp.array([[0.0, 0.0, 2.0, 0.0]]))
  assert float(jnp.abs(g_lower).max()) > 1e-3
  with pytest.raises(ValueError, match="form='node'"):
    C.ConstraintSpec(form="separate", loss="linear")


@pytest.mark.parametrize(
    "spec", [C.ConstraintSpec(), C.ConstraintSpec(form="separate"), C.ConstraintSpec(loss="linear")]
)
def test_lagrangian_gradient_matches_finite_differences(spec):
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    n, heads = 5, 2
    # [2 "layers" (encoder, decoder), B, H, N, N] logits.
    logits0 = jnp.asarray(rng.normal(size=(2, 2, heads, n, n)) * 1.5, jnp.float64)
    valid = np.array([[True] * 5, [True] * 3 + [False] * 2])
    mask_enc = padding_mask(valid, valid)
    mask_dec = mask_enc & causal_mask(n)
    gammas = jnp.asarray(rng.uniform(0.5, 2.0, size=(2, heads, len(spec.names))), jnp.float64)

    def loss(logits):
      stats = [
          C.constraint_violations(
              masked_softmax(lg, m), m, decoder=dec, valid_q=valid, valid_k=valid, spec=spec
          )
          for lg, m, dec in ((logits[0], mask_enc, False), (logits[1], mask_dec, True))
      ]
      violations = jnp.stack([s.violations for s in stats])
      assert violations.dtype == jnp.float64
      return C.lagrangian_term(violations, gammas, penalty=0.7)

    f = jax.jit(loss)
    g = jax.jit(jax.grad(loss))(logits0)
    assert float(jnp.abs(g).max()) > 1e-4  # some term is active, so the test is not vacuous
    eps = 1e-6
    for ix in [(0, 0, 0, 1, 2), (0, 1, 1, 2, 0), (1, 0, 0, 3, 1), (1, 0, 1, 4, 4), (1, 1, 0, 2, 2)]:
      d = jnp.zeros_like(logits0).at[ix].set(eps)
      fd = (f(logits0 + d) - f(logits0 - d)) / (2 * eps)
      assert float(g[ix]) == pytest.approx(float(fd), rel=1e-5, abs=1e-8)
    # Masked (future) logits of the decoder get no gradient.
    assert float(jnp.abs(g[1, :, :, 0, 1:]).max()) == 0.0


def test_lagrangian_term_value():
  v = jnp.array([[[0.5, 0.0, 1.0, 2.0]]])
  gamma = jnp.array([[[1.0, 3.0, 0.0, 0.5]]])
  assert float(C.lagrangian_term(v, gamma)) == pytest.approx(1.5)
  assert float(C.lagrangian_term(v, gamma, penalty=2.0)) == pytest.approx(1.5 + 5.25)
  # The quadratic penalty acts on the violated part of signed (linear-form) terms only.
  signed = jnp.array([[[-3.0, 0.0, 1.0, 2.0]]])
  assert float(C.lagrangian_term(signed, jnp.zeros((1, 1, 4)), penalty=2.0)) == pytest.approx(5.0)
  # Multipliers are not differentiated through.
  assert float(jnp.abs(jax.grad(lambda g: C.lagrangian_term(v, g))(gamma)).max()) == 0.0


def test_dual_update_is_projected_ascent():
  assert C.init_multipliers(2, 3).shape == (2, 3, len(C.DEFAULT_SPEC.names))
  gamma = C.init_multipliers(2, 3, spec=C.ConstraintSpec(form="separate"))
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
