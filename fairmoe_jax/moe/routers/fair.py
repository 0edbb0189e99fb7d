"""FairSMoE's router: fairness-guided routing (FGR, paper Sec. 5.2, Alg. 1) and the
specialization loss of fairness-driven expert management (FEM, Sec. 5.3, Eq. 8).

    z = phi(x)                              feature extractor
    e = f_g(z)                              gating branch
    p_a = softmax(f_s_a(z))                 sensitive-attribute (SA) branch, one per attribute
    e_a = c_a W_a                           the "linear projection layer" of attribute a
    route = top-k(softmax(e + sum_a e_a))

`c_a` is the predicted p_a (`route_by="predicted"`, the default: Algorithm 1 takes no attribute
labels, so inference needs none) or the one-hot true class (`route_by="label"`, a training-time
study; a token whose class is missing falls back to p_a). W_a is [G_a, E], zero-initialised, so
the router starts as the vanilla one.

Expert assignment: S_e is a set of *attributes* (Sec. 5.3), stored as an [m, E] 0/1
`ExpertAssignment` (row a: the experts whose S_e holds a; see `fairmoe_jax.fairness.experts`).
It lives in the model state, so FEM can change it between steps without recompiling.

Readings of Eq. 8 (`specialization`, docs/design.md), each a loss summed over the (expert,
attribute) pairs as Eq. 8 sums, averaged over tokens or examples:

* "attribute_routing": attribute a's routing contribution r_a = softmax(e_a) is pushed toward
  every expert holding a (focus, -log r_a[e]) and away from the others (avoid, -log(1 - r_a[e])),
  whatever the token's group. Without the SA branch (the no-FGR ablation) the router's own
  softmax is supervised for every attribute.
* "expert_competence": expert e's own output, pooled over an example's tokens and read by a
  competence head, is trained on attribute a's fairness task (cross-entropy of the target,
  balanced over a's groups) for a in S_e; for a outside S_e the same loss, capped at ln K
  (chance), is subtracted, so the loss is bounded below. Needs the target label in training.
* "class_routing": the router's softmax is sent to the experts of the token's class of each
  attribute (a class-level split of the attribute's experts), so its optimum routes by the
  sensitive label. Kept for comparison.

Both routing readings minimise the avoid term: Eq. 8 prints it with a minus sign, which with a
cross-entropy would reward routing to the non-assigned experts without bound.

Losses are unweighted (`FairRouterOutput.extra_losses`); the method weighs them:
"confusion" (Eq. 7, gradient to phi only), "attribute_ce" (the SA classifiers' own
cross-entropy, gradient to the classifiers only) and "specialization".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.fairness.experts import (
    ExpertAssignment,
    attribute_assignment,
    class_assignment,
    class_offsets,
)
from fairmoe_jax.moe.routers.base import RouterOutput, float32_gate, route_from_logits

ROUTE_BY = ("predicted", "label")
SPECIALIZATIONS = ("attribute_routing", "expert_competence", "class_routing")
_INIT = nnx.initializers.normal(stddev=0.02)
_EPS = 1e-6


@struct.dataclass
class FairRoutingReadings:
  """What an evaluation reads of FGR's routing, per example (the mean over its tokens).

  Attributes:
    attribute_probs: per attribute, [B, G_a] the SA classifier's probabilities (() without FGR).
    sa_logit_moments: [B, 4, E] token means of (sa, sa^2, gate, gate^2) per expert, with routing
      logits gate + sa (None without FGR).
    sa_choice_change: [B] fraction of tokens whose top-k set changes when sa is replaced by its
      batch mean: 0 means the SA branch is a learned constant bias (None without FGR).
  """

  attribute_probs: tuple[jax.Array, ...] = ()
  sa_logit_moments: jax.Array | None = None
  sa_choice_change: jax.Array | None = None


@struct.dataclass
class CompetenceHead:
  """The router's competence head [D, K], assignment and settings for `competence_loss`."""

  kernel: jax.Array
  bias: jax.Array
  assignment: jax.Array
  group_sizes: tuple[int, ...] = struct.field(pytree_node=False)
  alpha: float = struct.field(pytree_node=False)

  def __call__(self, pooled: jax.Array) -> jax.Array:
    """The head on [..., D] features, computed as `nnx.Linear` does (same program)."""
    logits = jax.lax.dot_general(pooled, self.kernel, (((pooled.ndim - 1,), (0,)), ((), ())))
    return logits + jnp.reshape(self.bias, (1,) * (logits.ndim - 1) + (-1,))


