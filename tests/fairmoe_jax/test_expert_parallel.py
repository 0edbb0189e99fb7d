"""Expert-parallel MoE (shard_map + all-to-all), `sort` and `einsum`, against the single-device
`moe_sort`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fairmoe_jax.moe import SparseMoE
from fairmoe_jax.moe.dispatch import ExpertWeights, moe_sort
from fairmoe_jax.moe.dispatch.expert_parallel import expert_parallel_moe
from trainkit.mesh import make_mesh

G, S, D, H, E, K = 16, 8, 16, 32, 8, 2
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
TOL = dict(rtol=1e-5, atol=1e-5)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _problem(seed=0, num_experts=E, skewed=False):
  """NumPy inputs (no eager JAX dispatch, which is slow on few cores)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((G, S, D), np.float32)
  logits = rng.standard_normal((G, S, num_experts), np.float32)
  if skewed:
    # Most tokens prefer the first experts, so their queues overflow.
    logits = logits - 2.0 * np.arange(num_experts, dtype=np.float32)
  expert_index = np.argsort(-logits, axis=-1)[..., :K].astype(np.int32)
  gate_logits = rng.standard_normal((G, S, K), np.float32)
  gates = np.exp(gate_logits) / np.exp(gate_logits).sum(-1, keepdims=True)
  normal = lambda scale, *shape: (scale * rng.standard_normal(shape)).astype(np.float32)
  experts = ExpertWeights(
      w1=normal(0.3, num_experts, D, H),
      b1=normal(0.1, num_experts, H),
      w2=normal(0.3, num_experts, H, D),
      b2=normal(0.1, num_experts, D),
  )
  return x, expert_index, gates, experts


def _loss_and_grads(algorithm, x, expert_index, gates, experts, cotangent):
  def loss(x, gates, experts):
    y, stats = algorithm(x, expert_index, gates, experts)
    return jnp.sum(y * cotangent), (y, stats)

  (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x, gates, experts
  )
  return y, stats, grads


def _assert_tree_close(actual, expected):
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL), actual, expected
  )


def _run(algorithm, capacity, **kwargs):
  """Jitted forward and gradients of <y, cotangent> w.r.t. x, gates and the experts."""
  x, expert_index, gates, experts = _problem(seed=capacity or 0, skewed=capacity == 1)
  cotangent = np.random.default_rng(7).standard_normal(x.shape, np.float32)
  fn = functools.partial(algorithm, capacity=capacity, **kwargs)
  out = jax.jit(functools.partial(_loss_and_grads, fn))(x, expert_index, gates, experts, cotangent)
  return jax.tree.map(np.asarray, out)


@functools.lru_cache(maxsize=None)
def _reference(capacity):
  """moe_sort results, shared by the meshes (one compilation per capacity)."""
  return _run(moe_sort, capacity)


# `einsum` on two meshes only (each case is a compile): one expert per shard, and two.
EP_CASES = [pytest.param(s, "sort", id=f"data{s[0]}xexpert{s[1]}") for s in MESHES] + [
    pytest.param(s, "einsum", id=f"einsum-data{s[0]}xexpert{s[1]}") for s in [(1, 8), (4, 2)]
]


@pytest.mark.parametrize("capacity", [None, 1], ids=["ample", "overflow"])
@pytest.mark.parametrize(("mesh_shape", "algorithm"), EP_CASES)
def test_matches_moe_sort(mesh_shape, algorithm, capacity):
  mesh = make_mesh({"data": mesh_shape[0], "expert": mesh_shape[1]})
  y_ref, stats_ref, grads_ref = _reference(capacity)
  ep = functools.partial(expert_parallel_moe, algorithm=algorithm)
  y, stats, grads = _run(ep, capacity, mesh=mesh)

  np.testing.assert_allclose(y, y_ref, **TOL)
  np.testing.assert_array_equal(stats.kept, stats_ref.kept)
  _assert_tree_close(stats, stats_ref)
  _assert_tree_close(grads, grads_ref)
  # Every input got a gradient, including every expert (they all receive tokens).
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  if capacity is None:
    assert stats.kept.all() and stats.fraction_dropped == 0.0
  else:
    assert 0.0 < stats.fraction_dropped < 1.0
    # Top-1 choices are served before any top-2 choice.
    assert stats.kept[..., 0].mean() > stats.kept[..., 1].mean()


def test_einsum_builds_its_buffers_without_row_gathers():
  """Expert-parallel `einsum` dispatches and combines by one-hot einsums (`moe_einsum`), forward
  and backward, around the same four all-to-alls as `sort`, whose row gathers it does not run."""
  mesh = make_mesh({"data": 4, "expert": 2})
  x, expert_index, gates, experts = _problem(seed=6)
  fn = functools.partial(expert_parallel_moe, capacity=2, mesh=mesh, algorithm="einsum")
  step = jax.jit(functools.partial(_loss_and_grads, fn))
  text = step.lower(x, expert_index, gates, experts, x).compile().as_text()
  assert text.count(" all-to-all(") == 4
  assert text.count(" gather(") == 0


def test_sharded_inputs_and_outputs():
  """With inputs already laid out as in training, the output keeps the batch sharding."""
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem(seed=3)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert")))
  expert_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
  x_s, index_s, gates_s = (jax.device_put(a, batch) for a in (x, expert_index, gates))
  experts_s = jax.device_put(experts, expert_sharding)

  fn = jax.jit(functools.partial(expert_parallel_moe, capacity=2, mesh=mesh))
  y, stats = fn(x_s, index_s, gates_s, experts_s)
  y_ref, stats_ref = jax.jit(functools.partial(moe_sort, capacity=2))(
      x, expert_index, gates, experts
  )
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), **TOL)
  _assert_tree_close(stats, stats_ref)
  assert y.sharding.is_equivalent_to(batch, y.ndim)


