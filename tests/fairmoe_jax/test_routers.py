"""Tests for fairmoe_jax.moe.routers (noisy top-k, expert choice) and batch-priority routing
(fairmoe_jax.moe.dispatch.batch_priority)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats
from flax import nnx

from fairmoe_jax.moe.dispatch import (
    batch_priority_order,
    compute_capacity,
    dispatch_and_combine_masks,
    reorder_tokens,
    restore_token_order,
)
from fairmoe_jax.moe.routers import (
    ExpertChoiceRouter,
    NoisyRouterOutput,
    NoisyTopKRouter,
    RouterOutput,
    apply_expert_choice,
    expert_choice_from_logits,
    noisy_top_k_from_logits,
    route_from_logits,
)
from fairmoe_jax.moe.routers.expert_choice import apply_expert_picks

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

DIM, EXPERTS, TOP_K = 8, 4, 2


def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), jnp.float32)


@functools.partial(nnx.jit, static_argnames="train")
def _noisy_route(router, x, rngs, train):
  return router(x, train=train, rngs=rngs)


def _noisy_router(seed: int = 0) -> NoisyTopKRouter:
  router = NoisyTopKRouter(DIM, EXPERTS, TOP_K, rngs=nnx.Rngs(0))
  router.gate.kernel.set_value(_normal(seed, (DIM, EXPERTS)))
  router.noise_gate.kernel.set_value(_normal(seed + 1, (DIM, EXPERTS), 0.5))
  return router


# ---------------------------------------------------------------------------
# Noisy top-k
# ---------------------------------------------------------------------------


def _np_cv2(v: np.ndarray) -> float:
  return float(np.var(v) / (np.mean(v) ** 2 + 1e-10))


def _np_noisy_reference(clean, std, noise, k):
  """Independent float64 NumPy version of the paper's gates, importance and load."""
  clean, std = np.asarray(clean, np.float64), np.asarray(std, np.float64)
  h = clean + (0.0 if noise is None else np.asarray(noise, np.float64) * std)
  t, e = h.shape
  gate = np.zeros((t, e))
  load = np.zeros((t, e))
  for i in range(t):
    top = np.argsort(-h[i])[:k]
    z = np.exp(h[i, top] - h[i, top].max())
    gate[i, top] = z / z.sum()
    for j in range(e):
      others = np.sort(np.delete(h[i], j))[::-1]
      threshold = others[k - 1]  # k-th largest noisy logit of the other experts
      load[i, j] = scipy.stats.norm.cdf((clean[i, j] - threshold) / std[i, j])
  importance, load = gate.sum(0), load.sum(0)
  return gate, importance, load, _np_cv2(importance), _np_cv2(load)


