"""Backbones: ViT / DeiT and Swin with optional sparse-MoE blocks; timm checkpoint conversion."""

from fairmoe_jax.models.convert_timm import export_timm_state_dict, load_timm_checkpoint
from fairmoe_jax.models.swin import SWIN_PRESETS, SwinTransformer
from fairmoe_jax.models.vit import VIT_PRESETS, VisionTransformer

__all__ = [
    "SWIN_PRESETS",
    "SwinTransformer",
    "VIT_PRESETS",
    "VisionTransformer",
    "export_timm_state_dict",
    "load_timm_checkpoint",
]