def test_bfloat16_close_to_moe_sort():
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem(seed=4)
  x = jnp.asarray(x, jnp.bfloat16)
  y, _ = jax.jit(functools.partial(expert_parallel_moe, capacity=2, mesh=mesh))(
      x, expert_index, gates, experts
  )
  y_ref, _ = jax.jit(functools.partial(moe_sort, capacity=2))(x, expert_index, gates, experts)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=2e-2, atol=2e-2
  )


def test_indivisible_experts_raises():
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem(num_experts=6)
  with pytest.raises(ValueError, match=r"num_experts=6.*size 4.*'expert'"):
    expert_parallel_moe(x, expert_index, gates, experts, capacity=2, mesh=mesh)


def test_indivisible_batch_raises():
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem()
  with pytest.raises(ValueError, match=r"12 is not divisible by the\s+8 devices"):
    expert_parallel_moe(x[:12], expert_index[:12], gates[:12], experts, capacity=2, mesh=mesh)


def test_dropless_not_implemented():
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem()
  with pytest.raises(NotImplementedError, match="ragged_all_to_all"):
    expert_parallel_moe(
        x, expert_index, gates, experts, capacity=None, mesh=mesh, algorithm="dropless"
    )


def test_unknown_algorithm_raises():
  mesh = make_mesh({"data": 2, "expert": 4})
  x, expert_index, gates, experts = _problem()
  with pytest.raises(ValueError, match="dense"):
    expert_parallel_moe(x, expert_index, gates, experts, capacity=2, mesh=mesh, algorithm="dense")


def _layer(mesh):
  # The same seed draws the same weights with or without a mesh.
  return SparseMoE(D, H, E, K, capacity_factor=1.0, mesh=mesh, rngs=nnx.Rngs(0))


def _layer_loss_and_grads(layer, x, cotangent, *, jit):
  def loss(layer, x):
    y, _ = layer(x)
    return jnp.sum(y * cotangent), y

  grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  if jit:
    grad_fn = nnx.jit(grad_fn)
  (_, y), (layer_grads, x_grad) = grad_fn(layer, x)
  grads = nnx.to_pure_dict(nnx.state(layer_grads, nnx.Param))
  return np.asarray(y), jax.tree.map(np.asarray, grads), np.asarray(x_grad)


@functools.lru_cache(maxsize=None)
def _single_device_layer_results():
  x, _, _, _ = _problem(seed=5)
  cotangent = np.random.default_rng(8).standard_normal(x.shape, np.float32)
  return x, cotangent, _layer_loss_and_grads(_layer(None), x, cotangent, jit=True)


def _assert_layer_results_match(results, expected):
  y, layer_grads, x_grad = results
  np.testing.assert_allclose(y, expected[0], **TOL)
  _assert_tree_close(layer_grads, expected[1])
  np.testing.assert_allclose(x_grad, expected[2], **TOL)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"data{s[0]}xexpert{s[1]}")
def test_layer_on_a_default_jax_make_mesh_matches_one_device(mesh_shape):
  """`jax.make_mesh` gives Explicit axes; unsharded inputs, outside any mesh context."""
  mesh = jax.make_mesh(mesh_shape, ("data", "expert"))
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  x, cotangent, expected = _single_device_layer_results()
  _assert_layer_results_match(_layer_loss_and_grads(_layer(mesh), x, cotangent, jit=True), expected)


def test_layer_with_sharded_inputs_inside_set_mesh_keeps_their_layout():
  """On Explicit axes, sharded inputs need the mesh set (as any JAX computation on them
  does); the layer built there has its expert weights sharded too."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  x, cotangent, expected = _single_device_layer_results()
  with jax.set_mesh(mesh):
    layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    layer = _layer(mesh)
    assert layer.w1[...].sharding.spec[0] == "expert"
    y, _ = nnx.jit(lambda m, x: m(x))(layer, jax.device_put(x, layout))
    assert y.sharding.spec[0] == "data"
    results = _layer_loss_and_grads(layer, jax.device_put(x, layout), cotangent, jit=True)
  _assert_layer_results_match(results, expected)


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_layer_eagerly_matches_one_device(axis_type):
  axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 2
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=axis_types)
  x, cotangent, expected = _single_device_layer_results()
  _assert_layer_results_match(
      _layer_loss_and_grads(_layer(mesh), x, cotangent, jit=False), expected
  )


def test_layer_on_an_auto_mesh_with_unsharded_inputs_matches_one_device():
  mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x, cotangent, expected = _single_device_layer_results()
  _assert_layer_results_match(_layer_loss_and_grads(_layer(mesh), x, cotangent, jit=True), expected)


def test_a_batch_that_does_not_divide_the_mesh_is_padded_with_empty_examples():
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  x, cotangent, _ = _single_device_layer_results()
  x, cotangent = x[:6], cotangent[:6]  # Padded to 8 examples, one per device.
  expected = _layer_loss_and_grads(_layer(None), x, cotangent, jit=True)
  _assert_layer_results_match(_layer_loss_and_grads(_layer(mesh), x, cotangent, jit=True), expected)
