"""The router protocol of sparse mixture-of-experts layers and its shared pieces.

Routing is kept apart from dispatch (the V-MoE split): a router only decides
*where* each token wants to go and *with what weight*; it knows nothing about
expert capacity. The dispatch algorithms of `fairmoe_jax.moe.dispatch` then
serve those decisions under the capacity limit.

Router protocol (what `SparseMoE` calls for token-choice routing):

    route = router(x, train=..., rngs=..., context=...)   # x: [T, D] tokens

returning a `RouterOutput` (or a subclass). `context` maps names to per-token
arrays with leading dimension T (e.g. the sensitive attributes of each token's
example); routers that need none ignore it.

Everything else the layer needs of a router comes back through that output (as
V-MoE's routers return their dispatcher and metrics), so the layer calls no
method of the router itself; a subclass overrides what its router adds:

    route.extra_losses()                       # named scalar losses (unweighted)
    route.expert_features(x, experts)          # in training, x: [B, S, D] -> [B, E, ...] or None
    route.expert_losses(features, context)     # in training, context per example
    route.example_readings(batch, seq_len)     # per-example readings for evaluation

`expert_features` and `expert_losses` are for losses that need the experts' outputs
(FairSMoE's `expert_competence` reading), in two halves so that the experts run where the
dispatch runs them: on a device mesh `SparseMoE` calls `expert_features` inside its sharded
region, on each device's examples with the same copy (or, expert-parallel, the same shard) of
the `ExpertWeights` as the dispatch, so each device computes only its share and the weights'
gradients cross devices once. It must therefore treat every example and every expert apart:
entry [b, e] depends only on example b and expert e's weights (`experts.num_experts` may be a
shard's E_l). `expert_losses` then gets the gathered [B, E, ...] features and the per-example
context, and its named scalars join `extra_losses()`.
`example_readings` is a pytree of [B, ...] arrays (or None) that `SparseMoE`
passes on in `MoEAux.routing` for an evaluation to read (FGR's SA classifiers).

Any module that maps tokens to gating logits can reuse `route_from_logits`, so a
fairness-guided router (FairSMoE, Sec. 5.2) only has to produce logits;
`float32_gate` is the bias-free float32 gate the built-in routers share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

# Same scale as the timm/DeiT linear layers; a small init keeps the initial
# routing close to uniform.
_GATE_INIT = nnx.initializers.normal(stddev=0.02)


def float32_gate(
    dim: int,
    num_experts: int,
    *,
    rngs: nnx.Rngs,
    kernel_init: nnx.Initializer = _GATE_INIT,
) -> nnx.Linear:
  """A bias-free linear gate computed and stored in float32, whatever the model's dtype."""
  return nnx.Linear(
      dim,
      num_experts,
      use_bias=False,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      kernel_init=kernel_init,
      rngs=rngs,
  )


@struct.dataclass
class RouterOutput:
  """Routing decisions for a flat batch of T tokens.

  Attributes:
    logits: [T, E] float32 gating logits.
    probs: [T, E] float32 softmax over experts.
    expert_index: [T, k] int32, the chosen experts, best first.
    gates: [T, k] float32, `probs` of the chosen experts. Not renormalised to sum
      to one over the k choices: the paper's Eq. 5-6 weight expert outputs by
      Top-K(softmax(g(x))), and keeping the raw probabilities also lets the
      gradient reach the router through the weight of the chosen experts.
    load_balance_loss: scalar Switch-Transformer auxiliary loss (unweighted).
    z_loss: scalar ST-MoE router z-loss (unweighted).
  """

  logits: jax.Array
  probs: jax.Array
  expert_index: jax.Array
  gates: jax.Array
  load_balance_loss: jax.Array
  z_loss: jax.Array

  def extra_losses(self) -> dict[str, jax.Array]:
    """Named scalar losses a router adds beyond load balancing and z-loss (unweighted).

    Empty for the plain routers; the fairness-guided router returns its
    confusion, attribute-classifier and specialization losses here, so that
    `SparseMoE` can pass them on without knowing the router.
    """
    return {}

  def expert_features(self, x: jax.Array, experts: Any) -> jax.Array | None:
    """What `expert_losses` needs of the experts' outputs, per example and expert, in training.

    Args:
      x: [B, S, D] the layer's input (a device's examples, on a mesh).
      experts: stacked `ExpertWeights` (`experts.apply`) of E experts (a shard's, under
        expert parallelism).

    Returns [B, E, ...], entry [b, e] a function of example b and expert e alone; or None (the
    plain routers), and then the experts are not run for it.
    """
    del x, experts
    return None

  def expert_losses(
      self, features: jax.Array | None, context: Mapping[str, jax.Array] | None
  ) -> dict[str, jax.Array]:
    """Named scalar losses that need the experts' outputs (unweighted), in training.

    Args:
      features: `expert_features`' [B, E, ...] result for the whole batch (None where it
        returned None).
      context: the layer's per-example context ([B, ...] arrays), or None.

    Empty for the plain routers; FairSMoE's `expert_competence` reading returns its
    specialization loss here.
    """
    del features, context
    return {}

  def example_readings(self, batch: int, seq_len: int) -> Any:
    """Per-example readings of the routing for evaluation, from the flat [B * S] tokens: a pytree
    of [B, ...] arrays, or None (the plain routers). FGR returns its `FairRoutingReadings`."""
    del batch, seq_len
    return None


def load_balance_loss(probs: jax.Array, expert_index: jax.Array) -> jax.Array:
  """Switch-Transformer load-balancing loss, E * sum_e f_e * P_e.

  f_e counts *all* top-k assignments (divided by k so that sum_e f_e = 1), not
  only the top-1 choice as in the original top-1 Switch paper; this is the
  usual generalisation for top-k routers. Assignments are counted before any
  capacity dropping. P_e is the mean router probability of expert e. The loss
  equals 1 for perfectly uniform routing.

  Args:
    probs: [T, E] router probabilities.
    expert_index: [T, k] chosen experts.
  """
  num_experts = probs.shape[-1]
  # [T, k, E] -> [E]: fraction of (token, choice) pairs assigned to e. No
  # gradient flows through f_e (argmax); it flows through P_e.
  assignments = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)
  fraction_routed = assignments.mean(axis=(0, 1))
  mean_prob = probs.mean(axis=0)
  return num_experts * jnp.sum(fraction_routed * mean_prob)


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def check_top_k(top_k: int, num_experts: int) -> None:
  """Raises ValueError unless 1 <= top_k <= num_experts."""
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")


def check_logits(logits: jax.Array, top_k: int) -> None:
  """Raises ValueError unless logits are [T, E] and 1 <= top_k <= E."""
  if logits.ndim != 2:
    raise ValueError(f"logits must be [tokens, experts], got {logits.shape}")
  check_top_k(top_k, logits.shape[-1])


def route_from_logits(logits: jax.Array, top_k: int) -> RouterOutput:
  """Softmax over experts, then top-k; computes the auxiliary losses.

  Args:
    logits: [T, E] gating logits (cast to float32 here).
    top_k: number of experts per token.
  """
  check_logits(logits, top_k)
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  # lax.top_k breaks ties towards the lower expert index, deterministically.
  gates, expert_index = jax.lax.top_k(probs, top_k)
  return RouterOutput(
      logits=logits,
      probs=probs,
      expert_index=expert_index.astype(jnp.int32),
      gates=gates,
      load_balance_loss=load_balance_loss(probs, expert_index),
      z_loss=router_z_loss(logits),
  )
