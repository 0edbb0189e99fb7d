"""FairSMoE (paper Sec. 5) and its two ablations of Table 2.

| method          | router                         | loss terms                                          |
|-----------------|--------------------------------|-----------------------------------------------------|
| fairsmoe        | FGR + FEM                      | cross_entropy, fairness (lambda L_Psi), confusion,  |
|                 |                                | attribute_ce, specialization                        |
| fairsmoe_no_fgr | plain gate + FEM               | cross_entropy, fairness, specialization             |
| fairsmoe_no_fem | FGR, no expert management      | cross_entropy, fairness, confusion, attribute_ce    |

plus the shared MoE auxiliary terms (`base.auxiliary_terms`). The total is "overall loss adding
eq. (4), Equation (7) and Equation (8) together" (Sec. 6.1); `attribute_ce` trains the SA
classifiers, which Eq. 7 alone cannot (docs/design.md). `fair.specialization` picks the reading
of Eq. 8 (`fairmoe_jax.moe.routers.fair`). With FEM, expert allocation is reviewed every
`fair.review_every_steps` steps on the validation split (`fairmoe_jax.fairness.experts`).
"""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax
import numpy as np

from fairmoe_jax.fairness import experts as experts_lib
from fairmoe_jax.methods import base
from fairmoe_jax.models.backbones import build_backbone
from fairmoe_jax.moe.routers.fair import FairRouter
from trainkit.mesh import place, replicated
from trainkit.train_state import state_shardings

_WEIGHT_KEYS = {
    "confusion": "confusion_weight",
    "attribute_ce": "attribute_ce_weight",
    "specialization": "specialization_weight",
}


@dataclasses.dataclass(frozen=True)
class FairSMoE:
  name: str
  guided: bool  # FGR
  managed: bool  # FEM

  def build_model(self, config, info, rngs, mesh):
    f = config.fair

    def make_router(dim: int, num_experts: int, top_k: int, *, rngs: nnx.Rngs) -> FairRouter:
      return FairRouter(
          dim,
          num_experts,
          top_k,
          info.group_sizes,
          num_classes=info.num_classes,
          guided=self.guided,
          specialization=f.specialization if self.managed else None,
          route_by=f.route_by,
          feature_dim=f.feature_dim or None,
          alpha=f.alpha,
          rngs=rngs,
      )

    moe = base.moe_kwargs(config, mesh, make_router)
    return build_backbone(config, info.num_classes, moe, rngs)

  def loss_terms(self, config, info):
    def terms(model, batch, rng, step, extra):
      del step, extra
      rngs = nnx.Rngs(dropout=rng)
      context = {"attributes": batch["attributes"], "label": batch["label"]}
      logits, aux = model(batch["image"], train=True, rngs=rngs, context=context)
      terms = {
          "cross_entropy": base.cross_entropy(logits, batch["label"]),
          "fairness": base.psi_term(config, info, logits, batch),
      }
      for name, value in aux.extra_losses.items():
        terms[name] = config.fair[_WEIGHT_KEYS[name]] * value
      terms.update(base.auxiliary_terms(config, aux))
      metrics = {"accuracy": base.accuracy(logits, batch["label"]), **base.routing_metrics(aux)}
      return terms, metrics

    return terms

  def eval_context(self, config, batch):
    # Algorithm 1 routes from the SA classifiers' predictions: no sensitive label at inference.
    return {"attributes": batch["attributes"]} if config.fair.route_by == "label" else None

  def manages_experts(self, config) -> bool:
    return self.managed and config.fair.dynamic_allocation and config.fair.review_every_steps > 0

  def initial_extra(self, config, info):
    if not self.manages_experts(config):
      return {}
    return {"fem": experts_lib.initial_state(info.num_attributes)}

  def review(self, config, info, *, graphdef, mesh, validate):
    if not self.manages_experts(config):
      return None

    def write_assignment(state, fem, assignment):
      model = nnx.merge(graphdef, state.params, state.model_state)
      experts_lib.set_assignment(model, assignment)
      _, _, model_state = nnx.split(model, nnx.Param, ...)
      model_state = place(model_state, state_shardings(state.model_state, mesh))
      fem = place(jax.tree.map(np.asarray, fem), replicated(mesh))
      return state.replace(model_state=model_state, extra=dict(state.extra, fem=fem))

    review = experts_lib.make_expert_manager(
        attribute_names=info.attribute_names,
        num_experts=config.moe.num_experts,
        patience=config.fair.patience,
        tolerance=config.fair.tolerance,
        psi=config.fair.psi,
        validate=validate,
        write_assignment=write_assignment,
    )
    return config.fair.review_every_steps, review
