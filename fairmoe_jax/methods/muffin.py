"""Muffin baseline (Sheng et al. 2023): backbones first trained toward fairness on one attribute
each, then fused by a learned head (paper Table 1; "two backbones without SMoE, following the
default fusing method").

Phase 1 (the first `muffin.pretrain_fraction` of the steps) trains each backbone with its own
head on CE + lambda L_Psi of its attribute; phase 2 trains the fusion head on the concatenated,
stop-gradiented features with CE + lambda L_Psi over all attributes. The phase is chosen inside
the jitted step from the step counter, so nothing recompiles.
"""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from fairmoe_jax.methods import base
from fairmoe_jax.models.backbones import build_backbone
from fairmoe_jax.models.muffin import Muffin
from trainkit.errors import ConfigError


def muffin_attributes(config, info) -> tuple[int, ...]:
  """The attribute each backbone is first trained on; () means the first two."""
  return tuple(config.muffin.attributes) or tuple(range(min(2, info.num_attributes)))


@dataclasses.dataclass(frozen=True)
class MuffinMethod(base.Method):
  name: str = "muffin"

  def build_model(self, config, info, rngs, mesh):
    del mesh
    attributes = muffin_attributes(config, info)
    bad = [a for a in attributes if not 0 <= a < info.num_attributes]
    if bad:
      raise ConfigError(
          "muffin.attributes",
          f"{attributes}: one attribute index per backbone, each in "
          f"[0, {info.num_attributes}) for the attributes {', '.join(info.attribute_names)}",
      )
    make = lambda r: build_backbone(config, info.num_classes, None, r)
    return Muffin(make, len(attributes), info.num_classes, rngs=rngs)

  def loss_terms(self, config, info):
    def terms(model: Muffin, batch, rng, step, extra):
      del extra
      in_phase_1 = step < int(config.muffin.pretrain_fraction * config.num_train_steps)
      phase_1 = in_phase_1.astype(jnp.float32)
      fused, branch_logits, features = model.branches(
          batch["image"], train=True, rngs=nnx.Rngs(dropout=rng)
      )
      branch_ce, branch_fairness = 0.0, 0.0
      for logits, attribute in zip(branch_logits, muffin_attributes(config, info)):
        branch_ce += base.cross_entropy(logits, batch["label"])
        branch_fairness += base.psi_term(config, info, logits, batch, (attribute,))
      fused = model.fuse([jax.lax.stop_gradient(x) for x in features])
      terms = {
          "branch_cross_entropy": phase_1 * branch_ce,
          "branch_fairness": phase_1 * branch_fairness,
          "cross_entropy": (1 - phase_1) * base.cross_entropy(fused, batch["label"]),
          "fairness": (1 - phase_1) * base.psi_term(config, info, fused, batch),
      }
      metrics = {"muffin_phase": 2.0 - phase_1, "accuracy": base.accuracy(fused, batch["label"])}
      return terms, metrics

    return terms
