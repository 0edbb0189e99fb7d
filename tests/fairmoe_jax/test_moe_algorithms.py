"""Tests for fairmoe_jax.moe.dispatch and fairmoe_jax.moe.experimental: every dispatch
algorithm against the dense oracle, and the sort-based dispatch against the einsum reference
under capacity overflow."""

from __future__ import annotations

import functools

import chex
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from fairmoe_jax.moe import route_from_logits
from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    ExpertWeights,
    batch_priority_order,
    moe_dense,
    moe_dropless,
    moe_einsum,
    moe_sort,
    reorder_tokens,
    restore_token_order,
)
from fairmoe_jax.moe.experimental import moe_blocksparse, moe_einsum_fused, moe_sort_blocks
from fairmoe_jax.moe.experimental.blocksparse import block_mlp, block_plan
from fairmoe_jax.moe.routers.expert_choice import apply_expert_picks, expert_choice_from_logits
from moe_cases import HAND_BUILT_EXPECTED_KEPT, HAND_BUILT_PREFERENCES

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

G, S, D, H, E, K = 2, 6, 8, 16, 4, 2
# Besides the registered algorithms: blocksparse with tiny blocks (many blocks per expert).
ALGORITHMS = {
    **DISPATCH_ALGORITHMS,
    "blocksparse_b1": functools.partial(moe_blocksparse, block_size=1),
    "blocksparse_b3": functools.partial(moe_blocksparse, block_size=3),
    # The fused expert MLP's Pallas kernels, run by Pallas' interpreter (on a TPU, compiled).
    "einsum_fused_kernels": functools.partial(moe_einsum_fused, interpret=True),
    # Each group's choices sorted apart (the layer's where no mesh is known).
    "dropless_per_group": functools.partial(moe_dropless, per_group=True),
}
SPARSE = (
    "einsum",
    "sort",
    "sort_blocks",
    "dropless",
    "dropless_per_group",
    "blocksparse",
    "blocksparse_b1",
    "blocksparse_b3",
    "einsum_fused_kernels",
)
SORT_LAYOUTS = ("sort", "sort_blocks")  # The capacity buffers, and blocks of the served choices.


def _rng(seed: int) -> np.random.Generator:
  return np.random.default_rng(seed)


def _normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
  # NumPy RNG: eager jax.random calls would each compile on first use.
  return jnp.asarray(scale * _rng(seed).normal(size=shape), dtype)


def _experts(seed: int = 0, num_experts: int = E, dim: int = D, hidden: int = H) -> ExpertWeights:
  shapes = [(num_experts, dim, hidden), (num_experts, hidden), (num_experts, hidden, dim)]
  shapes.append((num_experts, dim))
  return ExpertWeights(*(_normal(seed + i, s, scale=0.3) for i, s in enumerate(shapes)))


def _random_routing(seed: int, groups: int, tokens: int, num_experts: int, top_k: int, skew=None):
  """Distinct experts per token (optionally skewed towards low experts) and random gates."""
  rng = _rng(seed)
  p = None if skew is None else np.asarray(skew, np.float64) / np.sum(skew)
  index = np.array(
      [
          [rng.choice(num_experts, size=top_k, replace=False, p=p) for _ in range(tokens)]
          for _ in range(groups)
      ],
      np.int32,
  )
  gates = rng.uniform(0.05, 1.0, size=index.shape).astype(np.float32)
  return jnp.asarray(index), jnp.asarray(gates)


@functools.lru_cache(maxsize=None)
def _jitted(name: str):
  return jax.jit(ALGORITHMS[name], static_argnames="capacity")


def _assert_stats_equal(a, b):
  np.testing.assert_array_equal(a.kept, b.kept)
  np.testing.assert_array_equal(a.fraction_dropped, b.fraction_dropped)
  np.testing.assert_array_equal(a.group_expert_fraction, b.group_expert_fraction)


# ---------------------------------------------------------------------------
# The oracle itself
# ---------------------------------------------------------------------------


