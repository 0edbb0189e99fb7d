"""Muffin baseline (Wang et al. 2023): several backbones fused by a learned head.

Each backbone's own `head` classifies while it is first trained toward fairness on its own
sensitive attribute; the fusion head then classifies from the concatenated features. The
schedule lives in `fairmoe_jax.methods.muffin`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fairmoe_jax.models.classifier import Context
from fairmoe_jax.moe import MoEAux


class Muffin(nnx.Module):
  """Backbones without MoE whose features a linear head fuses.

  `make_backbone` builds one `BackboneClassifier`; `num_backbones` is one per attribute.
  """

  def __init__(
      self,
      make_backbone: Callable[[nnx.Rngs], nnx.Module],
      num_backbones: int,
      num_classes: int,
      *,
      rngs: nnx.Rngs,
  ):
    self.backbones = nnx.List([make_backbone(rngs) for _ in range(num_backbones)])
    width = sum(b.num_features for b in self.backbones)
    self.fusion_head = nnx.Linear(
        width, num_classes, kernel_init=nnx.initializers.normal(stddev=0.02), rngs=rngs
    )

  def branches(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None
  ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """(fused float32 logits [B, K], per-backbone float32 logits, per-backbone features)."""
    features = [b.features(images, train=train, rngs=rngs) for b in self.backbones]
    branch_logits = [
        b.classify(f, train=train, rngs=rngs) for b, f in zip(self.backbones, features)
    ]
    fused = self.fusion_head(jnp.concatenate(features, axis=-1)).astype(jnp.float32)
    return fused, branch_logits, features

  def fuse(self, features: Sequence[jax.Array]) -> jax.Array:
    return self.fusion_head(jnp.concatenate(list(features), axis=-1)).astype(jnp.float32)

  def __call__(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None, context: Context = None
  ) -> tuple[jax.Array, MoEAux]:
    """Fused logits; the same call contract as the MoE backbones (no MoE, zero aux)."""
    del context
    return self.branches(images, train=train, rngs=rngs)[0], MoEAux.zeros()
