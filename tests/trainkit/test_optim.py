"""The optimiser and learning-rate schedule (`trainkit.optim`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainkit.errors import ConfigError
from trainkit.optim import default_optimizer_config, learning_rate_schedule, make_optimizer


def test_schedule_warms_up_then_decays_to_the_floor():
  config = default_optimizer_config()
  config.learning_rate, config.warmup_steps, config.final_lr_fraction = 1.0, 10, 0.1
  schedule = learning_rate_schedule(config, 110)
  np.testing.assert_allclose(
      [schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
      [0.0, 0.5, 1.0, 0.55, 0.1],
      rtol=1e-5,
      atol=1e-6,
  )


@pytest.mark.parametrize(
    "scaling,batch_size,expected",
    [("none", 1024, 0.4), ("linear", 1024, 1.6), ("linear", 64, 0.1), ("sqrt", 1024, 0.8)],
)
def test_peak_learning_rate_scales_with_the_batch_size(scaling, batch_size, expected):
  config = default_optimizer_config()
  config.learning_rate, config.base_batch_size, config.lr_scaling = 0.4, 256, scaling
  config.warmup_steps, config.final_lr_fraction = 4, 0.25
  schedule = learning_rate_schedule(config, 20, batch_size)
  # The warm-up ends at the scaled peak and the floor is scaled with it.
  np.testing.assert_allclose([schedule(4), schedule(20)], [expected, expected * 0.25], rtol=1e-6)


def test_lr_scaling_is_a_validated_config_key(tmp_path):
  from fairmoe_jax import config as fairmoe_config

  config = fairmoe_config.base_config()
  config.optimizer.lr_scaling = "cubic"
  with pytest.raises(ConfigError, match="optimizer.lr_scaling"):
    fairmoe_config.validate(config, num_devices=1)


def test_optimizer_clips_and_skips_decay_on_vectors():
  config = default_optimizer_config()
  config.learning_rate, config.warmup_steps, config.weight_decay, config.grad_clip_norm = (
      0.1,
      0,
      0.5,
      1.0,
  )
  tx = make_optimizer(config, 10)
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  # With zero gradients only decoupled weight decay moves parameters: matrices, not vectors.
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_allclose(updates["b"], 0.0)
  huge = {"w": jnp.full((2, 2), 1e6), "b": jnp.full((2,), 1e6)}
  clip = optax.clip_by_global_norm(1.0)
  clipped, _ = clip.update(huge, clip.init(params))
  assert abs(float(optax.tree.norm(clipped)) - 1.0) < 1e-5
