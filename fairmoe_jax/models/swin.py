"""Swin Transformer backbone in Flax NNX with optional sparse-MoE blocks.

Swin (Liu et al. 2021) attends within local windows, alternating plain and cyclically shifted
ones; stages halve the resolution and double the width by patch merging. FairSMoE (Sec. 6.1)
replaces the MLP of the last block with a sparse MoE; `moe_blocks` indexes all stages' blocks
in order.

Submodule names follow timm (>= 0.9) `SwinTransformer` (layers[i].downsample merges patches
at the start of stages i > 0), so timm checkpoints map one to one (`convert_timm`); only
layouts differ (Linear kernels [in, out], conv kernels HWIO, images NHWC).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fairmoe_jax.models.classifier import BackboneClassifier, Context
from fairmoe_jax.models.vit import Attention, CheckpointedBlock, layer_norm, linear, patch_conv
from fairmoe_jax.moe import MoEAux
from trainkit.remat import check_remat

# timm initialises Swin like its ViT (vit.py), the relative position bias tables N(0, 0.02).
_BIAS_TABLE_INIT = nnx.initializers.normal(stddev=0.02)
_LAYER_NORM_EPS = 1e-5  # timm's Swin uses nn.LayerNorm's default, unlike its ViT (1e-6).
# timm fills the shifted-window mask with -100 rather than -inf: exp(-100) is 0
# in float32 and a fully masked row cannot produce NaNs.
_MASK_VALUE = -100.0

SWIN_PRESETS: dict[str, dict[str, Any]] = {
    "swin_small": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7),
    "swin_base": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=7),
    # For 64x64 images (patch 4): stage resolutions 16, 8, 4, 2, so the first two
    # stages have several windows and shifted blocks; the last two a single window.
    "swin_tiny_cpu": dict(
        embed_dim=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16), window_size=4
    ),
}


def _layer_norm(dim: int, dtype: Any, param_dtype: Any, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return layer_norm(dim, dtype, param_dtype, rngs, epsilon=_LAYER_NORM_EPS)


def window_partition(x: jax.Array, window: int) -> jax.Array:
  """[B, H, W, C] -> [B * nW, window, window, C], row-major per image; H, W multiples of window."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window, window, w // window, window, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window, window, c)


