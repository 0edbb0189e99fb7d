"""Backbones: ViT / DeiT with optional sparse-MoE blocks."""

from fairmoe_jax.models.vit import VIT_PRESETS, VisionTransformer, num_params

__all__ = ["VIT_PRESETS", "VisionTransformer", "num_params"]
