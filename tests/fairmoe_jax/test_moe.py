"""Tests for fairmoe_jax.moe: routing, capacity dispatch and the SparseMoE layer."""

from __future__ import annotations

import functools
from dataclasses import fields

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from fairmoe_jax.moe import (
    MoEAux,
    SparseMoE,
    TopKRouter,
    compute_capacity,
    dispatch_and_combine_masks,
    route_from_logits,
)
from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS, ExpertWeights
from fairmoe_jax.moe.routers.base import RouterOutput, float32_gate
from moe_cases import HAND_BUILT_EXPECTED_KEPT, HAND_BUILT_PREFERENCES

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

PARAM_NAMES = ("gate", "w1", "b1", "w2", "b2")

# Everything runs under jit: op-by-op execution compiles every primitive
# separately and is several times slower on CPU.


@functools.partial(jax.jit, static_argnames="train")
def _apply(layer: SparseMoE, x: jax.Array, train: bool = True) -> tuple[jax.Array, MoEAux]:
  return layer(x, train=train)


@jax.jit
def _route(router: TopKRouter, x: jax.Array):
  return router(x)


_route_from_logits = jax.jit(route_from_logits, static_argnums=1)
_masks = jax.jit(dispatch_and_combine_masks, static_argnames=("num_experts", "capacity"))


# Same shapes as the MoE block of tests/fairmoe_jax/test_vit.py: eager initialisers compile
# once per distinct shape, so sharing shapes keeps the test session short.
DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2


def _make_layer(**kw) -> SparseMoE:
  return SparseMoE(DIM, HIDDEN, EXPERTS, TOP_K, rngs=nnx.Rngs(0), **kw)


def _randomise(layer: SparseMoE, seed: int = 0) -> None:
  """Larger-than-init weights: outputs O(1) and well separated router probs."""
  rng = np.random.default_rng(seed)
  kernel = layer.router.gate.kernel
  kernel.set_value(jnp.asarray(rng.normal(size=kernel.shape), jnp.float32))
  for name in ("w1", "b1", "w2", "b2"):
    p = getattr(layer, name)
    p.set_value(jnp.asarray(0.3 * rng.normal(size=p.shape), jnp.float32))


def _normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  # NumPy RNG: eager jax.random calls would each compile on first use.
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _params(layer: SparseMoE) -> dict[str, jax.Array]:
  return {
      "gate": layer.router.gate.kernel[...],
      **{n: getattr(layer, n)[...] for n in ("w1", "b1", "w2", "b2")},
  }


def _dense_reference(params, x, top_k):
  """Every expert on every token, weighted by the softmax prob if chosen, else 0.

  x: [T, D]. Written independently of the library (no capacity at all).
  """
  probs = jax.nn.softmax(x @ params["gate"], axis=-1)
  # Top-k membership via ranks (decisions carry no gradient).
  ranks = jnp.argsort(jnp.argsort(-jax.lax.stop_gradient(probs), axis=-1), axis=-1)
  weights = jnp.where(ranks < top_k, probs, 0.0)
  h = jax.nn.gelu(jnp.einsum("td,edh->teh", x, params["w1"]) + params["b1"], approximate=False)
  out = jnp.einsum("teh,ehd->ted", h, params["w2"]) + params["b2"]
  return jnp.einsum("te,ted->td", weights, out)


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


def test_router_outputs_and_float32_logits():
  router = TopKRouter(DIM, EXPERTS, TOP_K, rngs=nnx.Rngs(1))
  x = _normal(0, (10, DIM), jnp.bfloat16)
  out = _route(router, x)
  assert out.logits.dtype == out.probs.dtype == out.gates.dtype == jnp.float32
  assert out.probs.shape == (10, 4) and out.expert_index.shape == out.gates.shape == (10, 2)
  np.testing.assert_allclose(out.probs.sum(-1), 1.0, rtol=1e-6)
  # Gates are the (not renormalised) probabilities of the chosen experts, best first.
  np.testing.assert_array_equal(
      out.gates, np.take_along_axis(np.asarray(out.probs), np.asarray(out.expert_index), -1)
  )
  assert np.all(np.asarray(out.gates[:, 0]) >= np.asarray(out.gates[:, 1]))


