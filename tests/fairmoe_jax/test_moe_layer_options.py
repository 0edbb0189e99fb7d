"""SparseMoE options: router choice, batch-priority routing, module mode, router context, and
parameters independent of the mesh."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax.methods.base import moe_kwargs
from fairmoe_jax.moe import SparseMoE
from fairmoe_jax.moe.routers import route_from_logits
from trainkit.mesh import make_mesh

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2


def _layer(**kw) -> SparseMoE:
  return SparseMoE(DIM, HIDDEN, EXPERTS, TOP_K, rngs=nnx.Rngs(0), **kw)


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _randomise(layer: SparseMoE, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  for var in (layer.router.gate.kernel, layer.w1, layer.b1, layer.w2, layer.b2):
    var.set_value(jnp.asarray(0.5 * rng.normal(size=var.shape), jnp.float32))


def _experts_np(layer: SparseMoE, x: np.ndarray) -> np.ndarray:
  """[T, D] float64 -> [E, T, D]: every expert on every token (numpy reference)."""
  w1, b1, w2, b2 = (
      np.asarray(getattr(layer, n)[...], np.float64) for n in ("w1", "b1", "w2", "b2")
  )
  h = np.einsum("td,edh->eth", x, w1) + b1[:, None]
  h = 0.5 * h * (1 + scipy.special.erf(h / np.sqrt(2)))  # exact GELU
  return np.einsum("eth,ehd->etd", h, w2) + b2[:, None]


@nnx.jit(static_argnames="train")
def _apply(layer, x, train=None, rngs=None, context=None):
  return layer(x, train=train, rngs=rngs, context=context)


def test_expert_choice_layer_matches_numpy_reference():
  layer = _layer(router="expert_choice", capacity_factor=1.0)
  _randomise(layer, 1)
  x = _normal(2, (2, 6, DIM))
  y, aux = _apply(layer, x, train=True)

  capacity = 3  # ceil(1.0 * 6 tokens * k=2 / 4 experts)
  x64 = np.asarray(x, np.float64)
  kernel = np.asarray(layer.router.gate.kernel[...], np.float64)
  expected = np.zeros_like(x64)
  for g in range(2):
    logits = x64[g] @ kernel
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    outputs = _experts_np(layer, x64[g])
    for e in range(EXPERTS):
      for s in np.argsort(-probs[:, e], kind="stable")[:capacity]:
        expected[g, s] += probs[s, e] * outputs[e, s]
  np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
  assert float(aux.loss) == 0.0  # Balanced by construction.
  np.testing.assert_allclose(aux.metrics["tokens_per_expert"], np.full(EXPERTS, 3 / 12))


def test_noisy_router_is_random_in_training_only():
  layer = _layer(router="noisy_topk", capacity_factor=100.0)
  _randomise(layer, 2)
  layer.router.noise_gate.kernel.set_value(jnp.ones((DIM, EXPERTS)))
  x = _normal(3, (2, 6, DIM))
  y_eval_a, _ = _apply(layer, x, train=False)
  y_eval_b, _ = _apply(layer, x, train=False)
  np.testing.assert_array_equal(y_eval_a, y_eval_b)
  y_a, aux = _apply(layer, x, train=True, rngs=nnx.Rngs(noise=0))
  y_b, _ = _apply(layer, x, train=True, rngs=nnx.Rngs(noise=1))
  assert not np.allclose(y_a, y_b)
  assert float(aux.loss) > 0.0  # CV^2 of importance and load.
  with pytest.raises(ValueError, match="rngs"):
    layer(x, train=True)


def test_expert_choice_routes_alike_in_training_and_evaluation():
  """Expert choice's capacity is part of its function: the default config's larger evaluation
  capacity (token choice's) leaves its evaluation routing that of training."""
  config = fairmoe_config.base_config()
  config.update(method="smoe")
  config.moe.update(router="expert_choice", num_experts=EXPERTS, top_k=TOP_K)
  assert config.moe.eval_capacity_factor > config.moe.capacity_factor
  fairmoe_config.validate(config, num_devices=8)
  layer = SparseMoE(DIM, HIDDEN, rngs=nnx.Rngs(0), **moe_kwargs(config, None, "expert_choice"))
  _randomise(layer, 5)
  x = _normal(6, (2, 12, DIM))
  (y_train, aux_train), (y_eval, aux_eval) = (_apply(layer, x, train=t) for t in (True, False))
  np.testing.assert_array_equal(y_train, y_eval)
  np.testing.assert_array_equal(
      aux_train.routing[""].expert_fraction, aux_eval.routing[""].expert_fraction
  )


def test_layer_follows_module_mode_without_train_argument():
  layer = _layer(capacity_factor=0.25, eval_capacity_factor=100.0)
  _randomise(layer, 3)
  x = _normal(4, (2, 8, DIM))
  _, aux_default = _apply(layer, x)  # A fresh module trains.
  assert float(aux_default.metrics["fraction_dropped"]) > 0.0
  layer.eval()
  _, aux_eval = _apply(layer, x)
  assert float(aux_eval.metrics["fraction_dropped"]) == 0.0
  layer.train()
  _, aux_train = _apply(layer, x)
  assert float(aux_train.metrics["fraction_dropped"]) > 0.0


def test_batch_priority_drops_the_least_confident_choices():
  x = _normal(5, (3, 10, DIM))
  plain, bpr = _layer(capacity_factor=0.5), _layer(capacity_factor=0.5, batch_priority=True)
  _randomise(plain, 4)
  _randomise(bpr, 4)
  y_plain, aux_plain = _apply(plain, x)
  y_bpr, aux_bpr = _apply(bpr, x)
  assert float(aux_bpr.metrics["fraction_dropped"]) > 0.0
  np.testing.assert_allclose(
      aux_bpr.metrics["fraction_dropped"], aux_plain.metrics["fraction_dropped"]
  )
  assert not np.allclose(y_plain, y_bpr)

  # Reference: per example, serve top-1 choices by decreasing gate, then top-2 choices.
  route = route_from_logits(x.reshape(30, DIM) @ bpr.router.gate.kernel[...], TOP_K)
  index = np.asarray(route.expert_index).reshape(3, 10, TOP_K)
  gates = np.asarray(route.gates).reshape(3, 10, TOP_K)
  outputs = _experts_np(bpr, np.asarray(x, np.float64).reshape(30, DIM)).reshape(
      EXPERTS, 3, 10, DIM
  )
  capacity = 3  # ceil(0.5 * 10 * 2 / 4)
  expected = np.zeros((3, 10, DIM))
  for g in range(3):
    load = np.zeros(EXPERTS, int)
    order = np.argsort(-gates[g].max(-1), kind="stable")
    for choice in range(TOP_K):
      for s in order:
        e = index[g, s, choice]
        if load[e] < capacity:
          load[e] += 1
          expected[g, s] += gates[g, s, choice] * outputs[e, g, s]
  np.testing.assert_allclose(np.asarray(y_bpr), expected, rtol=1e-5, atol=1e-5)


def test_batch_priority_changes_nothing_when_capacity_suffices():
  x = _normal(6, (2, 6, DIM))
  plain, bpr = _layer(capacity_factor=100.0), _layer(capacity_factor=100.0, batch_priority=True)
  y_plain, _ = _apply(plain, x)
  y_bpr, aux = _apply(bpr, x)
  np.testing.assert_allclose(y_bpr, y_plain, rtol=1e-6, atol=1e-6)
  assert float(aux.metrics["fraction_dropped"]) == 0.0


class _GroupRouter(nnx.Module):
  """Routes every token to the expert named by its example's `group` context (test double)."""

  def __call__(self, x, *, train, rngs, context: Mapping[str, jax.Array]):
    logits = 10.0 * jax.nn.one_hot(context["group"], EXPERTS) + 0.0 * x[:, :EXPERTS]
    return route_from_logits(logits, 1)


def test_custom_router_receives_per_token_context():
  layer = SparseMoE(
      DIM, HIDDEN, EXPERTS, 1, router=_GroupRouter(), capacity_factor=100.0, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(0)
  for var in (layer.w1, layer.b1, layer.w2, layer.b2):
    var.set_value(jnp.asarray(0.5 * rng.normal(size=var.shape), jnp.float32))
  x = _normal(7, (3, 5, DIM))
  groups = jnp.array([2, 0, 3])
  y, aux = _apply(layer, x, context={"group": groups})
  outputs = _experts_np(layer, np.asarray(x, np.float64).reshape(15, DIM)).reshape(
      EXPERTS, 3, 5, DIM
  )
  gate = 1.0 / (1.0 + 3.0 * np.exp(-10.0))
  expected = np.stack([gate * outputs[g, i] for i, g in enumerate([2, 0, 3])])
  np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
  usage = np.asarray(aux.metrics["example_expert_fraction"])
  np.testing.assert_array_equal(usage.argmax(-1), [2, 0, 3])


class _FixedRouter(nnx.Module):
  """Routes every token with the same logits (a router-protocol module)."""

  def __init__(self, logits):
    self.fixed = jnp.asarray(logits, jnp.float32)

  def __call__(self, x, *, train=False, rngs=None, context=None):
    return route_from_logits(jnp.broadcast_to(self.fixed, (x.shape[0], EXPERTS)), 2)


def test_gate_weight_tells_a_dominant_expert_from_an_even_split():
  x = _normal(3, (2, 5, DIM))
  # Both routers choose experts 0 and 1 for every token: identical choice counts.
  dominant = SparseMoE(
      DIM,
      HIDDEN,
      EXPERTS,
      2,
      router=_FixedRouter([8.0, 0.0, -9.0, -9.0]),
      capacity_factor=100.0,
      rngs=nnx.Rngs(0),
  )
  even = SparseMoE(
      DIM,
      HIDDEN,
      EXPERTS,
      2,
      router=_FixedRouter([1.0, 1.0, -9.0, -9.0]),
      capacity_factor=100.0,
      rngs=nnx.Rngs(0),
  )
  (_, a), (_, b) = _apply(dominant, x), _apply(even, x)
  np.testing.assert_allclose(
      a.metrics["example_expert_fraction"], b.metrics["example_expert_fraction"]
  )
  for aux, logits in ((a, [8.0, 0.0, -9.0, -9.0]), (b, [1.0, 1.0, -9.0, -9.0])):
    probs = scipy.special.softmax(np.asarray(logits, np.float64))
    expected = np.where(np.arange(EXPERTS) < 2, probs, 0.0)  # Top-2 gates, not renormalised.
    np.testing.assert_allclose(
        aux.metrics["example_gate_weight"], np.tile(expected, (2, 1)), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("router", ["topk", "noisy_topk"])
def test_same_seed_gives_same_parameters_whatever_the_mesh(router):
  def params(mesh):
    layer = SparseMoE(DIM, HIDDEN, 8, TOP_K, router=router, mesh=mesh, rngs=nnx.Rngs(params=42))
    return {
        "/".join(map(str, k)): np.asarray(v.get_value())
        for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))
    }

  reference = params(None)
  for data, expert in [(1, 8), (2, 4), (4, 2), (8, 1)]:
    mesh = make_mesh({"data": data, "expert": expert})
    with jax.set_mesh(mesh):
      sharded = params(mesh)
    assert sharded.keys() == reference.keys()
    for name, value in reference.items():
      np.testing.assert_array_equal(sharded[name], value, err_msg=f"{name} on {data}x{expert}")


def test_bad_router_options_are_clear_errors():
  with pytest.raises(ValueError, match="router='nope'"):
    _layer(router="nope")
  with pytest.raises(ValueError, match="batch_priority"):
    _layer(router="expert_choice", batch_priority=True)
  with pytest.raises(ValueError, match="expert-parallel"):
    _layer(router="expert_choice", mesh=make_mesh({"data": 4, "expert": 2}))