def _numpy_reference(x, index, gates, experts: ExpertWeights):
  """Float64 NumPy: every expert on every token, the chosen ones weighted by their gates."""
  w = [np.asarray(a, np.float64) for a in (experts.w1, experts.b1, experts.w2, experts.b2)]
  pre = np.einsum("gsd,edh->gseh", np.asarray(x, np.float64), w[0]) + w[1]
  h = 0.5 * pre * (1.0 + scipy.special.erf(pre / np.sqrt(2.0)))  # exact GELU
  out_all = np.einsum("gseh,ehd->gsed", h, w[2]) + w[3]
  chosen = np.take_along_axis(out_all, np.asarray(index)[..., None], 2)
  return np.einsum("gsk,gskd->gsd", np.asarray(gates, np.float64), chosen)


def test_dense_matches_numpy_reference():
  x, experts = _normal(0, (G, S, D)), _experts(1)
  index, gates = _random_routing(2, G, S, E, K)
  y, stats = _jitted("dense")(x, index, gates, experts)
  np.testing.assert_allclose(y, _numpy_reference(x, index, gates, experts), rtol=1e-5, atol=1e-6)
  assert bool(np.all(stats.kept)) and float(stats.fraction_dropped) == 0.0
  np.testing.assert_allclose(stats.group_expert_fraction.sum(-1), 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------
# Every algorithm equals the oracle when capacity suffices (values and gradients)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _loss_fn(name: str):
  algorithm = ALGORITHMS[name]

  def loss(x, logits, experts, cotangent):
    route = route_from_logits(logits, K)
    index = route.expert_index.reshape(G, S, K)
    gates = route.gates.reshape(G, S, K)
    y, stats = algorithm(x, index, gates, experts, capacity=S)
    return jnp.sum(y * cotangent), (y, stats)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("name", SPARSE)
def test_matches_dense_with_enough_capacity(name):
  x, experts = _normal(0, (G, S, D)), _experts(1)
  logits, cotangent = _normal(5, (G * S, E), scale=2.0), _normal(6, (G, S, D))
  (_, (y, stats)), grads = _loss_fn(name)(x, logits, experts, cotangent)
  (_, (y_ref, stats_ref)), grads_ref = _loss_fn("dense")(x, logits, experts, cotangent)

  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  _assert_stats_equal(stats, stats_ref)
  assert float(stats.fraction_dropped) == 0.0
  # Gradients w.r.t. x, the router logits (through the gates) and every expert weight.
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(grads[1]).max()) > 0  # The logits gradient is exercised.


@pytest.mark.parametrize("name", SPARSE)
def test_capacity_none_means_no_drops(name):
  x, experts = _normal(0, (G, S, D)), _experts(1)
  index, gates = _random_routing(3, G, S, E, K, skew=[8, 1, 1, 1])
  y, stats = _jitted(name)(x, index, gates, experts, capacity=None)
  y_ref, _ = _jitted("dense")(x, index, gates, experts)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert bool(np.all(stats.kept))


# ---------------------------------------------------------------------------
# sort == einsum under capacity overflow
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _gates_grad_fn(name: str, capacity: int):
  algorithm = ALGORITHMS[name]

  def loss(x, gates, experts, index, cotangent):
    y, stats = algorithm(x, index, gates, experts, capacity=capacity)
    return jnp.sum(y * cotangent), (y, stats)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("sort", SORT_LAYOUTS)
@pytest.mark.parametrize(
    "groups, tokens, num_experts, top_k, capacity",
    [(3, 10, 4, 2, 2), (2, 12, 4, 1, 2), (2, 9, 5, 3, 4), (1, 16, 8, 2, 1)],
)
def test_sort_equals_einsum_under_overflow(groups, tokens, num_experts, top_k, capacity, sort):
  x, experts = _normal(0, (groups, tokens, D)), _experts(1, num_experts=num_experts)
  skew = np.arange(num_experts, 0, -1) ** 2  # Low experts are oversubscribed.
  index, gates = _random_routing(7, groups, tokens, num_experts, top_k, skew=skew)
  cotangent = _normal(8, (groups, tokens, D))
  args = (x, gates, experts, index, cotangent)
  (_, (y, stats)), grads = _gates_grad_fn(sort, capacity)(*args)
  (_, (y_ref, stats_ref)), grads_ref = _gates_grad_fn("einsum", capacity)(*args)

  assert float(stats_ref.fraction_dropped) > 0.0  # The test must exercise drops.
  _assert_stats_equal(stats, stats_ref)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-5, atol=1e-6)
  # Dropped choices contribute nothing: a (dense) oracle on the kept gates agrees.
  y_kept, _ = _jitted("dense")(x, index, gates * stats.kept, experts)
  np.testing.assert_allclose(y, y_kept, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["einsum", *SORT_LAYOUTS])