def test_aux_losses_match_hand_computation():
  logits = np.array(
      [[2.0, 0.5, -1.0], [0.1, 0.3, 0.2], [-2.0, 1.0, 3.0], [1.0, 1.5, 0.0]], np.float32
  )
  t, e, k = logits.shape[0], logits.shape[1], 2
  out = _route_from_logits(jnp.asarray(logits), k)

  l64 = logits.astype(np.float64)
  probs = np.exp(l64) / np.exp(l64).sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :k]
  counts = np.zeros(e)
  for row in top:
    counts[row] += 1
  f = counts / (t * k)
  expected_lb = e * np.sum(f * probs.mean(0))
  expected_z = np.mean(np.log(np.exp(l64).sum(-1)) ** 2)

  np.testing.assert_array_equal(out.expert_index, top)
  np.testing.assert_allclose(out.load_balance_loss, expected_lb, rtol=1e-6)
  np.testing.assert_allclose(out.z_loss, expected_z, rtol=1e-6)


def test_load_balance_loss_is_one_for_uniform_router():
  out = _route_from_logits(jnp.zeros((5, 4)), 2)
  np.testing.assert_allclose(out.load_balance_loss, 1.0, rtol=1e-6)
  np.testing.assert_allclose(out.z_loss, np.log(4.0) ** 2, rtol=1e-6)


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [((8, 4, 2, 1.25), 5), ((20, 4, 2, 1.1), 11), ((4, 8, 1, 0.1), 1), ((4, 4, 2, 100.0), 4)],
)
def test_compute_capacity(args, expected):
  assert compute_capacity(*args) == expected


def _hand_routed_inputs() -> np.ndarray:
  x = np.zeros((2, 6, DIM), np.float32)
  for g, prefs in enumerate(HAND_BUILT_PREFERENCES):
    for s, (a, b) in enumerate(prefs):
      x[g, s, a], x[g, s, b] = 3.0, 2.0
  return x


def test_capacity_overflow_drops_by_priority():
  layer = _make_layer(capacity_factor=1.0)
  _randomise(layer)
  layer.router.gate.kernel.set_value(jnp.eye(DIM, EXPERTS))
  x = _hand_routed_inputs()
  assert compute_capacity(6, 4, 2, 1.0) == 3

  y, aux = _apply(layer, jnp.asarray(x))

  # Mask level: exactly the expected choices survive.
  route = _route(layer.router, jnp.asarray(x).reshape(12, DIM))
  _, _, stats = _masks(
      route.expert_index.reshape(2, 6, 2), route.gates.reshape(2, 6, 2), num_experts=4, capacity=3
  )
  np.testing.assert_array_equal(stats.kept, HAND_BUILT_EXPECTED_KEPT)
  np.testing.assert_allclose(aux.metrics["fraction_dropped"], 9 / 24, rtol=1e-6)

  # Output level: dense reference restricted to the kept choices.
  params = _params(layer)
  idx = np.asarray(route.expert_index).reshape(2, 6, 2)
  gates = np.asarray(route.gates).reshape(2, 6, 2) * HAND_BUILT_EXPECTED_KEPT
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  pre = np.einsum("gsd,edh->gseh", x, p["w1"]) + p["b1"]
  h = 0.5 * pre * (1.0 + scipy.special.erf(pre / np.sqrt(2.0)))  # exact GELU
  out_all = np.einsum("gseh,ehd->gsed", h, p["w2"]) + p["b2"]
  expected = np.einsum("gsk,gskd->gsd", gates, np.take_along_axis(out_all, idx[..., None], 2))
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  # Tokens that lost both choices contribute exactly nothing (residual only).
  np.testing.assert_array_equal(np.asarray(y)[1, 3:], 0.0)

  # Per-example usage of served choices, as a fraction of S * k = 12.
  np.testing.assert_allclose(
      aux.metrics["example_expert_fraction"], np.array([[3, 3, 2, 1], [3, 3, 0, 0]]) / 12, rtol=1e-6
  )


@pytest.mark.parametrize("multiple_of", [1, 4, 8])
@pytest.mark.parametrize(
    "args", [(197, 4, 2, 1.25), (197, 64, 2, 1.25), (6, 4, 2, 1.0), (5, 8, 1, 0.1)]
)
def test_capacity_is_rounded_up_to_its_multiple(args, multiple_of):
  unrounded = compute_capacity(*args)
  capacity = compute_capacity(*args, multiple_of=multiple_of)
  assert capacity % multiple_of == 0 and unrounded <= capacity < unrounded + multiple_of
  with pytest.raises(ValueError, match="multiple_of"):
    compute_capacity(*args, multiple_of=0)