def test_noisy_losses_match_hand_computation():
  clean = np.array(
      [[2.0, 0.5, -1.0, 0.1], [0.1, 0.3, 0.2, -0.4], [-2.0, 1.0, 3.0, 0.0], [1.0, 1.5, 0.0, 0.7]],
      np.float32,
  )
  std = np.array(
      [[0.5, 1.0, 0.3, 0.8], [0.7, 0.2, 0.9, 0.4], [1.1, 0.6, 0.5, 0.3], [0.4, 0.8, 1.2, 0.6]],
      np.float32,
  )
  noise = np.random.default_rng(5).normal(size=clean.shape).astype(np.float32)
  fn = jax.jit(noisy_top_k_from_logits, static_argnums=3)
  for k in (1, 2, 3):
    for eps in (None, noise):
      out = fn(jnp.asarray(clean), jnp.asarray(std), None if eps is None else jnp.asarray(eps), k)
      gate, imp, load, imp_loss, load_loss = _np_noisy_reference(clean, std, eps, k)
      assert isinstance(out, RouterOutput)
      np.testing.assert_allclose(out.probs, gate, rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(out.gates.sum(-1), 1.0, rtol=1e-6)
      np.testing.assert_allclose(out.importance, imp, rtol=1e-5)
      np.testing.assert_allclose(out.load, load, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(out.importance_loss, imp_loss, rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(out.load_loss, load_loss, rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(out.load_balance_loss, imp_loss + load_loss, rtol=1e-4)
  # k = E: every expert always selected, load is exactly uniform.
  out = fn(jnp.asarray(clean), jnp.asarray(std), jnp.asarray(noise), EXPERTS)
  np.testing.assert_allclose(out.load, 4.0)
  assert float(out.load_loss) == 0.0


def test_noisy_router_deterministic_in_eval_and_seeded_noise_in_train():
  router = _noisy_router()
  x = _normal(10, (12, DIM))
  eval_a = _noisy_route(router, x, None, train=False)
  eval_b = _noisy_route(router, x, nnx.Rngs(noise=3), train=False)
  assert isinstance(eval_a, NoisyRouterOutput)
  assert eval_a.logits.dtype == eval_a.gates.dtype == jnp.float32
  np.testing.assert_array_equal(eval_a.logits, eval_a.clean_logits)
  np.testing.assert_array_equal(eval_a.expert_index, eval_b.expert_index)
  np.testing.assert_array_equal(eval_a.gates, eval_b.gates)

  # Module against the independent reference: clean logits, std, and (in
  # train mode) the noise implied by the returned noisy logits.
  xn = np.asarray(x, np.float64)
  clean = xn @ np.asarray(router.gate.kernel[...], np.float64)
  std = np.log1p(np.exp(xn @ np.asarray(router.noise_gate.kernel[...], np.float64)))
  np.testing.assert_allclose(eval_a.clean_logits, clean, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(eval_a.noise_std, std, rtol=1e-5, atol=1e-6)
  _, _, load, _, load_loss = _np_noisy_reference(clean, std, None, TOP_K)
  np.testing.assert_allclose(eval_a.load, load, rtol=1e-4, atol=1e-5)

  rngs = nnx.Rngs(noise=7)
  train_a = _noisy_route(router, x, rngs, train=True)
  train_b = _noisy_route(router, x, rngs, train=True)  # Stream advanced: new noise.
  train_a2 = _noisy_route(router, x, nnx.Rngs(noise=7), train=True)  # Same seed.
  np.testing.assert_array_equal(train_a.logits, train_a2.logits)
  np.testing.assert_array_equal(train_a.expert_index, train_a2.expert_index)
  assert not np.allclose(train_a.logits, train_b.logits)
  assert not np.allclose(train_a.logits, eval_a.logits)
  noise = (np.asarray(train_a.logits, np.float64) - clean) / std
  assert 0.3 < noise.std() < 3.0  # Standard-normal-sized noise.
  gate, imp, load, _, _ = _np_noisy_reference(clean, std, noise, TOP_K)
  np.testing.assert_allclose(train_a.probs, gate, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(train_a.load, load, rtol=1e-4, atol=1e-4)

  with pytest.raises(ValueError, match="rngs"):
    router(x, train=True)


def test_load_loss_is_differentiable_wrt_noise_weights():
  router = _noisy_router(seed=2)
  x = _normal(11, (16, DIM))
  noise = _normal(12, (16, EXPERTS))
  graphdef, state = nnx.split(router)

  def load_loss(state):
    r = nnx.merge(graphdef, state)
    return noisy_top_k_from_logits(r.logits(x), r.noise_std(x), noise, TOP_K).load_loss

  grads = jax.jit(jax.grad(load_loss))(state)
  g_noise = np.asarray(grads["noise_gate"]["kernel"][...])
  assert np.all(np.isfinite(g_noise)) and np.abs(g_noise).max() > 1e-4

  # Directional finite difference (top-k sets do not change for a tiny step).
  direction = np.asarray(_normal(13, (DIM, EXPERTS)))
  base = np.asarray(router.noise_gate.kernel[...])
  step = 1e-3

  def at(w):
    s = jax.tree.map(lambda v: v, state)
    s["noise_gate"]["kernel"].set_value(jnp.asarray(w, jnp.float32))
    return float(jax.jit(load_loss)(s))

  fd = (at(base + step * direction) - at(base - step * direction)) / (2 * step)
  np.testing.assert_allclose(np.sum(g_noise * direction), fd, rtol=2e-2, atol=1e-4)


# ---------------------------------------------------------------------------
# Batch-priority routing
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("num_experts", "capacity", "score"))
def _bpr_masks(expert_index, gates, *, num_experts, capacity, score="max"):
  order = batch_priority_order(gates, score=score)
  idx_s, gates_s = reorder_tokens((expert_index, gates), order)
  dispatch_s, combine_s, stats = dispatch_and_combine_masks(
      idx_s, gates_s, num_experts=num_experts, capacity=capacity
  )
  dispatch, combine, kept = restore_token_order((dispatch_s, combine_s, stats.kept), order)
  return order, dispatch, combine, kept


def test_batch_priority_routing_keeps_highest_priority_tokens():
  # Every token wants expert 0 first and expert 1 second; capacity 2 per expert.
  g, s, e, k, c = 2, 6, 4, 2, 2
  logits = np.zeros((g * s, e), np.float32)
  rng = np.random.default_rng(0)
  strength = rng.permutation(np.arange(g * s, dtype=np.float32)) / 4.0
  logits[:, 0] = 2.0 + strength
  logits[:, 1] = 1.0 + 0.5 * strength
  route = route_from_logits(jnp.asarray(logits), k)
  expert_index = route.expert_index.reshape(g, s, k)
  gates = route.gates.reshape(g, s, k)
  assert np.all(np.asarray(expert_index) == np.array([0, 1]))

  order, dispatch, combine, kept = _bpr_masks(expert_index, gates, num_experts=e, capacity=c)
  max_gate = np.asarray(gates).max(-1)
  np.testing.assert_array_equal(order, np.argsort(-max_gate, axis=1, kind="stable"))
  np.testing.assert_array_equal(
      batch_priority_order(route, num_groups=g), order
  )  # Flat RouterOutput input.
  for gi in range(g):
    top = set(np.argsort(-max_gate[gi])[:c])
    # The c highest-priority tokens of the group are the ones served (both choices).
    assert {si for si in range(s) if kept[gi, si, 0]} == top
    assert {si for si in range(s) if kept[gi, si, 1]} == top
    # Masks are in the original token order: served tokens carry their own gates.
    for si in range(s):
      served = float(si in top)
      np.testing.assert_allclose(dispatch[gi, si].sum(), 2 * served)
      np.testing.assert_allclose(combine[gi, si].sum(), served * gates[gi, si].sum(), rtol=1e-6)
  # Without BPR, the first c tokens in sequence order would have been kept.
  _, _, stats = dispatch_and_combine_masks(expert_index, gates, num_experts=e, capacity=c)
  assert np.asarray(stats.kept)[:, :c].all() and not np.asarray(stats.kept)[:, c:].any()


def test_batch_priority_sum_score_and_exact_restore():
  gates = jnp.asarray(np.array([[[0.5, 0.2], [0.4, 0.4], [0.6, 0.0], [0.4, 0.4]]], np.float32))
  np.testing.assert_array_equal(batch_priority_order(gates, score="max"), [[2, 0, 1, 3]])
  np.testing.assert_array_equal(batch_priority_order(gates, score="sum"), [[1, 3, 0, 2]])
  x = _normal(0, (3, 7, 5))
  order = jax.jit(batch_priority_order)(_normal(1, (3, 7, 2)))
  assert sorted(np.asarray(order)[1].tolist()) == list(range(7))
  sorted_x = reorder_tokens(x, order)
  np.testing.assert_array_equal(sorted_x[1], np.asarray(x)[1][np.asarray(order)[1]])
  np.testing.assert_array_equal(restore_token_order(sorted_x, order), x)
  np.testing.assert_array_equal(reorder_tokens(restore_token_order(x, order), order), x)
  # The gradient of a reordering is the restoring one (a gather too: `slots.gather_rows`).
  _, reorder_vjp = jax.vjp(lambda x: reorder_tokens(x, order), x)
  np.testing.assert_array_equal(reorder_vjp(sorted_x)[0], x)


# ---------------------------------------------------------------------------
# Expert choice
# ---------------------------------------------------------------------------


def test_expert_choice_assignment():
  g, s, cf = 3, 10, 1.0
  router = ExpertChoiceRouter(DIM, EXPERTS, capacity_factor=cf, rngs=nnx.Rngs(0))
  router.gate.kernel.set_value(_normal(0, (DIM, EXPERTS)))
  x = _normal(1, (g, s, DIM), 1.0)
  c = compute_capacity(s, EXPERTS, 1, cf)
  assert router.capacity(s) == c == 3
  out = jax.jit(lambda r, x: r(x))(router, x.astype(jnp.bfloat16))
  assert out.token_index.shape == out.gates.shape == (g, EXPERTS, c)
  assert out.logits.dtype == out.gates.dtype == jnp.float32

  logits = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(router.gate.kernel[...])
  probs = scipy.special.softmax(logits, axis=-1)
  idx = np.asarray(out.token_index)
  for gi in range(g):
    for e in range(EXPERTS):
      # Exactly C distinct tokens per expert: its C highest affinities.
      assert len(set(idx[gi, e])) == c
      np.testing.assert_array_equal(idx[gi, e], np.argsort(-probs[gi, :, e], kind="stable")[:c])
  np.testing.assert_allclose(
      out.gates, np.take_along_axis(np.swapaxes(probs, 1, 2), idx, -1), rtol=1e-5
  )
  counts = np.zeros((g, s), int)
  for gi in range(g):
    np.add.at(counts[gi], idx[gi].ravel(), 1)
  np.testing.assert_array_equal(out.experts_per_token, counts)
  np.testing.assert_allclose(out.fraction_unrouted, np.mean(counts == 0))
  assert counts.sum() == g * EXPERTS * c


def test_apply_expert_choice_matches_numpy_loop():
  g, s, d = 2, 6, 5
  logits = _normal(2, (g, s, EXPERTS), 2.0)
  assignment = jax.jit(expert_choice_from_logits, static_argnums=1)(logits, 4)
  x = _normal(3, (g, s, d))
  w = _normal(4, (EXPERTS, d, d))

  def expert_fn(h):  # [G, E, C, D] -> [G, E, C, D], a different map per expert.
    return jnp.tanh(jnp.einsum("gecd,edf->gecf", h, w))

  y = jax.jit(apply_expert_choice, static_argnums=2)(x, assignment, expert_fn)

  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  idx, gate = np.asarray(assignment.token_index), np.asarray(assignment.gates, np.float64)
  expected = np.zeros((g, s, d))
  for gi in range(g):
    for e in range(EXPERTS):
      for ci in range(idx.shape[2]):
        t = idx[gi, e, ci]
        expected[gi, t] += gate[gi, e, ci] * np.tanh(xn[gi, t] @ wn[e])
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  unrouted = np.asarray(assignment.experts_per_token) == 0
  np.testing.assert_array_equal(np.asarray(y)[unrouted], 0.0)

  # Gradients (x, gates, the experts' weights) against one-hot matmuls, a different program.
  def loss(x, gates, w, one_hot):
    def expert_fn(h):
      return jnp.tanh(jnp.einsum("gecd,edf->gecf", h, w))

    if one_hot:
      picks = jax.nn.one_hot(assignment.token_index, s)  # [G, E, C, S]
      out = expert_fn(jnp.einsum("gecs,gsd->gecd", picks, x))
      y = jnp.einsum("gecs,gec,gecd->gsd", picks, gates, out)
    else:
      y = apply_expert_picks(x, assignment.token_index, gates, expert_fn)
    return jnp.sum(y * jnp.arange(y.size).reshape(y.shape) / y.size)

  grads = [
      jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(x, assignment.gates, w, o)
      for o in (False, True)
  ]
  for grad, grad_ref in zip(*grads, strict=True):
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-6)
