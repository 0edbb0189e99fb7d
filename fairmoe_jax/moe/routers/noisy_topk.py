"""Noisy top-k gating (Shazeer et al. 2017, "Outrageously large neural networks").

`NoisyTopKRouter` returns a `NoisyRouterOutput`, a `RouterOutput` subclass, so
it can replace a `TopKRouter` in front of any capacity dispatch. Its auxiliary
loss is the paper's importance and smooth load losses (`cv_squared`,
`smooth_load`) instead of the Switch load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe.routers.base import (
    RouterOutput,
    check_logits,
    float32_gate,
    router_z_loss,
)
from fairmoe_jax.moe.routers.topk import TopKRouter


@struct.dataclass
class NoisyRouterOutput(RouterOutput):
  """`RouterOutput` of noisy top-k gating, with the paper's extra quantities.

  The inherited fields mean (T tokens, E experts, k choices):

  * `logits`: [T, E] float32 *noisy* logits H(x) = x W_g + N(0, 1) * std(x)
    (equal to `clean_logits` when not training). Routing used these.
  * `probs`: [T, E] the paper's gate vector G(x) = softmax(KeepTopK(H(x), k)):
    a softmax over the k kept logits, exactly 0 for the other experts. It sums
    to one per token, and its column sums are the paper's Importance.
  * `expert_index`: [T, k] int32, top-k experts of H(x), best first.
  * `gates`: [T, k] `probs` of the chosen experts: softmax over the kept k, so
    they *are* renormalised (unlike `TopKRouter`, as in the paper).
  * `load_balance_loss`: importance_weight * importance_loss + load_weight *
    load_loss (both weights 1 by default; the paper used w_importance = w_load
    = 0.1, which is an outer auxiliary-loss weight of 0.1 with the defaults).
  * `z_loss`: ST-MoE z-loss of the *clean* logits (not part of the paper;
    provided so that the output plugs into code expecting a `RouterOutput`).

  Extra attributes:
    clean_logits: [T, E] float32 x W_g.
    noise_std: [T, E] float32 softplus(x W_noise).
    importance: [E] sum over tokens of `probs`.
    load: [E] smooth load estimator, sum over tokens of P(x, e) (see
      `smooth_load`).
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
  """Squared coefficient of variation, Var(x) / (Mean(x)^2 + eps).

  Population variance (ddof=0), as in the tensor2tensor reference code of the
  paper. Zero for a single element.
  """
  x = x.astype(jnp.float32)
  if x.size <= 1:
    return jnp.zeros((), jnp.float32)
  return jnp.var(x) / (jnp.square(jnp.mean(x)) + eps)


def smooth_load(
    clean_logits: jax.Array, noisy_logits: jax.Array, noise_std: jax.Array, top_k: int
) -> jax.Array:
  """Per-token P(x, e) of the paper's smooth load estimator, [T, E].

  P(x, e) = Phi((clean_e - kth_excluding(H, k, e)) / std_e), the probability
  that expert e would be in the top-k if only its own noise were resampled.
  kth_excluding(H, k, e) is the k-th largest noisy logit among the *other*
  experts: the (k+1)-th largest of H when e is itself in the top-k of H, the
  k-th largest otherwise. With k = E every expert is always selected, so P = 1.
  The threshold is not stop-gradiented (as in the reference implementation), so
  the estimate is differentiable w.r.t. both W_g and W_noise.
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
  """Noisy top-k gating from precomputed logits (pure function).

  Args:
    clean_logits: [T, E] x W_g (cast to float32).
    noise_std: [T, E] positive noise scale softplus(x W_noise) (float32).
    noise: [T, E] standard-normal samples, or None for no noise (evaluation).
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

  `gate` (W_g, inherited from `TopKRouter`, so `logits(x)` is the clean logits)
  and `noise_gate` (W_noise) are bias-free float32 linears. W_noise is
  initialised to zero as in the paper (noise std softplus(0) = log 2 at init);
  W_g keeps `TopKRouter`'s small normal init so that routing is not a pure tie
  at step 0.

  The auxiliary loss in `load_balance_loss` is importance_weight *
  CV(Importance)^2 + load_weight * CV(Load)^2 (see `NoisyRouterOutput`). Both
  losses are also computed when `train=False` (then H = clean logits), as
  metrics; the smooth load estimator is always used.
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
    # Zero-initialised as in Shazeer et al. (2017): training starts noise-free.
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
    """Routes a flat batch of tokens x: [T, D].

    Args:
      x: [T, D] tokens.
      train: adds the gating noise when True; deterministic when False.
      rngs: required when `train=True`; the noise key is drawn from its
        `noise` stream (or its default stream when it has no `noise` stream).
      context: unused (router protocol).
    """
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