# Served choices of HAND_BUILT_PREFERENCES routed as ONE group of both examples: C = 12 * 2 / 4 =
# 6. Expert 0's six slots go to example 0's t1-t4 and example 1's t0, t1 (top-1 choices first,
# in token order), so example 1's t2 loses the top-1 choice it keeps when routed alone (C = 3).
GROUPED_EXPECTED_KEPT = np.array(
    [
        [[1, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 0]],
        [[1, 1], [1, 1], [0, 1], [0, 0], [0, 0], [0, 0]],
    ],
    bool,
)


@pytest.mark.parametrize("dispatch", ["sort", "einsum"])
def test_group_size_makes_the_examples_of_a_group_compete_for_slots(dispatch):
  x = jnp.asarray(_hand_routed_inputs())
  outputs = {}
  for group_size in (1, 2):
    layer = _make_layer(capacity_factor=1.0, group_size=group_size, dispatch=dispatch)
    _randomise(layer)
    layer.router.gate.kernel.set_value(jnp.eye(DIM, EXPERTS))
    outputs[group_size] = _apply(layer, x)
  kept = {1: HAND_BUILT_EXPECTED_KEPT, 2: GROUPED_EXPECTED_KEPT}

  route = _route(layer.router, x.reshape(12, DIM))
  idx = np.asarray(route.expert_index).reshape(2, 6, 2)
  p = {k: np.asarray(v, np.float64) for k, v in _params(layer).items()}
  pre = np.einsum("gsd,edh->gseh", np.asarray(x), p["w1"]) + p["b1"]
  out_all = np.einsum("gseh,ehd->gsed", pre * 0.5 * (1 + scipy.special.erf(pre / 2**0.5)), p["w2"])
  out_all = np.take_along_axis(out_all + p["b2"], idx[..., None], 2)
  for group_size, (y, aux) in outputs.items():
    gates = np.asarray(route.gates).reshape(2, 6, 2) * kept[group_size]
    np.testing.assert_allclose(y, np.einsum("gsk,gskd->gsd", gates, out_all), rtol=1e-5, atol=1e-6)
    # Per example again, as a fraction of its own S * k = 12 choices.
    served = np.stack([np.bincount(i[k], minlength=EXPERTS) for i, k in zip(idx, kept[group_size])])
    np.testing.assert_allclose(aux.metrics["example_expert_fraction"], served / 12, rtol=1e-6)
  assert not np.array_equal(outputs[1][0][1, 2], outputs[2][0][1, 2])
  with pytest.raises(ValueError, match="group_size=2 does not divide the batch of 1"):
    _apply(layer, x[:1])


def test_group_size_one_is_the_per_example_dispatch_bit_for_bit():
  layer = _make_layer(capacity_factor=0.5)
  _randomise(layer, seed=3)
  x = _normal(1, (4, 10, DIM))
  y, aux = _apply(layer, x)

  @jax.jit
  def per_example(layer, x):
    route = layer.router(x.reshape(40, DIM), train=True)
    return DISPATCH_ALGORITHMS["sort"](
        x,
        route.expert_index.reshape(4, 10, 2),
        route.gates.reshape(4, 10, 2),
        ExpertWeights.from_module(layer),
        capacity=compute_capacity(10, EXPERTS, TOP_K, 0.5),
    )

  expected_y, stats = per_example(layer, x)
  assert aux.metrics["fraction_dropped"] > 0  # The capacity limit is exercised.
  np.testing.assert_array_equal(y, expected_y)
  np.testing.assert_array_equal(aux.metrics["example_expert_fraction"], stats.group_expert_fraction)


