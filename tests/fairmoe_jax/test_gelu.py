"""The experts' exact GELU: jax's values, its derivative, and differentiable under shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import special

from fairmoe_jax.moe.dispatch.experts import gelu_exact

# jax 0.11 changed how it differentiates erfc (through lax.polynomial); up to 0.10 our rule
# is jax's own, op for op.
JAX_DERIVES_ERFC_PLAINLY = jax.__version_info__ < (0, 11)


def _points(dtype, n=2048):
  # Tails included: erfc(-x / sqrt(2)) underflows for x < -13 and saturates for x > 6.
  x = np.random.RandomState(0).randn(n) * 5.0
  return jnp.asarray(np.concatenate([x, [-40.0, -13.0, -1.0, 0.0, 1.0, 13.0, 40.0]]), dtype)


def _gelu_f64(x):
  return 0.5 * x * special.erfc(-x / np.sqrt(2.0))


def _gelu_slope_f64(x):
  return 0.5 * special.erfc(-x / np.sqrt(2.0)) + x * np.exp(-0.5 * x**2) / np.sqrt(2.0 * np.pi)


def test_values_and_gradients_match_a_float64_reference():
  x = _points(jnp.float32)
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(gelu_exact(x), _gelu_f64(x64), rtol=2e-6, atol=1e-6)
  slope = jax.vmap(jax.grad(gelu_exact))(x)
  np.testing.assert_allclose(slope, _gelu_slope_f64(x64), rtol=1e-5, atol=1e-6)
  # Second order works too (the rule is itself differentiable).
  curvature = jax.vmap(jax.grad(jax.grad(gelu_exact)))(jnp.asarray([-1.0, 0.0, 2.0]))
  expected = (2.0 - np.array([-1.0, 0.0, 2.0]) ** 2) * np.exp(-0.5 * np.array([1.0, 0.0, 4.0]))
  np.testing.assert_allclose(curvature, expected / np.sqrt(2.0 * np.pi), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_values_and_gradients_as_jax_nn_gelu(dtype):
  x = _points(dtype)
  cotangent = jnp.asarray(np.random.RandomState(1).randn(x.size), dtype)

  def values_and_vjp(f):
    @jax.jit
    def run(x, cotangent):
      y, vjp = jax.vjp(f, x)
      return y, vjp(cotangent)[0]

    return [np.asarray(a, np.float64) for a in run(x, cotangent)]

  ours = values_and_vjp(gelu_exact)
  theirs = values_and_vjp(lambda h: jax.nn.gelu(h, approximate=False))
  np.testing.assert_array_equal(ours[0], theirs[0])
  if JAX_DERIVES_ERFC_PLAINLY:
    # The pinned stack's training results are those of jax.nn.gelu, bit for bit.
    np.testing.assert_array_equal(ours[1], theirs[1])
  else:
    # jax's newer erfc derivative rounds differently in the last bit.
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6, atol=1e-6)


def test_differentiable_inside_shard_map_with_varying_inputs():
  # jax.nn.gelu(approximate=False) fails here on jax 0.11+ ("Primitive polynomial requires
  # varying manual axes to match"); the expert-parallel layer depends on this.
  mesh = jax.make_mesh(
      (2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2]
  )
  x = jax.device_put(jnp.linspace(-3.0, 3.0, 8), NamedSharding(mesh, P("x")))
  slope = jax.jit(
      jax.shard_map(
          jax.grad(lambda h: gelu_exact(h).sum()), mesh=mesh, in_specs=P("x"), out_specs=P("x")
      )
  )(x)
  np.testing.assert_allclose(slope, _gelu_slope_f64(np.linspace(-3.0, 3.0, 8)), rtol=1e-5)