@struct.dataclass
class FairRouterOutput(RouterOutput):
  """`RouterOutput` plus the FGR / FEM losses and the attribute predictions.

  Attributes:
    attribute_probs: per attribute, [T, G_a] softmax of the SA classifier (() without FGR).
    attribute_logits: [T, E] the SA branch's share of `logits`, sum_a e_a (None without FGR).
    losses: the unweighted "confusion", "attribute_ce", "specialization" (training only).
    competence: the head `expert_losses` reads the experts with ("expert_competence" only).
  """

  attribute_probs: tuple[jax.Array, ...]
  losses: dict[str, jax.Array]
  attribute_logits: jax.Array | None = None
  competence: CompetenceHead | None = None

  def extra_losses(self) -> dict[str, jax.Array]:
    return dict(self.losses)

  def expert_features(self, x: jax.Array, experts) -> jax.Array | None:
    """Each expert's output pooled over each example's tokens, [B, E, D] float32.

    None unless "expert_competence"; runs every expert on every token (E times the FLOPs).
    """
    if self.competence is None:
      return None
    batch, seq_len, dim = x.shape
    tokens = jnp.broadcast_to(x[:, None], (batch, experts.num_experts, seq_len, dim))
    return experts.apply(tokens).mean(axis=2).astype(jnp.float32)

  def expert_losses(
      self, features: jax.Array | None, context: Mapping[str, jax.Array] | None
  ) -> dict[str, jax.Array]:
    """`expert_competence`'s loss from pooled outputs [B, E, D], context "label", "attributes"."""
    if self.competence is None:
      return {}
    if context is None or "label" not in context or "attributes" not in context:
      raise ValueError(
          "specialization='expert_competence' needs context['label'] and context['attributes']"
      )
    head = self.competence
    loss = competence_loss(
        head(features),  # [B, E, K]
        context["label"].astype(jnp.int32),
        context["attributes"].astype(jnp.int32),
        head.assignment,
        head.group_sizes,
        head.alpha,
    )
    return {"specialization": loss}

  def example_readings(self, batch: int, seq_len: int) -> FairRoutingReadings:
    """`FairRoutingReadings` from the flat [B * S] tokens."""
    probs = tuple(p.reshape(batch, seq_len, -1).mean(axis=1) for p in self.attribute_probs)
    if self.attribute_logits is None:
      return FairRoutingReadings(attribute_probs=probs)
    sa = self.attribute_logits.astype(jnp.float32)
    gate = self.logits - sa
    moments = jnp.stack([sa, sa**2, gate, gate**2], axis=1)  # [T, 4, E]
    constant = gate + jnp.mean(sa, axis=0, keepdims=True)
    top_k = self.expert_index.shape[-1]
    _, without = jax.lax.top_k(constant, top_k)
    chosen = jax.nn.one_hot(self.expert_index, sa.shape[-1]).sum(1)  # [T, E] 0/1
    kept = jax.nn.one_hot(without, sa.shape[-1]).sum(1)
    changed = jnp.any(chosen != kept, axis=-1).astype(jnp.float32)  # [T]
    return FairRoutingReadings(
        attribute_probs=probs,
        sa_logit_moments=moments.reshape(batch, seq_len, 4, -1).mean(axis=1),
        sa_choice_change=changed.reshape(batch, seq_len).mean(axis=1),
    )


def routing_supervision(
    probs: jax.Array, assigned: jax.Array, alpha: float, weight: jax.Array | None = None
) -> jax.Array:
  """Eq. 8 as routing supervision, >= 0: the weighted-token mean of
  sum_a [alpha sum_{e in S^-1(a)} -log p_ae + (1 - alpha) sum_{e not in} -log(1 - p_ae)].

  Args:
    probs: [T, A, E] routing distribution judged for each of A attribute rows.
    assigned: [T, A, E] or [A, E] 0/1, the experts holding that attribute (or class).
    alpha: focus weight; 1 - alpha weighs avoid.
    weight: [T, A] token weights (0 = no supervision); default all ones.
  """
  assigned = jnp.broadcast_to(assigned, probs.shape)
  focus = -jnp.sum(assigned * jnp.log(probs + _EPS), axis=-1)
  avoid = -jnp.sum((1.0 - assigned) * jnp.log1p(-probs + _EPS), axis=-1)
  per_row = alpha * focus + (1.0 - alpha) * avoid  # [T, A]
  if weight is None:
    weight = jnp.ones(per_row.shape, jnp.float32)
  tokens = jnp.maximum(jnp.sum(jnp.max(weight, axis=-1)), 1.0)
  return jnp.sum(per_row * weight) / tokens


