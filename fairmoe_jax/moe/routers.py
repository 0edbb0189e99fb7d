"""Alternative routers: noisy top-k, batch-priority routing and expert choice.

All of them keep the routing / dispatch split of `fairmoe_jax.moe.routing`:

* `NoisyTopKRouter` (Shazeer et al. 2017, "Outrageously large neural networks")
  returns a `NoisyRouterOutput`, a `RouterOutput` subclass, so it can replace a
  `TopKRouter` in front of any capacity dispatch.
* `batch_priority_order` / `reorder_tokens` / `restore_token_order` (V-MoE
  batch-priority routing, Riquelme et al. 2021) wrap any dispatch that serves
  earlier tokens first, such as `dispatch.dispatch_and_combine_masks`.
* `ExpertChoiceRouter` / `apply_expert_choice` (Zhou et al. 2022, "Mixture of
  experts with expert choice routing") invert the selection: every expert picks
  its C best tokens of a group, so there is no capacity overflow to dispatch.

Router logits are computed in float32 in all cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe.dispatch import compute_capacity
from fairmoe_jax.moe.routing import RouterOutput, TopKRouter, float32_gate, router_z_loss

# ---------------------------------------------------------------------------
# Noisy top-k gating (Shazeer et al. 2017)
# ---------------------------------------------------------------------------


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
  if clean_logits.ndim != 2:
    raise ValueError(f"logits must be [tokens, experts], got {clean_logits.shape}")
  num_experts = clean_logits.shape[-1]
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
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


# ---------------------------------------------------------------------------
# Batch-priority routing (V-MoE, Riquelme et al. 2021, Sec. 4)
# ---------------------------------------------------------------------------


def priority_scores(gates: jax.Array, score: str = "max") -> jax.Array:
  """Per-token priority from its gates [..., k] -> [...].

  "max": the largest routing weight (V-MoE's default); "sum": the sum of the k
  routing weights. Gates are stop-gradiented: the order carries no gradient.
  """
  gates = jax.lax.stop_gradient(gates.astype(jnp.float32))
  if score == "max":
    return gates.max(axis=-1)
  if score == "sum":
    return gates.sum(axis=-1)
  raise ValueError(f"score must be 'max' or 'sum', got {score!r}")


def batch_priority_order(
    router_output: RouterOutput | jax.Array,
    *,
    num_groups: int | None = None,
    score: str = "max",
) -> jax.Array:
  """Permutation serving the highest-priority tokens of each group first.

  Batch-priority routing (BPR) lets the capacity-limited dispatch serve tokens
  in decreasing order of priority instead of their position in the sequence,
  so when capacity is short it is the least confident routings that get
  dropped. It composes with any dispatch that serves earlier tokens first:

      order = batch_priority_order(route, num_groups=G)
      idx_s, gates_s = reorder_tokens((expert_index, gates), order)  # [G, S, k]
      dispatch_s, combine_s, stats = dispatch_and_combine_masks(idx_s, gates_s, ...)
      dispatch, combine = restore_token_order((dispatch_s, combine_s), order)

  after which `dispatch` / `combine` index tokens in their original order and
  are used with the original x as usual. (Equivalently, reorder x, run the whole
  layer, and restore the order of y.) With `dispatch_and_combine_masks`, which
  serves all top-1 choices of a group before any top-2 choice, this is exactly
  V-MoE's BPR: choice j of all tokens by priority, then choice j + 1.

  Args:
    router_output: a `RouterOutput` (its `gates` are used) or a gates array, of
      shape [G, S, k], or [T, k] with `num_groups` given (T = G * S).
    num_groups: G, needed to split flat [T, k] gates into groups.
    score: "max" or "sum", see `priority_scores`.

  Returns:
    order: [G, S] int32; order[g, i] is the index of the token served i-th in
    group g. Sorting is stable, so equal priorities keep sequence order.
  """
  gates = router_output.gates if isinstance(router_output, RouterOutput) else router_output
  if gates.ndim == 2:
    if num_groups is None:
      raise ValueError("flat [T, k] gates need num_groups")
    gates = gates.reshape(num_groups, -1, gates.shape[-1])
  if gates.ndim != 3:
    raise ValueError(f"gates must be [G, S, k] or [T, k], got {gates.shape}")
  priority = priority_scores(gates, score)
  return jnp.argsort(-priority, axis=1, stable=True).astype(jnp.int32)


def _take_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [G, S, ...] reindexed along S by index [G, S]."""
  return jax.vmap(lambda xg, ig: xg[ig])(x, index)


def reorder_tokens(tree: Any, order: jax.Array) -> Any:
  """Sorts every [G, S, ...] array of a pytree by `order` along the token axis.

  out[g, i] = x[g, order[g, i]], i.e. tokens in serving (priority) order.
  """
  return jax.tree.map(lambda x: _take_tokens(x, order), tree)


def restore_token_order(tree: Any, order: jax.Array) -> Any:
  """Inverse of `reorder_tokens`: out[g, order[g, i]] = x[g, i]."""
  inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
  return jax.tree.map(lambda x: _take_tokens(x, inverse), tree)


# ---------------------------------------------------------------------------
# Expert choice routing (Zhou et al. 2022)
# ---------------------------------------------------------------------------


@struct.dataclass
class ExpertChoiceAssignment:
  """Expert-major routing decisions of expert choice routing.

  Attributes:
    token_index: [G, E, C] int32, the tokens (positions in the group) picked by
      each expert, highest affinity first.
    gates: [G, E, C] float32, the affinity softmax(x W_g)[token, expert] of those
      tokens (softmax over experts, not renormalised).
    logits: [G, S, E] float32 router logits.
    probs: [G, S, E] float32 softmax over experts (the affinities).
    experts_per_token: [G, S] int32, how many experts picked each token (0 for
      tokens that get no expert and pass only through the residual).
    fraction_unrouted: scalar, fraction of tokens that no expert picked.
    z_loss: scalar ST-MoE router z-loss of the logits (unweighted; optional).
  """

  token_index: jax.Array
  gates: jax.Array
  logits: jax.Array
  probs: jax.Array
  experts_per_token: jax.Array
  fraction_unrouted: jax.Array
  z_loss: jax.Array


def expert_choice_from_logits(logits: jax.Array, capacity: int) -> ExpertChoiceAssignment:
  """Each expert picks its `capacity` highest-affinity tokens per group.

  Args:
    logits: [G, S, E] router logits (cast to float32).
    capacity: C, tokens per expert and group, 1 <= C <= S.
  """
  if logits.ndim != 3:
    raise ValueError(f"logits must be [groups, tokens, experts], got {logits.shape}")
  _, group_size, num_experts = logits.shape
  if not 1 <= capacity <= group_size:
    raise ValueError(f"capacity={capacity} must be in [1, group_size={group_size}]")
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  # [G, E, S] -> top-C tokens per expert; ties go to the earlier token.
  gates, token_index = jax.lax.top_k(jnp.swapaxes(probs, 1, 2), capacity)
  token_index = token_index.astype(jnp.int32)
  picked = jax.nn.one_hot(token_index, group_size, dtype=jnp.int32)  # [G, E, C, S]
  experts_per_token = picked.sum(axis=(1, 2))
  return ExpertChoiceAssignment(
      token_index=token_index,
      gates=gates,
      logits=logits,
      probs=probs,
      experts_per_token=experts_per_token,
      fraction_unrouted=jnp.mean(experts_per_token == 0, dtype=jnp.float32),
      z_loss=router_z_loss(logits.reshape(-1, num_experts)),
  )


class ExpertChoiceRouter(nnx.Module):
  """Expert choice routing (Zhou et al. 2022): experts pick tokens.

  Affinities S = softmax(x W_g) over experts (float32, bias-free gate with the
  same init as `TopKRouter`); in every group each expert takes its top-C
  tokens, C = compute_capacity(S, E, top_k=1, capacity_factor) =
  ceil(capacity_factor * S / E), so capacity_factor is the average number of
  experts per token. Every expert gets exactly C tokens (perfect balance, no
  auxiliary loss needed), but a token may be picked by several experts or by
  none; unpicked tokens get a zero MoE output (residual only).

  Caveat: the selection compares all tokens of a group, so a token's routing
  depends on the other tokens of its group, including later ones. It is
  therefore not causal (unsuitable for autoregressive decoding as is), and the
  output of an example depends on the group composition (here one group per
  example, so not on the rest of the batch).
  """

  def __init__(self, dim: int, num_experts: int, *, capacity_factor: float, rngs: nnx.Rngs):
    if capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    self.num_experts = num_experts
    self.capacity_factor = capacity_factor
    self.gate = float32_gate(dim, num_experts, rngs=rngs)

  def capacity(self, group_size: int) -> int:
    """C for groups of `group_size` tokens."""
    return compute_capacity(group_size, self.num_experts, 1, self.capacity_factor)

  def logits(self, x: jax.Array) -> jax.Array:
    """[..., D] tokens -> [..., E] float32 logits."""
    return self.gate(x.astype(jnp.float32))

  def __call__(self, x: jax.Array) -> ExpertChoiceAssignment:
    """x: [G, S, D] groups of tokens -> `ExpertChoiceAssignment`."""
    if x.ndim != 3:
      raise ValueError(f"x must be [groups, tokens, dim], got {x.shape}")
    return expert_choice_from_logits(self.logits(x), self.capacity(x.shape[1]))


def apply_expert_choice(
    x: jax.Array,
    assignment: ExpertChoiceAssignment,
    expert_fn: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """Gather -> experts -> gate-weighted scatter-add.

      y[g, s] = sum over (e, c) with token_index[g, e, c] = s of
                gates[g, e, c] * expert_fn(x[g, token_index])[g, e, c]

  Args:
    x: [G, S, D] tokens.
    assignment: from `ExpertChoiceRouter`.
    expert_fn: [G, E, C, D] -> [G, E, C, D'], e.g. `ExpertWeights.apply`.

  Returns:
    y: [G, S, D'] in expert_fn's output dtype; zero for tokens no expert picked.
  """
  index = assignment.token_index
  expert_inputs = jax.vmap(lambda xg, ig: xg[ig])(x, index)  # [G, E, C, D]
  outputs = expert_fn(expert_inputs)
  weighted = outputs * assignment.gates.astype(outputs.dtype)[..., None]
  group_size = x.shape[1]

  def scatter(out_g: jax.Array, index_g: jax.Array) -> jax.Array:
    flat = out_g.reshape(-1, out_g.shape[-1])
    return jnp.zeros((group_size, flat.shape[-1]), flat.dtype).at[index_g.reshape(-1)].add(flat)

  return jax.vmap(scatter)(weighted, index)
