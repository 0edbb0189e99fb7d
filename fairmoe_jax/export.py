"""What `--mode=export` writes beside the weights: a timm `config.json` that says what they are.

`<workdir>/export/` holds `model.safetensors` (timm names, PyTorch layouts;
`fairmoe_jax.models.convert_timm`) and `config.json` in the format timm reads
(`timm.create_model("local-dir:<workdir>/export")`): `architecture`, a registered timm model of
the same family; `model_args`, every shape argument; `pretrained_cfg`, only fields of timm's
`PretrainedCfg`. Models timm cannot build (a sparse-MoE block, Muffin) are still described, with
`timm_loadable: false` and `why_not_timm`.
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np
from flax import nnx

from fairmoe_jax.models.backbones import BACKBONES
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.models.swin import SWIN_PRESETS, SwinTransformer
from fairmoe_jax.models.vit import VisionTransformer
from fairmoe_jax.run_info import RunMetadata

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Our backbone preset -> the registered timm model of the same shape ("vit": from model_args).
TIMM_ARCHITECTURES: dict[str | None, str] = {
    None: "vit_base_patch16_224",
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
    "swin_tiny_cpu": "swin_tiny_patch4_window7_224",
    "swin_small": "swin_small_patch4_window7_224",
    "swin_base": "swin_base_patch4_window7_224",
}
# timm's eval transform with crop_pct=1.0 resizes the short side to the input size and
# centre-crops it: `images.square_resize`.
CROP_PCT = 1.0
CROP_MODE = "center"
INTERPOLATION = "bicubic"
LOAD_OURS = (
    "fairmoe_jax.models.load_timm_checkpoint(model, path, skip=()) into the run's model "
    "(built from its config.json), or fairmoe_jax.load_run(workdir) for the whole run"
)


def preprocessing_statement(image_size: int, mean: Any, std: Any) -> str:
  """The evaluation pipeline's preprocessing, step by step, in words."""
  return (
      f"decode to RGB (PIL; a JPEG may be decoded at 1/2, 1/4 or 1/8 scale when that still "
      f"covers {image_size} px: PIL's draft mode); resize the short side to {image_size} px "
      f"and crop the centred {image_size}x{image_size} square, in one PIL bicubic "
      f"(antialiased) pass over the central square of the image; scale pixels to [0, 1], "
      f"subtract mean {list(mean)} and divide by std {list(std)} per channel. In timm's terms "
      f"crop_pct={CROP_PCT}, crop_mode={CROP_MODE}, interpolation={INTERPOLATION}; timm resizes "
      "then crops with rounded sizes and offsets, which moves the crop by less than half an "
      "output pixel"
  )


def _hidden(state: dict[str, np.ndarray], prefix: str) -> int:
  """The MLP hidden width of the block at `prefix`, from its dense or expert fc1 weight."""
  for name in (f"{prefix}.mlp.fc1.weight", f"{prefix}.mlp.experts.fc1.weight"):
    if name in state:
      return int(state[name].shape[-2])  # [hidden, dim], or [E, hidden, dim] for experts.
  raise KeyError(f"no fc1 weight under {prefix}.mlp in the exported state dict")


def _mlp_ratio(dim: int, hidden: int) -> float:
  """hidden / dim as the float timm's blocks turn back into int(dim * mlp_ratio) == hidden."""
  ratio = hidden / dim
  if int(dim * ratio) != hidden:
    raise ValueError(f"an MLP of {hidden} for width {dim} has no mlp_ratio timm rounds back")
  return ratio


def _vit_args(model: VisionTransformer, state: dict[str, np.ndarray]) -> dict[str, Any]:
  """timm VisionTransformer keyword arguments that build `model`'s dense counterpart."""
  return {
      "img_size": model.image_size,
      "patch_size": model.patch_size,
      "embed_dim": model.dim,
      "depth": len(model.blocks),
      "num_heads": model.blocks[0].attn.num_heads,
      "mlp_ratio": _mlp_ratio(model.dim, _hidden(state, "blocks.0")),
      "num_classes": model.num_classes,
      # Our ViT classifies the final-norm class token, with qkv biases: timm's defaults,
      # spelled out so that the file does not depend on them.
      "class_token": True,
      "global_pool": "token",
      "qkv_bias": True,
  }


