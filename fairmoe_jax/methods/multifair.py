"""MultiFair baseline (Tian et al. 2024), as the paper ran it: "a single backbone without SMoE,
implementing only the data augmentation method proposed in MultiFair".

At step t the attribute t mod m is chosen and every example is mixed (lambda ~
Beta(`multifair.mixup_alpha`)) with a partner from another group of that attribute
(`fairmoe_jax.fairness.mixup`); the loss is CE(clean) + weight * CE of the mixed images to the
mixed labels.
"""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax

from fairmoe_jax.fairness.mixup import mix
from fairmoe_jax.methods import base
from fairmoe_jax.models.backbones import build_backbone


@dataclasses.dataclass(frozen=True)
class MultiFair(base.Method):
  name: str = "multifair"

  def build_model(self, config, info, rngs, mesh):
    del mesh
    return build_backbone(config, info.num_classes, None, rngs)

  def loss_terms(self, config, info):
    num_attributes = len(info.group_sizes)

    def terms(model, batch, rng, step, extra):
      del extra
      rngs = nnx.Rngs(dropout=rng)
      logits, _ = model(batch["image"], train=True, rngs=rngs)
      groups = jnp.take(batch["attributes"], step % num_attributes, axis=1)
      images, partners, lam = mix(
          jax.random.fold_in(rng, 2), batch["image"], groups, config.multifair.mixup_alpha
      )
      mixed_logits, _ = model(images, train=True, rngs=rngs)
      ce = optax.softmax_cross_entropy_with_integer_labels
      mixed_ce = jnp.mean(
          lam * ce(mixed_logits, batch["label"])
          + (1 - lam) * ce(mixed_logits, batch["label"][partners])
      )
      terms = {
          "cross_entropy": base.cross_entropy(logits, batch["label"]),
          "mixup_cross_entropy": config.multifair.weight * mixed_ce,
      }
      return terms, {"accuracy": base.accuracy(logits, batch["label"])}

    return terms