def test_example_expert_fraction_accounts_for_drops():
  layer = _make_layer(capacity_factor=0.5)
  _randomise(layer, seed=3)
  x = _normal(1, (3, 10, DIM))
  _, aux = _apply(layer, x)

  route = _route(layer.router, x.reshape(30, DIM))
  capacity = compute_capacity(10, 4, 2, 0.5)
  _, _, stats = _masks(
      route.expert_index.reshape(3, 10, 2),
      route.gates.reshape(3, 10, 2),
      num_experts=4,
      capacity=capacity,
  )
  dropped_per_example = 1.0 - np.asarray(stats.kept).mean(axis=(1, 2))
  assert aux.metrics["fraction_dropped"] > 0  # The test must exercise drops.

  eef = np.asarray(aux.metrics["example_expert_fraction"])
  assert eef.shape == (3, 4)
  np.testing.assert_allclose(eef.sum(-1), 1.0 - dropped_per_example, rtol=1e-6)
  np.testing.assert_allclose(eef.mean(0), aux.metrics["tokens_per_expert"], rtol=1e-6)
  np.testing.assert_allclose(aux.metrics["fraction_dropped"], dropped_per_example.mean(), rtol=1e-6)
  np.testing.assert_allclose(aux.metrics["importance"], np.asarray(route.probs).mean(0), rtol=1e-5)
  p = np.asarray(route.probs, np.float64)
  entropy = -(p * np.log(p)).sum(-1).mean()
  np.testing.assert_allclose(aux.metrics["router_entropy"], entropy, rtol=1e-5)


# ---------------------------------------------------------------------------
# Layer
# ---------------------------------------------------------------------------


