"""The router protocol of sparse MoE layers and its shared pieces.

Routing is kept apart from dispatch (the V-MoE split): a router decides where each token goes
and with what weight, knowing nothing of capacity; `fairmoe_jax.moe.dispatch` serves that.

    route = router(x, train=..., rngs=..., context=...)   # x: [T, D]; context: per-token arrays

returns a `RouterOutput` (or subclass). Everything else the layer needs comes back through it,
so the layer calls no router method; a subclass overrides what its router adds:

    route.extra_losses()                       # named scalar losses (unweighted)
    route.expert_features(x, experts)          # in training, x: [B, S, D] -> [B, E, ...] or None
    route.expert_losses(features, context)     # in training, context per example
    route.example_readings(batch, seq_len)     # per-example readings for evaluation

`expert_features` and `expert_losses` serve losses that need the experts' outputs (FairSMoE's
`expert_competence`), split in two so that the experts run where the dispatch runs them: on a
mesh, `expert_features` runs inside the sharded region on each device's examples and expert
shard, so entry [b, e] must depend only on example b and expert e (`experts.num_experts` may be
a shard's E_l). `expert_losses` gets the gathered [B, E, ...] features.

`route_from_logits` turns any gating logits into a `RouterOutput`, so a fairness-guided router
(Sec. 5.2) only has to produce logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

# timm/DeiT's linear init; small, so the initial routing is close to uniform.
_GATE_INIT = nnx.initializers.normal(stddev=0.02)


def float32_gate(
    dim: int, num_experts: int, *, rngs: nnx.Rngs, kernel_init: nnx.Initializer = _GATE_INIT
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
    gates: [T, k] float32, `probs` of the chosen experts, not renormalised over the k: Eq. 5-6
      weigh expert outputs by Top-K(softmax(g(x))).
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
    """Named scalar losses beyond load balancing and z-loss (unweighted); FGR's go here."""
    return {}

  def expert_features(self, x: jax.Array, experts: Any) -> jax.Array | None:
    """What `expert_losses` needs of the experts' outputs, in training (module docstring).

    Args:
      x: [B, S, D] the layer's input (a device's examples, on a mesh).
      experts: `ExpertWeights` of E experts (a shard's, under expert parallelism).

    Returns [B, E, ...], entry [b, e] a function of example b and expert e alone; or None, and
    then the experts are not run for it.
    """
    del x, experts
    return None

  def expert_losses(
      self, features: jax.Array | None, context: Mapping[str, jax.Array] | None
  ) -> dict[str, jax.Array]:
    """Named scalar losses from `expert_features`' [B, E, ...] result and the
    per-example context (unweighted), in training.
    """
    del features, context
    return {}

  def example_readings(self, batch: int, seq_len: int) -> Any:
    """Per-example readings for evaluation from the flat [B * S] tokens (None here)."""
    del batch, seq_len
    return None


def load_balance_loss(probs: jax.Array, expert_index: jax.Array) -> jax.Array:
  """Switch-Transformer load-balancing loss, E * sum_e f_e * P_e (1 when uniform).

  f_e counts all top-k assignments before capacity dropping, divided by k (the usual top-k
  generalisation of top-1 Switch); P_e is the mean router probability of expert e.

  Args:
    probs: [T, E] router probabilities.
    expert_index: [T, k] chosen experts.
  """
  num_experts = probs.shape[-1]
  # No gradient flows through f_e (argmax); it flows through P_e.
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
  """Softmax over experts, then top-k, with the auxiliary losses; logits [T, E]."""
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