def _swin_args(
    model: SwinTransformer, state: dict[str, np.ndarray], window_size: int
) -> dict[str, Any]:
  """timm SwinTransformer keyword arguments that build `model`'s dense counterpart."""
  embed_dim = int(state["patch_embed.proj.weight"].shape[0])
  return {
      "img_size": model.image_size,
      "patch_size": model.patch_size,
      "window_size": window_size,
      "embed_dim": embed_dim,
      "depths": [len(stage.blocks) for stage in model.layers],
      "num_heads": [stage.blocks[0].attn.num_heads for stage in model.layers],
      "mlp_ratio": _mlp_ratio(embed_dim, _hidden(state, "layers.0.blocks.0")),
      "num_classes": model.num_classes,
      "global_pool": "avg",
  }


def _moe_blocks(backbone: nnx.Module) -> list[str]:
  """timm names of the blocks whose MLP is a sparse MoE, e.g. ["blocks.11"]."""
  if isinstance(backbone, SwinTransformer):
    return [
        f"layers.{s}.blocks.{b}"
        for s, stage in enumerate(backbone.layers)
        for b, block in enumerate(stage.blocks)
        if block.is_moe
    ]
  return [f"blocks.{i}" for i in backbone.moe_blocks]


def timm_config(
    model: nnx.Module,
    state: dict[str, np.ndarray],
    config: ml_collections.ConfigDict,
    metadata: RunMetadata,
    step: int | None,
) -> dict[str, Any]:
  """The export's `config.json` (module docstring) for `model` and its exported `state`.

  Args:
    model: The trained model (`inference.Restored.model`).
    state: `export_timm_state_dict(model)`, the content of model.safetensors.
    config: The run's config.
    metadata: The run's class names and preprocessing (run_info.json).
    step: The checkpoint's step.
  """
  family, preset = BACKBONES[config.model.backbone]
  backbone, prefix = model, ""
  if isinstance(model, Muffin):
    backbone, prefix = model.backbones[0], "backbones.0."
  backbone_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
  if family == "swin":
    args = _swin_args(backbone, backbone_state, SWIN_PRESETS[preset]["window_size"])
    global_pool, classifier = "avg", "head.fc"
  else:
    args = _vit_args(backbone, backbone_state)
    global_pool, classifier = "token", "head"
  architecture = TIMM_ARCHITECTURES[preset]
  pre = metadata.preprocessing
  size = pre.image_size
  why_not = None
  moe_blocks = _moe_blocks(backbone)
  if isinstance(model, Muffin):
    why_not = (
        f"Muffin fuses {len(model.backbones)} {config.model.backbone} backbones "
        "(backbones.<n>.*, each with its own head) with fusion_head.*; timm has no such model"
    )
  elif moe_blocks:
    why_not = (
        f"{', '.join(moe_blocks)} of this {config.model.backbone} backbone hold a sparse "
        f"mixture-of-experts layer ({moe_blocks[0]}.mlp.experts.fc1/fc2.*, "
        f"{moe_blocks[0]}.mlp.router.*) instead of a dense MLP; timm has no MoE block"
    )
  loadable = why_not is None
  if loadable:
    load_with = (
        f'timm.create_model("{architecture}", pretrained=False, **model_args) then '
        f"load_state_dict(safetensors.torch.load_file({WEIGHTS_FILE!r}), strict=True); or "
        'timm.create_model("local-dir:<this folder>", pretrained=True) (tested with timm 1.0.31)'
    )
  else:
    load_with = LOAD_OURS
  out: dict[str, Any] = {
      "architecture": architecture,
      "num_classes": backbone.num_classes,
      "num_features": backbone.num_features,
      "global_pool": global_pool,
      "label_names": list(metadata.class_names),
      "model_args": args,
      "pretrained_cfg": {
          "input_size": [3, size, size],
          "fixed_input_size": True,
          "interpolation": INTERPOLATION,
          "crop_pct": CROP_PCT,
          "crop_mode": CROP_MODE,
          "mean": list(pre.mean),
          "std": list(pre.std),
          "num_classes": backbone.num_classes,
          "first_conv": "patch_embed.proj",
          "classifier": classifier,
          "custom_load": False,
          "description": (
              f"fairmoe_jax {config.method} run on {metadata.dataset}, step {step} "
              f"({config.model.backbone} backbone)"
          ),
      },
      "timm_loadable": loadable,
      "load_with": load_with,
      "preprocessing": preprocessing_statement(size, pre.mean, pre.std),
      "fairmoe_jax": {
          "method": config.method,
          "backbone": config.model.backbone,
          "step": step,
          "dataset": metadata.dataset,
          "weights": WEIGHTS_FILE,
          "moe_blocks": moe_blocks,
          "attribute_names": list(metadata.attribute_names),
      },
  }
  if not loadable:
    out["why_not_timm"] = why_not
  return out
