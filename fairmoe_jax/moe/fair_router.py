"""FairSMoE's router: fairness-guided routing (FGR, paper Sec. 5.2, Alg. 1) and the
specialization loss of fairness-driven expert management (FEM, Sec. 5.3, Eq. 8).

    z = phi(x)                                   feature extractor
    e = f_g(z)                                   gating branch
    p_i = softmax(f_s_i(z))                      sensitive-attribute (SA) branch, one per attribute
    logits = e + sum_i c_i W_i                   c_i: the token's class of attribute i
    route = top-k(softmax(logits))

`c_i` is the one-hot true class (`route_by="label"`; a token whose class is
missing uses p_i instead) or the predicted p_i (`route_by="predicted"`, so no
sensitive labels are needed at inference). W_i ([G_i, E], zero-initialised, so
the router starts as the vanilla one) maps an attribute class to an expert-logit
vector.

Losses (unweighted, returned by `FairRouterOutput.extra_losses`):

* "confusion" (Eq. 7): cross-entropy of f_s_i(z) to the uniform distribution,
  averaged over attributes. Its gradient reaches phi only: the classifier
  weights are stop-gradiented in this term (the FairDisCo pattern).
* "attribute_ce": the classifiers' own cross-entropy on the true classes,
  computed from stop_gradient(z), so it trains f_s_i and never phi.
* "specialization" (Eq. 8, read as routing supervision): with A the experts
  assigned to the token's class of attribute i (a boolean [class, expert]
  `assignment`),
      focus_i = -log(sum_{e in A} P_e)
      avoid_i = -mean_{e not in A} log(1 - P_e)
      L = alpha * mean_i focus_i + (1 - alpha) * mean_i avoid_i,
  both minimised (the paper's minus sign before the avoid term would reward
  routing to non-assigned experts; see docs/design.md).

The assignment is a non-parameter variable of the router, so it lives in the
model state that the jitted train step receives as an array: changing it
between steps (dynamic expert allocation) never recompiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from fairmoe_jax.moe.routing import RouterOutput, float32_gate, route_from_logits

ROUTE_BY = ("label", "predicted")
_INIT = nnx.initializers.normal(stddev=0.02)


class ExpertAssignment(nnx.Variable):
  """Boolean-valued [num_classes_total, E] float32 array: which experts serve which class."""


@struct.dataclass
class FairRouterOutput(RouterOutput):
  """`RouterOutput` plus the FGR / FEM losses and the attribute predictions.

  Attributes:
    attribute_probs: per attribute, [T, G_i] softmax of the SA classifier.
    confusion: scalar Eq. 7 loss (zero without the SA branch).
    attribute_ce: scalar cross-entropy of the SA classifiers (zero without it).
    specialization: scalar Eq. 8 loss (zero without FEM).
  """

  attribute_probs: tuple[jax.Array, ...]
  confusion: jax.Array
  attribute_ce: jax.Array
  specialization: jax.Array

  def extra_losses(self) -> dict[str, jax.Array]:
    return {
        "confusion": self.confusion,
        "attribute_ce": self.attribute_ce,
        "specialization": self.specialization,
    }


def class_offsets(group_sizes: Sequence[int]) -> np.ndarray:
  """Row of the first class of each attribute in the stacked [sum G_i, E] assignment."""
  return np.concatenate([[0], np.cumsum(group_sizes)[:-1]]).astype(np.int32)


def specialization_loss(
    probs: jax.Array,
    attributes: jax.Array,
    assignment: jax.Array,
    group_sizes: Sequence[int],
    alpha: float,
) -> jax.Array:
  """Eq. 8 as routing supervision, averaged over tokens and attributes with a known class.

  Args:
    probs: [T, E] router probabilities.
    attributes: [T, m] int class per attribute, -1 = missing (no supervision).
    assignment: [sum G_i, E] float 0/1.
    group_sizes: G_i per attribute.
    alpha: weight of the focus term; 1 - alpha weighs the avoid term.
  """
  eps = 1e-6
  offsets = jnp.asarray(class_offsets(group_sizes))
  known = attributes >= 0  # [T, m]
  rows = jnp.where(known, attributes, 0) + offsets  # [T, m]
  assigned = assignment[rows]  # [T, m, E]
  p = probs[:, None, :]
  focus = -jnp.log(jnp.sum(assigned * p, axis=-1) + eps)
  num_other = jnp.maximum(jnp.sum(1.0 - assigned, axis=-1), 1.0)
  avoid = -jnp.sum((1.0 - assigned) * jnp.log1p(-p + eps), axis=-1) / num_other
  per_token = alpha * focus + (1.0 - alpha) * avoid  # [T, m]
  weight = known.astype(jnp.float32)
  return jnp.sum(per_token * weight) / jnp.maximum(jnp.sum(weight), 1.0)


class FairRouter(nnx.Module):
  """FairSMoE router: FGR (`guided=True`) and/or FEM (`specialize=True`).

  With `guided=False` it is the plain linear top-k router plus, if
  `specialize`, the specialization loss (the "no FGR" ablation); with
  `specialize=False` it is FGR without expert management (the "no FEM"
  ablation). Follows the router protocol of `fairmoe_jax.moe.routing`; needs
  `context["attributes"]` [T, m] (int, -1 missing) from `SparseMoE`.

  Args:
    dim: token width D.
    num_experts: E.
    top_k: experts per token.
    group_sizes: classes per sensitive attribute, G_1..G_m.
    assignment: initial [sum G_i, E] 0/1 array (see `fairmoe_jax.fairness.experts`).
    guided: use the SA branch (FGR).
    specialize: compute the specialization loss (FEM).
    route_by: "label" or "predicted" (see module docstring).
    feature_dim: width of z = phi(x); default D.
    alpha: Eq. 8 focus weight.
    rngs: parameter RNGs.
  """

  def __init__(
      self,
      dim: int,
      num_experts: int,
      top_k: int,
      group_sizes: Sequence[int],
      assignment: np.ndarray,
      *,
      guided: bool = True,
      specialize: bool = True,
      route_by: str = "label",
      feature_dim: int | None = None,
      alpha: float = 0.6,
      rngs: nnx.Rngs,
  ):
    if route_by not in ROUTE_BY:
      raise ValueError(f"route_by={route_by!r}; known: {', '.join(ROUTE_BY)}")
    assignment = np.asarray(assignment, np.float32)
    if assignment.shape != (sum(group_sizes), num_experts):
      raise ValueError(
          f"assignment shape {assignment.shape} != (sum of group sizes {sum(group_sizes)}, "
          f"num_experts {num_experts})"
      )
    self.num_experts = num_experts
    self.top_k = top_k
    self.group_sizes = tuple(int(g) for g in group_sizes)
    self.guided = guided
    self.specialize = specialize
    self.route_by = route_by
    self.alpha = alpha
    self.assignment = ExpertAssignment(jnp.asarray(assignment))
    feature_dim = feature_dim or dim
    if guided:

      def linear(din: int, dout: int) -> nnx.Linear:
        return nnx.Linear(
            din, dout, dtype=jnp.float32, param_dtype=jnp.float32, kernel_init=_INIT, rngs=rngs
        )

      self.feature = linear(dim, feature_dim)  # phi
      self.gate = float32_gate(feature_dim, num_experts, rngs=rngs)  # f_g
      self.attribute_heads = nnx.List([linear(feature_dim, g) for g in self.group_sizes])
      # W_i: zero so that training starts from the vanilla router's decisions.
      self.projections = nnx.List(
          [nnx.Param(jnp.zeros((g, num_experts), jnp.float32)) for g in self.group_sizes]
      )
    else:
      self.gate = float32_gate(dim, num_experts, rngs=rngs)

  def __call__(
      self,
      x: jax.Array,
      *,
      train: bool = False,
      rngs: nnx.Rngs | None = None,
      context: Mapping[str, jax.Array] | None = None,
  ) -> FairRouterOutput:
    """Routes tokens x: [T, D]; `context["attributes"]`: [T, m] int, -1 = missing."""
    del train, rngs
    if context is None or "attributes" not in context:
      raise ValueError("FairRouter needs context['attributes'] (the batch's sensitive attributes)")
    attributes = context["attributes"].astype(jnp.int32)
    if attributes.shape[-1] != len(self.group_sizes):
      raise ValueError(
          f"context['attributes'] has {attributes.shape[-1]} columns, the router was built "
          f"for {len(self.group_sizes)} attributes"
      )
    x = x.astype(jnp.float32)
    zero = jnp.zeros((), jnp.float32)
    confusion, attribute_ce, attribute_probs = zero, zero, ()
    if self.guided:
      z = jax.nn.gelu(self.feature(x))
      logits = self.gate(z)
      z_frozen = jax.lax.stop_gradient(z)
      confusions, ces, probs_list = [], [], []
      for i, (head, projection) in enumerate(zip(self.attribute_heads, self.projections)):
        # Confusion: gradient to phi only (head weights frozen in this term).
        frozen_kernel = jax.lax.stop_gradient(head.kernel[...])
        frozen_bias = jax.lax.stop_gradient(head.bias[...])
        log_p_confused = jax.nn.log_softmax(z @ frozen_kernel + frozen_bias)
        confusions.append(-jnp.mean(log_p_confused))  # CE to uniform, mean over classes/tokens.
        # The classifier itself learns from z with no gradient into phi.
        log_p = jax.nn.log_softmax(head(z_frozen))
        label = attributes[:, i]
        known = label >= 0
        nll = -jnp.take_along_axis(log_p, jnp.maximum(label, 0)[:, None], axis=-1)[:, 0]
        ces.append(jnp.sum(nll * known) / jnp.maximum(jnp.sum(known), 1))
        # Routing does not train the classifier: it learns only from its own cross-entropy.
        predicted = jax.lax.stop_gradient(jnp.exp(log_p))
        probs_list.append(predicted)
        if self.route_by == "label":
          selector = jnp.where(
              known[:, None], jax.nn.one_hot(label, self.group_sizes[i]), predicted
          )
        else:
          selector = predicted
        logits = logits + selector @ projection[...]
      confusion = jnp.mean(jnp.stack(confusions))
      attribute_ce = jnp.mean(jnp.stack(ces))
      attribute_probs = tuple(probs_list)
    else:
      logits = self.gate(x)
    route = route_from_logits(logits, self.top_k)
    specialization = zero
    if self.specialize:
      specialization = specialization_loss(
          route.probs, attributes, self.assignment[...], self.group_sizes, self.alpha
      )
    return FairRouterOutput(
        logits=route.logits,
        probs=route.probs,
        expert_index=route.expert_index,
        gates=route.gates,
        load_balance_loss=route.load_balance_loss,
        z_loss=route.z_loss,
        attribute_probs=attribute_probs,
        confusion=confusion,
        attribute_ce=attribute_ce,
        specialization=specialization,
    )
