"""Vanilla SMoE (paper Table 1's baseline) and the plain MoE with any router.

`vanilla_smoe`: a top-k router (Eq. 5-6) without noise; `smoe`: the router `moe.router`;
`vanilla_smoe_psi`: vanilla SMoE plus FairSMoE's fairness loss lambda * L_Psi (Eq. 3-4, the same
`fair.psi` and its lambdas), the control that tells what FGR and FEM add beyond the loss.
All minimise the cross-entropy plus the MoE auxiliary losses every MoE method shares
(`moe.aux_loss_weight`, `moe.z_loss_weight`; 0 by default, as the paper's vanilla SMoE has
no auxiliary loss).
"""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax

from fairmoe_jax.methods import base
from fairmoe_jax.models.backbones import build_backbone


@dataclasses.dataclass(frozen=True)
class PlainSMoE(base.Method):
  name: str
  fixed_router: str | None  # None: config.moe.router
  fairness_loss: bool = False  # Adds lambda * L_Psi, as FairSMoE does.

  def build_model(self, config, info, rngs, mesh):
    router = self.fixed_router or config.moe.router
    return build_backbone(config, info.num_classes, base.moe_kwargs(config, mesh, router), rngs)

  def loss_terms(self, config, info):

    def terms(model, batch, rng, step, extra):
      del step, extra
      rngs = nnx.Rngs(dropout=rng, noise=jax.random.fold_in(rng, 1))
      logits, aux = model(batch["image"], train=True, rngs=rngs)
      terms = {"cross_entropy": base.cross_entropy(logits, batch["label"])}
      if self.fairness_loss:
        terms["fairness"] = base.psi_term(config, info, logits, batch)
      terms.update(base.auxiliary_terms(config, aux))
      metrics = {"accuracy": base.accuracy(logits, batch["label"]), **base.routing_metrics(aux)}
      return terms, metrics

    return terms
