"""Backbones by name (`config.model.backbone`), each with the MoE in its last block by default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.nnx as nnx
import ml_collections

from fairmoe_jax.models.vit import VIT_PRESETS, VisionTransformer
from trainkit.train_state import compute_dtype

# name -> (family, preset); "vit" takes its shape from config.model (dim, depth, ...).
BACKBONES: dict[str, tuple[str, str | None]] = {
    "vit": ("vit", None),
    "deit_t": ("vit", "deit_tiny"),
    "deit_s": ("vit", "deit_small"),
    "deit_b": ("vit", "deit_base"),
    "swin_tiny_cpu": ("swin", "swin_tiny_cpu"),
    "swin_s": ("swin", "swin_small"),
    "swin_b": ("swin", "swin_base"),
}


def build_backbone(
    config: ml_collections.ConfigDict,
    num_classes: int,
    moe: Mapping[str, Any] | None,
    rngs: nnx.Rngs,
) -> nnx.Module:
  """The classifier `config.model.backbone` with `moe` (SparseMoE kwargs) in `config.moe.blocks`."""
  m = config.model
  family, preset = BACKBONES[m.backbone]
  common = dict(
      num_classes=num_classes,
      image_size=config.data.image_size,
      moe_blocks=tuple(config.moe.blocks),
      moe=moe,
      dropout_rate=m.dropout_rate,
      dtype=compute_dtype(config.compute_dtype),
      rngs=rngs,
      remat=m.remat,
  )
  if family == "swin":
    from fairmoe_jax.models.swin import SWIN_PRESETS, SwinTransformer

    return SwinTransformer(**SWIN_PRESETS[preset], **common)
  if preset is None:
    shape = dict(dim=m.dim, depth=m.depth, num_heads=m.num_heads, mlp_dim=m.mlp_dim)
  else:
    shape = VIT_PRESETS[preset]
  return VisionTransformer(patch_size=m.patch_size, **shape, **common)
