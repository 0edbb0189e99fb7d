"""What every backbone classifier shares: features, logits and the call contract."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from flax import nnx

from fairmoe_jax.moe import MoEAux

# What a backbone passes its MoE routers besides the tokens (e.g. the batch's "attributes").
Context = Mapping[str, jax.Array] | None


class BackboneClassifier(nnx.Module):
  """Base of the ViT/DeiT and Swin classifiers.

  Subclasses set `num_features` and implement `_encode` (images -> pre-head feature and merged
  MoEAux) and `classify` (feature -> logits).
  """

  num_features: int

  def _set_moe_blocks(self, moe_blocks: Sequence[int], moe: object, num_blocks: int) -> set[int]:
    """Sets `self.moe_blocks`, the sorted block indices `moe_blocks` names; returns them as a set."""
    blocks = set()
    for i in moe_blocks if moe is not None else ():
      if not -num_blocks <= i < num_blocks:
        raise ValueError(f"moe_blocks index {i} out of range for {num_blocks} blocks")
      blocks.add(i % num_blocks)
    self.moe_blocks: tuple[int, ...] = tuple(sorted(blocks))
    return blocks

  def _check_rngs(self, train: bool, rngs: nnx.Rngs | None) -> None:
    if train and getattr(self, "dropout_rate", 0.0) > 0 and rngs is None:
      raise ValueError("train=True with dropout_rate > 0 needs `rngs` with a 'dropout' stream")

  def classify(self, feats: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Pre-head feature [B, num_features] -> float32 logits [B, num_classes]."""
    raise NotImplementedError

  def features(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None, context: Context = None
  ) -> jax.Array:
    """Pre-head feature [B, num_features] in the compute dtype (MoE auxiliary losses dropped)."""
    return self._encode(images, train=train, rngs=rngs, context=context)[0]

  def __call__(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None, context: Context = None
  ) -> tuple[jax.Array, MoEAux]:
    """[B, H, W, 3] -> (float32 logits [B, num_classes], MoEAux summed over MoE blocks).

    `context` holds per-example arrays [B, ...] handed to every MoE router (e.g. the sensitive
    attributes for fairness-guided routing). Aux metrics are keyed "moe_block{i}/<metric>", i
    the block index over all stages.
    """
    feats, aux = self._encode(images, train=train, rngs=rngs, context=context)
    return self.classify(feats, train=train, rngs=rngs), aux