def test_hand_built_overflow(name):
  index = jnp.asarray(HAND_BUILT_PREFERENCES, jnp.int32)
  gates = jnp.asarray(_rng(4).uniform(0.1, 1.0, size=index.shape), jnp.float32)
  x, experts = _normal(0, (G, S, D)), _experts(1)
  y, stats = _jitted(name)(x, index, gates, experts, capacity=3)

  np.testing.assert_array_equal(stats.kept, HAND_BUILT_EXPECTED_KEPT)
  np.testing.assert_allclose(stats.fraction_dropped, 9 / 24, rtol=1e-6)
  np.testing.assert_allclose(
      stats.group_expert_fraction, np.array([[3, 3, 2, 1], [3, 3, 0, 0]]) / 12, rtol=1e-6
  )
  expected = _numpy_reference(x, index, np.asarray(gates) * HAND_BUILT_EXPECTED_KEPT, experts)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  # Tokens that lost both choices get exactly 0 (the residual carries them).
  np.testing.assert_array_equal(np.asarray(y)[1, 3:], 0.0)
  if name != "einsum":
    y_ref, stats_ref = _jitted("einsum")(x, index, gates, experts, capacity=3)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-7)
    _assert_stats_equal(stats, stats_ref)


def _max_intermediate_size(jaxpr) -> int:
  """Largest number of elements of any value in a (closed) jaxpr, sub-jaxprs included."""
  best = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      best = max(best, int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      best = max(best, _max_intermediate_size(sub))
  return best


@pytest.mark.parametrize("sort", SORT_LAYOUTS)
def test_sort_builds_no_token_by_expert_by_capacity_tensor(sort):
  groups, tokens, num_experts, top_k, capacity, dim, hidden = 1, 64, 8, 2, 16, 4, 4
  x = _normal(0, (groups, tokens, dim))
  experts = _experts(1, num_experts=num_experts, dim=dim, hidden=hidden)
  index, gates = _random_routing(2, groups, tokens, num_experts, top_k)
  sizes = {}
  for name in ("einsum", sort):
    fn = functools.partial(ALGORITHMS[name], capacity=capacity)
    sizes[name] = _max_intermediate_size(jax.make_jaxpr(fn)(x, index, gates, experts).jaxpr)
  # The [G, S, E, C] one-hot is 8192 elements here. sort's largest values are the
  # [G, E, C, D] buffers (512) or, in blocks, the T k + (E + 1)(B - 1) rows of width H (block
  # size 16 here), the G S D input and the G S k choices.
  rows = groups * num_experts * capacity
  if sort == "sort_blocks":
    rows = groups * tokens * top_k + (num_experts + 1) * 15
  assert sizes["einsum"] >= groups * tokens * num_experts * capacity
  assert sizes[sort] <= max(
      rows * max(dim, hidden), groups * tokens * dim, groups * tokens * top_k
  ), sizes
  assert sizes[sort] < sizes["einsum"] / 4


def _expert_choice_step():
  """value_and_grad of `apply_expert_picks` (expert choice's combine), `_gates_grad_fn`'s
  signature with index and gates [G, E, C]."""

  def loss(x, gates, experts, index, cotangent):
    y = apply_expert_picks(x, index, gates, experts.apply)
    return jnp.sum(y * cotangent), (y, None)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _batch_priority_step():
  """value_and_grad of `sort` between `reorder_tokens` and `restore_token_order`."""

  def loss(x, gates, experts, index, cotangent):
    order = batch_priority_order(gates)
    x_s, index_s, gates_s = reorder_tokens((x, index, gates), order)
    y = restore_token_order(moe_sort(x_s, index_s, gates_s, experts, capacity=2)[0], order)
    return jnp.sum(y * cotangent), (y, None)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


GATHER_ONLY_STEPS = {
    **{
        name: functools.partial(_gates_grad_fn, name, 2)
        for name in (*SORT_LAYOUTS, "blocksparse", "dropless", "dropless_per_group")
    },
    "expert_choice": _expert_choice_step,
    "batch_priority": _batch_priority_step,
}


@pytest.mark.parametrize("name", GATHER_ONLY_STEPS)
def test_moves_data_by_gathers_only_in_both_passes(name):
  """Scatter-adds run serially on CPU and with atomics on GPU, so a GPU's reruns differ; these
  combine, and take their gradients, by gathers and their sums (`slots.gather_rows`)."""
  x, experts, cotangent = _normal(0, (G, S, D)), _experts(1), _normal(2, (G, S, D))
  index, gates = _random_routing(3, G, S, E, K)
  if name == "expert_choice":  # Each expert's C = 4 of S = 6 tokens, overlapping.
    assignment = expert_choice_from_logits(_normal(4, (G, S, E)), 4)
    index, gates = assignment.token_index, assignment.gates
  step = GATHER_ONLY_STEPS[name]()
  hlo = step.lower(x, gates, experts, index, cotangent).compile().as_text()
  scatters = [line for line in hlo.splitlines() if " scatter(" in line]
  # The scatters left are the plans' int32 inverse permutations (G S k elements), not data.
  assert all("s32[" in line.split("=")[1].split("scatter(")[0] for line in scatters), scatters
  assert len(scatters) <= {"sort_blocks": 2}.get(name, 1), scatters
  # The same program twice gives the same bits (what atomics would not on a GPU).
  chex.assert_trees_all_equal(
      step(x, gates, experts, index, cotangent), step(x, gates, experts, index, cotangent)
  )


# Relative error norm |g16 - g32| / |g32| of each gradient leaf, bfloat16 tokens against the
# float32 oracle: `sort`'s (measured 0.45-0.6% per leaf here, from rounding the inputs, weights
# and intermediates to bfloat16 alone). A sum over the 512 choices (or the blocks of one
# expert) accumulated in bfloat16 rounds at every term and adds 0.2-1% here, more with more
# tokens (4% for a bias gradient summed so at 4096 choices).
BFLOAT16_GRADIENT_TOLERANCE = 7e-3


@pytest.mark.parametrize("name", ALGORITHMS)
def test_gradients_in_bfloat16_stay_close_to_float32(name):
  groups, tokens, dim, hidden = 4, 64, 32, 64
  x32, cotangent = _normal(0, (groups, tokens, dim)), _normal(2, (groups, tokens, dim))
  experts = _experts(1, dim=dim, hidden=hidden)
  index, gates = _random_routing(3, groups, tokens, E, K)
  _, grads32 = _gates_grad_fn("dense", tokens)(x32, gates, experts, index, cotangent)
  (_, (y, _)), grads16 = _gates_grad_fn(name, tokens)(
      x32.astype(jnp.bfloat16), gates, experts, index, cotangent.astype(jnp.bfloat16)
  )
  assert y.dtype == jnp.bfloat16
  assert grads16[1].dtype == jnp.float32  # The gates' gradient stays in the routing dtype.
  assert jax.tree.map(lambda g: g.dtype, grads16[2]) == jax.tree.map(lambda w: w.dtype, experts)
  names = ["x", "gates", *(f"experts.{k}" for k in ("w1", "b1", "w2", "b2"))]
  leaves16, leaves32 = jax.tree.leaves(grads16), jax.tree.leaves(grads32)
  errors = {
      leaf: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
      for leaf, a, b in zip(names, leaves16, leaves32, strict=True)
  }
  assert max(errors.values()) < BFLOAT16_GRADIENT_TOLERANCE, errors


def _matmuls(jaxpr):
  """Every matmul of a (closed) jaxpr, sub-jaxprs included, as (primitive, output aval)."""
  for eqn in jaxpr.eqns:
    if "dot" in eqn.primitive.name:
      yield from ((eqn.primitive.name, var.aval) for var in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _matmuls(sub)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_weight_gradients_of_bfloat16_tokens_are_float32_matmuls(name):
  """The sum over every token of a weight gradient is a float32 matmul result, not a bfloat16
  one that the backend may accumulate as it likes (jax 0.12's CPU compiler: in bfloat16
  partial sums, `einsum` 2.4x the error of the float32 sum before `expert_matmul`)."""
  groups, tokens, dim, hidden = 2, 16, 8, 12  # D != H: a [E, D, H] result is a weight's.
  x, cotangent = (_normal(s, (groups, tokens, dim), jnp.bfloat16) for s in (0, 2))
  experts = _experts(1, dim=dim, hidden=hidden)
  index, gates = _random_routing(3, groups, tokens, E, K)
  jaxpr = jax.make_jaxpr(_gates_grad_fn(name, tokens))(x, gates, experts, index, cotangent)
  # All experts' weights at once, or one expert's (the block algorithms, one block at a time).
  weight_shapes = {(E, dim, hidden), (E, hidden, dim), (dim, hidden), (hidden, dim)}
  weight_matmuls = [(p, a) for p, a in _matmuls(jaxpr.jaxpr) if tuple(a.shape) in weight_shapes]
  assert len(weight_matmuls) >= 2, weight_matmuls  # One per layer, at least.
  assert all(a.dtype == jnp.float32 for _, a in weight_matmuls), weight_matmuls


# ---------------------------------------------------------------------------
# dropless
# ---------------------------------------------------------------------------


def test_dropless_never_drops():
  # Everyone wants experts 0 and 1: einsum drops most choices at capacity 1, and
  # experts 2, 3 get empty ragged_dot groups.
  index = jnp.asarray(np.broadcast_to(np.array([0, 1], np.int32), (G, S, K)))
  gates = jnp.asarray(_rng(3).uniform(0.1, 1.0, size=(G, S, K)), jnp.float32)
  x, experts, cotangent = _normal(0, (G, S, D)), _experts(1), _normal(2, (G, S, D))
  args = (x, gates, experts, index, cotangent)

  (_, (y, stats)), grads = _gates_grad_fn("dropless", 1)(*args)
  (_, (y_ref, stats_ref)), grads_ref = _gates_grad_fn("dense", 1)(*args)
  assert bool(np.all(stats.kept)) and float(stats.fraction_dropped) == 0.0
  _assert_stats_equal(stats, stats_ref)
  np.testing.assert_allclose(stats.group_expert_fraction, [[0.5, 0.5, 0, 0]] * G)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-5, atol=1e-5)
  # Unused experts get zero gradient.
  np.testing.assert_array_equal(grads[2].w1[2:], 0.0)

  _, einsum_stats = _jitted("einsum")(x, index, gates, experts, capacity=1)
  assert float(einsum_stats.fraction_dropped) > 0.5


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_blocksparse_never_drops_and_matches_dense(block_size):
  # Everyone wants experts 0 and 1, so experts 2 and 3 have no block at all.
  index = jnp.asarray(np.broadcast_to(np.array([0, 1], np.int32), (G, S, K)))
  gates = jnp.asarray(_rng(3).uniform(0.1, 1.0, size=(G, S, K)), jnp.float32)
  x, experts, cotangent = _normal(0, (G, S, D)), _experts(1), _normal(2, (G, S, D))
  algorithm = functools.partial(moe_blocksparse, block_size=block_size)

  def loss(fn):
    return jax.jit(
        jax.value_and_grad(
            lambda x, g, w: jnp.sum(fn(x, index, g, w)[0] * cotangent), argnums=(0, 1, 2)
        )
    )

  value, grads = loss(algorithm)(x, gates, experts)
  value_ref, grads_ref = loss(moe_dense)(x, gates, experts)
  # The loss is a sum that cancels (0.0966 here, from summands whose magnitudes add up to 38.6):
  # its float32 rounding scales with the summands, not with the sum. Each summand carries a few
  # ulps from its matmuls (summed in another order by each algorithm), and the sum of the G S D
  # = 96 summands up to log2(96) < 7 more: 16 ulps of the summands' total.
  summands = float(jnp.sum(jnp.abs(moe_dense(x, index, gates, experts)[0] * cotangent)))
  np.testing.assert_allclose(
      value, value_ref, rtol=0, atol=16 * np.finfo(np.float32).eps * summands
  )
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(grads[2].w1[2:], 0.0)
  _, stats = algorithm(x, index, gates, experts)
  assert bool(np.all(stats.kept))


def test_blocksparse_computes_only_the_blocks_of_real_rows():
  groups, tokens, num_experts, top_k, block_size = 2, 24, 8, 2, 4
  skew = np.arange(num_experts, 0, -1) ** 2
  index, _ = _random_routing(5, groups, tokens, num_experts, top_k, skew=skew)
  plan = block_plan(index, num_experts=num_experts, block_size=block_size)
  counts = np.bincount(np.asarray(index).ravel(), minlength=num_experts)
  blocks = -(-counts // block_size)
  np.testing.assert_array_equal(plan.block_bounds, np.concatenate([[0], np.cumsum(blocks)]))
  # Every choice sits in its expert's blocks, each row holds at most one choice.
  row_choice = np.asarray(plan.slots.slot_choice).ravel()
  choice_row = np.asarray(plan.slots.choice_slot).ravel()
  np.testing.assert_array_equal(row_choice[choice_row], np.arange(index.size))
  row_expert = np.repeat(np.repeat(np.arange(num_experts), blocks), block_size)
  np.testing.assert_array_equal(row_expert[choice_row], np.asarray(index).ravel())
  # The work: T k rows rounded up to a block per expert, far below E * C capacity slots.
  assert int(plan.block_bounds[-1]) * block_size < index.size + num_experts * block_size
  # Rows past the used blocks are never computed: NaNs there change nothing.
  dim, experts = D, _experts(1, num_experts=num_experts)
  rows = _normal(2, (len(row_choice) // block_size, block_size, dim))
  used = int(plan.block_bounds[-1])
  out = block_mlp(rows, plan.block_bounds, experts)
  poisoned = rows.at[used:].set(jnp.nan)
  out_poisoned = block_mlp(poisoned, plan.block_bounds, experts)
  np.testing.assert_array_equal(out, out_poisoned)
  np.testing.assert_array_equal(out[used:], 0.0)


# ---------------------------------------------------------------------------
# jit + bfloat16
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DISPATCH_ALGORITHMS))
def test_bfloat16_under_jit(name):
  x32, experts = _normal(0, (G, S, D)), _experts(1)
  index, gates = _random_routing(2, G, S, E, K)
  y, stats = _jitted(name)(x32.astype(jnp.bfloat16), index, gates, experts, capacity=S)
  y_ref, _ = _jitted("dense")(x32, index, gates, experts)
  assert y.dtype == jnp.bfloat16 and y.shape == (G, S, D)
  assert stats.fraction_dropped.dtype == jnp.float32
  scale = float(jnp.abs(y_ref).max())
  np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, rtol=0, atol=3e-2 * scale)


def test_registry_and_interface():
  assert DISPATCH_ALGORITHMS == {
      "dense": moe_dense,
      "einsum": moe_einsum,
      "einsum_fused": moe_einsum_fused,
      "sort": moe_sort,
      "sort_blocks": moe_sort_blocks,
      "dropless": moe_dropless,
      "blocksparse": moe_blocksparse,
  }
  experts = _experts(0)
  assert experts.num_experts == E
  with pytest.raises(ValueError, match="gates"):
    moe_sort(jnp.zeros((G, S, D)), jnp.zeros((G, S, K), jnp.int32), jnp.zeros((G, S)), experts)
  with pytest.raises(ValueError, match="capacity"):
    moe_einsum(
        jnp.zeros((G, S, D)),
        jnp.zeros((G, S, K), jnp.int32),
        jnp.zeros((G, S, K)),
        experts,
        capacity=0,
    )
