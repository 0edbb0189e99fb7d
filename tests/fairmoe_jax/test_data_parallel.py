"""A `SparseMoE` built without a mesh runs per device on the mesh in context (`jax.set_mesh`),
a batch that does not divide it padded: the same outputs and statistics as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fairmoe_jax.moe import SparseMoE
from trainkit.mesh import make_mesh


@pytest.mark.parametrize("router", ["topk", "expert_choice"])
def test_a_mesh_in_context_pads_a_batch_and_gives_the_one_device_results(router):
  layer = SparseMoE(16, 32, 4, 2, capacity_factor=1.0, router=router, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (12, 8, 16))  # Padded to 16 on 8 devices.
  mesh = make_mesh({"data": 8, "expert": 1})
  step = nnx.jit(lambda layer, x: layer(x, train=True))
  want, want_aux = step(layer, x)
  with jax.set_mesh(mesh):
    got, aux = step(layer, x)
  # The same float32 sums per token, whichever device: equal up to their order.
  np.testing.assert_allclose(got, want, rtol=0, atol=4 * jnp.finfo(jnp.float32).eps)
  for name in ("fraction_dropped", "example_expert_fraction", "tokens_per_expert"):
    np.testing.assert_array_equal(aux.metrics[name], want_aux.metrics[name])
  if router == "topk":  # Capacity binds: drops are compared.
    assert 0 < want_aux.metrics["fraction_dropped"] < 1