def group_balanced_cross_entropy(nll: jax.Array, groups: jax.Array, num_groups: int) -> jax.Array:
  """Mean over present groups of each group's mean of nll [B, E] -> [E]; group -1 is left out."""
  one_hot = jax.nn.one_hot(groups, num_groups, dtype=jnp.float32)  # -1 -> zeros
  counts = one_hot.sum(0)  # [G]
  per_group = (one_hot.T @ nll) / jnp.maximum(counts, 1.0)[:, None]  # [G, E]
  present = (counts > 0).astype(jnp.float32)
  return (present @ per_group) / jnp.maximum(present.sum(), 1.0)


def competence_loss(
    logits: jax.Array,
    labels: jax.Array,
    attributes: jax.Array,
    assignment: jax.Array,
    group_sizes: Sequence[int],
    alpha: float,
) -> jax.Array:
  """The `expert_competence` reading of Eq. 8, summed over experts.

  Args:
    logits: [B, E, K] each expert's prediction of the target.
    labels: [B] int target.
    attributes: [B, m] int groups, -1 = missing.
    assignment: [m, E] 0/1.
    group_sizes: G_a.
    alpha: focus weight.
  """
  num_classes = logits.shape[-1]
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_p, labels[:, None, None], axis=-1)[..., 0]  # [B, E]
  balanced = jnp.stack(
      [group_balanced_cross_entropy(nll, attributes[:, a], g) for a, g in enumerate(group_sizes)]
  )  # [m, E]
  capped = jnp.minimum(balanced, jnp.log(float(num_classes)))
  return jnp.sum(alpha * assignment * balanced - (1.0 - alpha) * (1.0 - assignment) * capped)


