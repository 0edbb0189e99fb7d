"""Noisy top-k gating (Shazeer et al. 2017), with its importance and smooth load losses
instead of the Switch loss; `NoisyRouterOutput` plugs into any capacity dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe.routers.base import RouterOutput, check_logits, float32_gate, router_z_loss
from fairmoe_jax.moe.routers.topk import TopKRouter


@struct.dataclass
class NoisyRouterOutput(RouterOutput):
  """`RouterOutput` of noisy top-k gating, with the paper's extra quantities.

  Inherited fields: `logits` are the noisy H(x) (clean at evaluation); `probs` is the paper's
  G(x) = softmax(KeepTopK(H(x), k)), 0 outside the k, column sums = Importance; `gates` are thus
  renormalised over the k (unlike `TopKRouter`); `load_balance_loss` is importance_weight *
  importance_loss + load_weight * load_loss (the paper's w = 0.1 is an outer weight of 0.1);
  `z_loss` is of the clean logits (not in the paper).

  Extra attributes:
    clean_logits: [T, E] float32 x W_g.
    noise_std: [T, E] float32 softplus(x W_noise).
    importance: [E] sum over tokens of `probs`.
    load: [E] smooth load estimator, sum over tokens of P(x, e) (`smooth_load`).
    importance_loss: scalar CV(importance)^2.
    load_loss: scalar CV(load)^2.
  """

  clean_logits: jax.Array
  noise_std: jax.Array
  importance: jax.Array
  load: jax.Array
  importance_loss: jax.Array
  load_loss: jax.Array


def cv_squared(x: jax.Array, eps: float = 1e-10) -> jax.Array:
  """Var(x) / (Mean(x)^2 + eps), population variance as in tensor2tensor; 0 for one element."""
  x = x.astype(jnp.float32)
  return jnp.zeros((), jnp.float32) if x.size <= 1 else jnp.var(x) / (jnp.square(jnp.mean(x)) + eps)


def smooth_load(
    clean_logits: jax.Array, noisy_logits: jax.Array, noise_std: jax.Array, top_k: int
) -> jax.Array:
  """Per-token P(x, e) of the paper's smooth load estimator, [T, E].

  P(x, e) = Phi((clean_e - kth_excluding(H, k, e)) / std_e), the probability that e is in the
  top-k if only its own noise were resampled; kth_excluding is the k-th largest noisy logit among
  the other experts. The threshold is not stop-gradiented (as in the reference code).
  """
  num_experts = noisy_logits.shape[-1]
  if top_k >= num_experts:
    return jnp.ones_like(noisy_logits)
  top_values, top_index = jax.lax.top_k(noisy_logits, top_k + 1)
  in_top_k = jax.nn.one_hot(top_index[:, :top_k], num_experts, dtype=jnp.int32).sum(1) > 0
  threshold = jnp.where(in_top_k, top_values[:, top_k, None], top_values[:, top_k - 1, None])
  return jax.scipy.stats.norm.cdf((clean_logits - threshold) / noise_std)


def noisy_top_k_from_logits(
    clean_logits: jax.Array,
    noise_std: jax.Array,
    noise: jax.Array | None,
    top_k: int,
    *,
    importance_weight: float = 1.0,
    load_weight: float = 1.0,
) -> NoisyRouterOutput:
  """Noisy top-k gating from precomputed logits.

  Args:
    clean_logits: [T, E] x W_g.
    noise_std: [T, E] positive noise scale softplus(x W_noise).
    noise: [T, E] standard-normal samples, or None (evaluation).
    top_k: experts per token.
    importance_weight: weight of CV(importance)^2 in `load_balance_loss`.
    load_weight: weight of CV(load)^2 in `load_balance_loss`.
  """
  check_logits(clean_logits, top_k)
  num_experts = clean_logits.shape[-1]
  clean_logits = clean_logits.astype(jnp.float32)
  noise_std = noise_std.astype(jnp.float32)
  noisy = clean_logits if noise is None else clean_logits + noise.astype(jnp.float32) * noise_std

  # KeepTopK then softmax: the softmax only runs over the kept k logits.
  kept_logits, expert_index = jax.lax.top_k(noisy, top_k)
  gates = jax.nn.softmax(kept_logits, axis=-1)
  choice_one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)
  probs = jnp.einsum("tk,tke->te", gates, choice_one_hot)

  importance = probs.sum(axis=0)
  load = smooth_load(clean_logits, noisy, noise_std, top_k).sum(axis=0)
  importance_loss = cv_squared(importance)
  load_loss = cv_squared(load)
  return NoisyRouterOutput(
      logits=noisy,
      probs=probs,
      expert_index=expert_index.astype(jnp.int32),
      gates=gates,
      load_balance_loss=importance_weight * importance_loss + load_weight * load_loss,
      z_loss=router_z_loss(clean_logits),
      clean_logits=clean_logits,
      noise_std=noise_std,
      importance=importance,
      load=load,
      importance_loss=importance_loss,
      load_loss=load_loss,
  )


class NoisyTopKRouter(TopKRouter):
  """Noisy top-k gating (Shazeer et al. 2017, Sec. 2.1 and Appendix A).

      H(x)_e = (x W_g)_e + N(0, 1) * softplus((x W_noise)_e)    (training only)
      G(x) = softmax(KeepTopK(H(x), k))

  W_noise is zero-initialised as in the paper; W_g keeps `TopKRouter`'s small normal init so
  step 0 is not a tie. Both losses are computed at evaluation too (H = clean logits).
  """

  def __init__(
      self,
      dim: int,
      num_experts: int,
      top_k: int,
      *,
      importance_weight: float = 1.0,
      load_weight: float = 1.0,
      rngs: nnx.Rngs,
  ):
    super().__init__(dim, num_experts, top_k, rngs=rngs)
    self.importance_weight = importance_weight
    self.load_weight = load_weight
    self.noise_gate = float32_gate(
        dim, num_experts, rngs=rngs, kernel_init=nnx.initializers.zeros_init()
    )

  def noise_std(self, x: jax.Array) -> jax.Array:
    """[T, D] tokens -> [T, E] float32 softplus(x W_noise)."""
    return jax.nn.softplus(self.noise_gate(x.astype(jnp.float32)))

  def __call__(
      self,
      x: jax.Array,
      *,
      train: bool = False,
      rngs: nnx.Rngs | None = None,
      context: Mapping[str, jax.Array] | None = None,
  ) -> NoisyRouterOutput:
    """Routes tokens x: [T, D]; with `train=True`, noise from `rngs.noise()`."""
    del context
    noise = None
    clean = self.logits(x)
    if train:
      if rngs is None:
        raise ValueError("NoisyTopKRouter needs `rngs` (a `noise` stream) when train=True")
      noise = jax.random.normal(rngs.noise(), clean.shape, jnp.float32)
    return noisy_top_k_from_logits(
        clean,
        self.noise_std(x),
        noise,
        self.top_k,
        importance_weight=self.importance_weight,
        load_weight=self.load_weight,
    )