def window_reverse(windows: jax.Array, window: int, height: int, width: int) -> jax.Array:
  """Inverse of `window_partition`: [B * nW, window, window, C] -> [B, H, W, C]."""
  c = windows.shape[-1]
  x = windows.reshape(-1, height // window, width // window, window, window, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, height, width, c)


@functools.lru_cache(maxsize=None)
def relative_position_index(window: int) -> np.ndarray:
  """[N, N] int index into the bias table, N = window**2 (timm's constant buffer): entry (i, j)
  is (dy + window - 1) * (2 * window - 1) + (dx + window - 1), (dy, dx) = token i - token j."""
  coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij"))
  coords = coords.reshape(2, -1)  # [2, N], row-major
  rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
  index = rel[..., 0] * (2 * window - 1) + rel[..., 1]
  index.setflags(write=False)
  return index


@functools.lru_cache(maxsize=None)
def shifted_window_mask(height: int, width: int, window: int, shift: int) -> np.ndarray:
  """Additive attention mask [nW, N, N] (0 or -100) for shifted windows, as timm builds it.

  After the cyclic shift, an edge window holds tokens that were far apart (wrapped around); the
  padded image is cut into 3 x 3 regions (rows [0, H - window), [H - window, H - shift),
  [H - shift, H), likewise columns) and tokens attend only within their region.
  """
  labels = np.zeros((height, width), np.int32)
  cuts = lambda n: (slice(0, n - window), slice(n - window, n - shift), slice(n - shift, n))
  count = 0
  for hs in cuts(height):
    for ws in cuts(width):
      labels[hs, ws] = count
      count += 1
  windows = window_partition(labels[None, :, :, None], window).reshape(-1, window * window)
  windows = np.asarray(windows)
  mask = np.where(windows[:, None, :] != windows[:, :, None], _MASK_VALUE, 0.0)
  mask = mask.astype(np.float32)
  mask.setflags(write=False)
  return mask


class PatchEmbed(nnx.Module):
  """Non-overlapping patches -> [B, H/p, W/p, C] map, then LayerNorm (timm's Swin stem)."""

  def __init__(self, patch_size: int, dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    self.proj = patch_conv(patch_size, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm = _layer_norm(dim, dtype, param_dtype, rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    return self.norm(self.proj(images))


class PatchMerging(nnx.Module):
  """2x2 neighbourhoods -> one token: [B, H, W, C] -> [B, H/2, W/2, 2C].

  The four neighbours are concatenated in timm's order (row offset fastest):
  (0, 0), (1, 0), (0, 1), (1, 1), then LayerNorm(4C) and a bias-free Linear.
  Odd sizes are zero-padded at the bottom / right, as in timm.
  """

  def __init__(self, dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    self.norm = _layer_norm(4 * dim, dtype, param_dtype, rngs)
    self.reduction = linear(4 * dim, 2 * dim, dtype, param_dtype, rngs, use_bias=False)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    x = jnp.pad(x, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
    h, w = x.shape[1], x.shape[2]
    # [B, H/2, dy, W/2, dx, C] -> [B, H/2, W/2, dx, dy, C]: timm's permute(0, 1, 3, 4, 2, 5).
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5)
    return self.reduction(self.norm(x.reshape(b, h // 2, w // 2, 4 * c)))


class WindowAttention(Attention):
  """Multi-head self-attention inside windows, with a learned relative position bias."""

  def __init__(
      self,
      dim: int,
      num_heads: int,
      window: int,
      *,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
  ):
    super().__init__(
        dim, num_heads, dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.window = window
    # One learned bias per head and relative offset (dy, dx) in [-(w-1), w-1]^2;
    # the index into it is a constant recomputed at trace time, not state.
    self.relative_position_bias_table = nnx.Param(
        _BIAS_TABLE_INIT(rngs.params(), ((2 * window - 1) ** 2, num_heads), param_dtype)
    )

  def relative_position_bias(self) -> jax.Array:
    """[heads, N, N] float32 bias added to the attention logits."""
    n = self.window**2
    index = relative_position_index(self.window).reshape(-1)
    bias = self.relative_position_bias_table[...].astype(jnp.float32)[index]
    return bias.reshape(n, n, self.num_heads).transpose(2, 0, 1)

  def logits_bias(self, mask: np.ndarray | None, batch: int) -> jax.Array:
    """[1 or batch, heads, N, N] for `batch` windows, of one image after another; mask: the
    shifted windows' [nW, N, N] or None."""
    bias = self.relative_position_bias()[None]
    if mask is None:
      return bias
    bias = bias + mask[:, None]  # [nW, heads, N, N]
    return jnp.tile(bias, (batch // mask.shape[0], 1, 1, 1))


class SwinBlock(CheckpointedBlock, nnx.Module):
  """(Shifted-)window attention block on a [B, H, W, C] map; the MLP is dense or a `SparseMoE`.

  As in timm, at a resolution <= `window_size` one window covers the map, unshifted.
  """

  def __init__(
      self,
      dim: int,
      num_heads: int,
      resolution: int,
      window_size: int,
      shift: bool,
      mlp_dim: int,
      *,
      moe: Mapping[str, Any] | None,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
      remat: str = "none",
  ):
    if resolution <= window_size:
      window_size, shift = resolution, False
    self.resolution = resolution
    self.window = window_size
    self.shift = window_size // 2 if shift else 0
    self.remat = check_remat(remat)
    self.norm1 = _layer_norm(dim, dtype, param_dtype, rngs)
    self.attn = WindowAttention(
        dim,
        num_heads,
        window_size,
        dropout_rate=dropout_rate,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )
    self.norm2 = _layer_norm(dim, dtype, param_dtype, rngs)
    self.init_mlp(dim, mlp_dim, moe, dropout_rate, dtype, param_dtype, rngs)

  def attention(self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
    """Window attention on a [B, H, W, C] map (already normalised), same shape out."""
    b, h, w, c = x.shape
    win, shift = self.window, self.shift
    if shift:
      x = jnp.roll(x, (-shift, -shift), axis=(1, 2))
    # Zero-pad to whole windows after the shift (timm does the same; padded
    # tokens take part in attention and are cut off afterwards).
    pad_h, pad_w = -h % win, -w % win
    x = jnp.pad(x, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)))
    hp, wp = h + pad_h, w + pad_w
    mask = shifted_window_mask(hp, wp, win, shift) if shift else None
    windows = window_partition(x, win).reshape(-1, win * win, c)
    windows = self.attn(windows, mask, train=train, rngs=rngs)
    x = window_reverse(windows.reshape(-1, win, win, c), win, hp, wp)[:, :h, :w]
    if shift:
      x = jnp.roll(x, (shift, shift), axis=(1, 2))
    return x

  def forward(
      self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Context = None
  ) -> tuple[jax.Array, MoEAux | None]:
    """The block without rematerialisation (what `__call__` checkpoints)."""
    b, h, w, c = x.shape
    x = x + self.attention(self.norm1(x), train=train, rngs=rngs)
    tokens = self.norm2(x).reshape(b, h * w, c)
    y, aux = self.feed_forward(tokens, train=train, rngs=rngs, context=context)
    # Tokens dropped by the MoE get y = 0 and pass through on the residual.
    return x + y.reshape(b, h, w, c).astype(x.dtype), aux


class SwinStage(nnx.Module):
  """Optional patch merging (stages > 0), then blocks alternating plain / shifted windows."""

  def __init__(
      self,
      in_dim: int,
      dim: int,
      resolution: int,
      depth: int,
      num_heads: int,
      window_size: int,
      mlp_dim: int,
      *,
      downsample: bool,
      moe_flags: Sequence[bool],
      moe: Mapping[str, Any] | None,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
      remat: str = "none",
  ):
    self.downsample = (
        PatchMerging(in_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if downsample
        else None
    )
    self.blocks = nnx.List(
        [
            SwinBlock(
                dim,
                num_heads,
                resolution,
                window_size,
                j % 2 == 1,
                mlp_dim,
                moe=moe if moe_flags[j] else None,
                dropout_rate=dropout_rate,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
                remat=remat,
            )
            for j in range(depth)
        ]
    )


class SwinTransformer(BackboneClassifier):
  """Swin Transformer classifier whose `moe_blocks` use a sparse-MoE feed-forward.

  Arguments as `VisionTransformer`'s, except: `embed_dim` is the first stage's width (stage i
  has embed_dim * 2**i), `depths` and `num_heads` are per stage, `mlp_ratio` is the MLP (and
  expert) hidden width / stage width, `moe_blocks` indexes all stages' blocks (stage 0 first),
  and dropout also applies before the head. Patch merging and the head are not rematerialised.
  """

  def __init__(
      self,
      *,
      num_classes: int,
      image_size: int,
      patch_size: int = 4,
      embed_dim: int,
      depths: Sequence[int],
      num_heads: Sequence[int],
      window_size: int = 7,
      mlp_ratio: float = 4.0,
      moe_blocks: Sequence[int] = (-1,),
      moe: Mapping[str, Any] | None = None,
      dropout_rate: float = 0.0,
      dtype: Any = jnp.float32,
      param_dtype: Any = jnp.float32,
      rngs: nnx.Rngs,
      remat: str = "none",
  ):
    if image_size % patch_size:
      raise ValueError(f"image_size={image_size} is not divisible by patch_size={patch_size}")
    if len(depths) != len(num_heads):
      raise ValueError(f"depths={tuple(depths)} and num_heads={tuple(num_heads)} differ in length")
    moe_set = self._set_moe_blocks(moe_blocks, moe, sum(depths))
    self.num_classes = num_classes
    self.image_size = image_size
    self.patch_size = patch_size
    self.dropout_rate = dropout_rate
    self.dtype = dtype
    dims = [embed_dim * 2**i for i in range(len(depths))]
    self.num_features = dims[-1]

    self.patch_embed = PatchEmbed(
        patch_size, embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    stages = []
    resolution, start = image_size // patch_size, 0
    for i, (depth, heads) in enumerate(zip(depths, num_heads)):
      if i > 0:
        resolution = (resolution + 1) // 2  # PatchMerging pads odd sizes.
      stages.append(
          SwinStage(
              dims[i - 1] if i > 0 else embed_dim,
              dims[i],
              resolution,
              depth,
              heads,
              window_size,
              int(dims[i] * mlp_ratio),
              downsample=i > 0,
              moe_flags=[start + j in moe_set for j in range(depth)],
              moe=moe,
              dropout_rate=dropout_rate,
              dtype=dtype,
              param_dtype=param_dtype,
              rngs=rngs,
              remat=remat,
          )
      )
      start += depth
    self.layers = nnx.List(stages)
    self.norm = _layer_norm(dims[-1], dtype, param_dtype, rngs)
    self.head = ClassifierHead(
        dims[-1],
        num_classes,
        dropout_rate=dropout_rate,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )

  def _encode(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Context
  ) -> tuple[jax.Array, MoEAux]:
    """[B, H, W, 3] -> (pooled final-norm feature [B, C], merged MoEAux)."""
    self._check_rngs(train, rngs)
    x = self.patch_embed(images.astype(self.dtype))
    auxes: dict[str, MoEAux] = {}
    index = 0
    for stage in self.layers:
      if stage.downsample is not None:
        x = stage.downsample(x)
      for block in stage.blocks:
        x, aux = block(x, train=train, rngs=rngs, context=context)
        if aux is not None:
          auxes[f"moe_block{index}"] = aux
        index += 1
    # Mean in float32: with bf16 compute, summing H*W tokens in bf16 loses precision.
    feats = self.norm(x).astype(jnp.float32).mean(axis=(1, 2)).astype(self.dtype)
    return feats, MoEAux.merge(auxes)

  def classify(self, feats: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
    return self.head(feats, train=train, rngs=rngs).astype(jnp.float32)


class ClassifierHead(nnx.Module):
  """Dropout then Linear, named like timm's ClassifierHead (`head.fc`)."""

  def __init__(
      self,
      dim: int,
      num_classes: int,
      *,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
  ):
    self.drop = nnx.Dropout(dropout_rate)
    self.fc = linear(dim, num_classes, dtype, param_dtype, rngs)

  def __call__(self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
    return self.fc(self.drop(x, deterministic=not train, rngs=rngs))