def test_matches_dense_reference_with_enough_capacity():
  layer = _make_layer(capacity_factor=100.0)
  _randomise(layer, seed=1)
  x = _normal(2, (2, 5, DIM))
  cotangent = _normal(3, (2, 5, DIM))
  graphdef, state = nnx.split(layer)

  def layer_loss(state, x):
    y, aux = nnx.merge(graphdef, state)(x, train=True)
    return jnp.sum(y * cotangent), (y, aux)

  (_, (y, aux)), (g_state, g_x) = jax.jit(
      jax.value_and_grad(layer_loss, argnums=(0, 1), has_aux=True)
  )(state, x)
  assert float(aux.metrics["fraction_dropped"]) == 0.0
  # Top-k decisions must not sit on a near-tie, or float32 and float64 may disagree.
  probs = np.sort(np.asarray(_route(layer.router, x.reshape(10, DIM)).probs), -1)[:, ::-1]
  assert np.min(probs[:, 1] - probs[:, 2]) > 1e-4

  with jax.enable_x64(True):
    p64 = {k: jnp.asarray(np.asarray(v), jnp.float64) for k, v in _params(layer).items()}
    x64 = jnp.asarray(np.asarray(x).reshape(10, DIM), jnp.float64)
    c64 = jnp.asarray(np.asarray(cotangent).reshape(10, DIM), jnp.float64)

    def ref_loss(p, x):
      return jnp.sum(_dense_reference(p, x, 2) * c64)

    y_ref = np.asarray(jax.jit(_dense_reference, static_argnums=2)(p64, x64, 2))
    g_ref, gx_ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(p64, x64)
    g_ref = jax.tree.map(np.asarray, g_ref)
    gx_ref = np.asarray(gx_ref)

  np.testing.assert_allclose(np.asarray(y).reshape(10, DIM), y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_x).reshape(10, DIM), gx_ref, rtol=1e-5, atol=1e-5)
  grads = {
      "gate": g_state["router"]["gate"]["kernel"][...],
      **{n: g_state[n][...] for n in ("w1", "b1", "w2", "b2")},
  }
  for name in PARAM_NAMES:
    np.testing.assert_allclose(grads[name], g_ref[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_eval_uses_eval_capacity_factor():
  layer = _make_layer(capacity_factor=0.25, eval_capacity_factor=100.0)
  _randomise(layer)
  x = _normal(0, (2, 8, DIM))
  _, aux_train = _apply(layer, x, train=True)
  _, aux_eval = _apply(layer, x, train=False)
  assert float(aux_train.metrics["fraction_dropped"]) > 0.0
  assert float(aux_eval.metrics["fraction_dropped"]) == 0.0


def test_bfloat16_compute_keeps_float32_params_and_routing():
  layer = _make_layer(dtype=jnp.bfloat16)
  x = _normal(0, (2, 5, DIM))
  y, aux = _apply(layer, x)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 5, DIM)
  assert aux.loss.dtype == aux.z_loss.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def test_expert_weights_are_annotated_for_expert_parallelism():
  layer = _make_layer()
  specs = nnx.get_partition_spec(nnx.state(layer))
  assert specs["w1"].get_value() == P("expert", None, None)
  assert specs["w2"].get_value() == P("expert", None, None)
  assert specs["b1"].get_value() == P("expert", None)
  assert specs["b2"].get_value() == P("expert", None)
  assert specs["router"]["gate"]["kernel"].get_value() == P()
  assert layer.w1.shape == (EXPERTS, DIM, HIDDEN) and layer.w2.shape == (EXPERTS, HIDDEN, DIM)


def test_moe_aux_merge_prefixes_and_sums():
  a = MoEAux(loss=jnp.array(1.0), z_loss=jnp.array(2.0), metrics={"m": jnp.array(3.0)})
  b = MoEAux(loss=jnp.array(0.5), z_loss=jnp.array(1.0), metrics={"m": jnp.array(4.0)})
  merged = MoEAux.merge({"moe_block1": a, "moe_block3": b})
  assert float(merged.loss) == 1.5 and float(merged.z_loss) == 3.0
  assert set(merged.metrics) == {"moe_block1/m", "moe_block3/m"}
  empty = MoEAux.merge({})
  assert float(empty.loss) == 0.0 and empty.metrics == {}


def test_a_wrong_token_width_fails_at_the_layer_not_in_dispatch():
  layer = _make_layer()
  with pytest.raises(AssertionError, match="axis"):
    layer(jnp.zeros((2, 5, DIM + 1)))
  with pytest.raises(AssertionError, match="rank"):
    layer(jnp.zeros((5, DIM)))


@struct.dataclass
class _ReadingRouterOutput(RouterOutput):
  """A router's output that adds a loss needing the experts and a per-example reading."""

  def expert_features(self, x, experts):
    tokens = jnp.broadcast_to(x[:, None], (x.shape[0], experts.num_experts, *x.shape[1:]))
    return experts.apply(tokens).mean(axis=2)

  def expert_losses(self, features, context):
    return {"expert_output_mean": jnp.mean(features), "context_examples": context["n"].sum()}

  def example_readings(self, batch, seq_len):
    return {"top_gate": self.gates[:, 0].reshape(batch, seq_len).mean(axis=1)}


class _ReadingRouter(nnx.Module):
  """A router module with `__call__` alone: whatever the layer needs comes in its output."""

  def __init__(self, dim, num_experts, top_k, *, rngs):
    self.gate = float32_gate(dim, num_experts, rngs=rngs)
    self.top_k = top_k

  def __call__(self, x, *, train=False, rngs=None, context=None):
    route = route_from_logits(self.gate(x), self.top_k)
    return _ReadingRouterOutput(**{f.name: getattr(route, f.name) for f in fields(route)})


@pytest.mark.slow
def test_the_layer_takes_a_router_s_extras_from_its_output_alone():
  """The router protocol: losses that need the experts (in training only) and per-example
  readings come back through the router's output, and `MoEAux.merge` names them by block."""
  layer = SparseMoE(DIM, HIDDEN, EXPERTS, TOP_K, router=_ReadingRouter, rngs=nnx.Rngs(0))
  _randomise(layer)
  x = _normal(1, (3, 5, DIM))
  context = {"n": jnp.ones((3,))}
  _, trained = layer(x, train=True, context=context)
  p = {k: np.asarray(v, np.float64) for k, v in _params(layer).items()}
  pre = np.einsum("gsd,edh->gseh", np.asarray(x, np.float64), p["w1"]) + p["b1"]
  h = 0.5 * pre * (1.0 + scipy.special.erf(pre / np.sqrt(2.0)))  # exact GELU
  served = np.einsum("gseh,ehd->gsed", h, p["w2"]) + p["b2"]  # Every expert on every token.
  np.testing.assert_allclose(trained.extra_losses["expert_output_mean"], served.mean(), rtol=1e-4)
  assert float(trained.extra_losses["context_examples"]) == 3.0
  _, evaluated = layer(x, train=False, context=context)
  assert evaluated.extra_losses == {}  # Expert losses are training's.
  (readings,) = evaluated.routing.values()
  route = layer.router(x.reshape(15, DIM))
  np.testing.assert_allclose(
      readings.router["top_gate"], np.asarray(route.gates[:, 0]).reshape(3, 5).mean(1), rtol=1e-6
  )
  np.testing.assert_array_equal(
      readings.expert_fraction, evaluated.metrics["example_expert_fraction"]
  )
  np.testing.assert_array_equal(readings.gate_weight, evaluated.metrics["example_gate_weight"])
  assert float(readings.fraction_dropped) == float(evaluated.metrics["fraction_dropped"])
  merged = MoEAux.merge({"moe_block1": evaluated, "moe_block3": evaluated})
  assert set(merged.routing) == {"moe_block1", "moe_block3"}