class FairRouter(nnx.Module):
  """FairSMoE router: FGR (`guided=True`) and/or FEM's specialization loss.

  `guided=False` is the "no FGR" ablation, `specialization=None` the "no FEM" one. Context per
  token: "attributes" [T, m] (int, -1 missing; read in training and with `route_by="label"`),
  "label" [T] (read in training by "expert_competence").

  Args:
    dim: token width D.
    num_experts: E.
    group_sizes: classes per sensitive attribute, G_1..G_m.
    num_classes: target classes K (the "expert_competence" head).
    guided: use the SA branch (FGR).
    specialization: one of `SPECIALIZATIONS`, or None.
    route_by: "predicted" or "label" (module docstring).
    feature_dim: width of z = phi(x); default D.
    alpha: Eq. 8 focus weight.
  """

  def __init__(
      self,
      dim: int,
      num_experts: int,
      top_k: int,
      group_sizes: Sequence[int],
      *,
      num_classes: int = 2,
      guided: bool = True,
      specialization: str | None = "expert_competence",
      route_by: str = "predicted",
      feature_dim: int | None = None,
      alpha: float = 0.6,
      rngs: nnx.Rngs,
  ):
    if route_by not in ROUTE_BY:
      raise ValueError(f"route_by={route_by!r}; known: {', '.join(ROUTE_BY)}")
    if specialization is not None and specialization not in SPECIALIZATIONS:
      raise ValueError(
          f"specialization={specialization!r}; known: {', '.join(SPECIALIZATIONS)} or None"
      )
    self.num_experts = num_experts
    self.top_k = top_k
    self.group_sizes = tuple(int(g) for g in group_sizes)
    self.guided = guided
    self.specialization = specialization
    self.route_by = route_by
    self.alpha = alpha
    self.assignment = ExpertAssignment(
        jnp.asarray(attribute_assignment(len(self.group_sizes), num_experts))
    )

    def linear(din: int, dout: int) -> nnx.Linear:
      return nnx.Linear(
          din, dout, dtype=jnp.float32, param_dtype=jnp.float32, kernel_init=_INIT, rngs=rngs
      )

    feature_dim = feature_dim or dim
    if guided:
      self.feature = linear(dim, feature_dim)  # phi
      self.gate = float32_gate(feature_dim, num_experts, rngs=rngs)  # f_g
      self.attribute_heads = nnx.List([linear(feature_dim, g) for g in self.group_sizes])
      self.projections = nnx.List(
          [nnx.Param(jnp.zeros((g, num_experts), jnp.float32)) for g in self.group_sizes]
      )
    else:
      self.gate = float32_gate(dim, num_experts, rngs=rngs)
    if specialization == "expert_competence":
      self.competence_head = linear(dim, num_classes)

  def __call__(
      self,
      x: jax.Array,
      *,
      train: bool = False,
      rngs: nnx.Rngs | None = None,
      context: Mapping[str, jax.Array] | None = None,
  ) -> FairRouterOutput:
    """Routes tokens x: [T, D]."""
    del rngs
    context = context or {}
    needs_labels = train or self.route_by == "label"
    attributes = context.get("attributes") if needs_labels else None
    if needs_labels and attributes is None:
      raise ValueError(
          "FairRouter needs context['attributes'] (the batch's sensitive attributes) in "
          f"training{' and, with route_by=label, at evaluation' if self.route_by == 'label' else ''}"
      )
    if attributes is not None:
      attributes = attributes.astype(jnp.int32)
      if attributes.shape[-1] != len(self.group_sizes):
        raise ValueError(
            f"context['attributes'] has {attributes.shape[-1]} columns, the router was built "
            f"for {len(self.group_sizes)} attributes"
        )
    x = x.astype(jnp.float32)
    losses: dict[str, jax.Array] = {}
    attribute_probs: tuple[jax.Array, ...] = ()
    contributions = []  # r_a's logits e_a, for the attribute_routing reading.
    if self.guided:
      z = jax.nn.gelu(self.feature(x))
      logits = self.gate(z)
      z_frozen = jax.lax.stop_gradient(z)
      confusions, ces, probs_list = [], [], []
      for i, (head, projection) in enumerate(zip(self.attribute_heads, self.projections)):
        # Confusion (Eq. 7): cross-entropy to uniform, gradient to phi only.
        frozen_kernel = jax.lax.stop_gradient(head.kernel[...])
        frozen_bias = jax.lax.stop_gradient(head.bias[...])
        confusions.append(-jnp.mean(jax.nn.log_softmax(z @ frozen_kernel + frozen_bias)))
        # The classifier learns from z with no gradient into phi, and routing does not train it.
        log_p = jax.nn.log_softmax(head(z_frozen))
        predicted = jax.lax.stop_gradient(jnp.exp(log_p))
        probs_list.append(predicted)
        selector = predicted
        if attributes is not None:
          label = attributes[:, i]
          known = label >= 0
          nll = -jnp.take_along_axis(log_p, jnp.maximum(label, 0)[:, None], axis=-1)[:, 0]
          ces.append(jnp.sum(nll * known) / jnp.maximum(jnp.sum(known), 1))
          if self.route_by == "label":
            selector = jnp.where(
                known[:, None], jax.nn.one_hot(label, self.group_sizes[i]), predicted
            )
        contribution = selector @ projection[...]
        contributions.append(contribution)
        logits = logits + contribution
      attribute_probs = tuple(probs_list)
      if train:
        losses["confusion"] = jnp.mean(jnp.stack(confusions))
        losses["attribute_ce"] = jnp.mean(jnp.stack(ces))
    else:
      logits = self.gate(x)
    route = route_from_logits(logits, self.top_k)
    if train and self.specialization in ("attribute_routing", "class_routing"):
      losses["specialization"] = self._routing_specialization(
          route.probs, contributions, attributes
      )
    return FairRouterOutput(
        logits=route.logits,
        probs=route.probs,
        expert_index=route.expert_index,
        gates=route.gates,
        load_balance_loss=route.load_balance_loss,
        z_loss=route.z_loss,
        attribute_probs=attribute_probs,
        losses=losses,
        attribute_logits=sum(contributions) if contributions else None,
        competence=self._competence_head(),
    )

  def _competence_head(self) -> CompetenceHead | None:
    if self.specialization != "expert_competence":
      return None
    return CompetenceHead(
        kernel=self.competence_head.kernel[...],
        bias=self.competence_head.bias[...],
        assignment=self.assignment[...],
        group_sizes=self.group_sizes,
        alpha=self.alpha,
    )

  def _routing_specialization(
      self, probs: jax.Array, contributions: Sequence[jax.Array], attributes: jax.Array
  ) -> jax.Array:
    assignment = self.assignment[...]
    num_attributes = len(self.group_sizes)
    if self.specialization == "attribute_routing":
      if contributions:  # Each attribute's own vote, whatever the token's group.
        judged = jnp.stack([jax.nn.softmax(c, axis=-1) for c in contributions], axis=1)
      else:  # No SA branch: the router's distribution answers for every attribute.
        judged = jnp.repeat(probs[:, None, :], num_attributes, axis=1)
      return routing_supervision(judged, assignment, self.alpha)
    # class_routing: the experts of the token's class, for attributes whose class is known.
    classes = class_assignment(assignment, self.group_sizes)  # [sum G, E]
    known = attributes >= 0
    rows = jnp.where(known, attributes, 0) + jnp.asarray(class_offsets(self.group_sizes))
    judged = jnp.repeat(probs[:, None, :], num_attributes, axis=1)
    return routing_supervision(judged, classes[rows], self.alpha, known.astype(jnp.float32))
