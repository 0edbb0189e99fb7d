"""ViT / DeiT backbone in Flax NNX with optional sparse-MoE blocks.

FairSMoE (paper Sec. 5, Fig. 3) replaces the MLP of the last block of a DeiT
with a sparse MoE layer; `moe_blocks` chooses which blocks do so.

Submodule names follow timm's `VisionTransformer` (patch_embed.proj, cls_token,
pos_embed, blocks[i].norm1 / attn.qkv / attn.proj / norm2 / mlp.fc1 / mlp.fc2,
norm, head) so timm checkpoints map one to one; only layouts differ
(Linear kernels are [in, out], conv kernels are HWIO, images are NHWC).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fairmoe_jax.models.classifier import BackboneClassifier, Context
from fairmoe_jax.moe import MoEAux, SparseMoE
from fairmoe_jax.moe.dispatch import spmd
from trainkit.remat import check_remat, checkpointed

# timm's ViT/DeiT initialisation: N(0, 0.02) linear kernels and position embedding, zero
# biases, LayerNorm (1, 0), N(0, 1e-6) class token. timm's trunc_normal_(std=.02) cuts at +-2 in
# absolute value (100 std), so it is a plain normal (JAX's truncated_normal cuts at +-2 std).
_LINEAR_INIT = nnx.initializers.normal(stddev=0.02)
# PyTorch's default conv init, kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(fan_in)).
_CONV_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
_LAYER_NORM_EPS = 1e-6  # timm uses 1e-6 for ViT/DeiT, not PyTorch's 1e-5.

VIT_PRESETS: dict[str, dict[str, int]] = {
    "deit_tiny": dict(dim=192, depth=12, num_heads=3, mlp_dim=768),
    "deit_small": dict(dim=384, depth=12, num_heads=6, mlp_dim=1536),
    "deit_base": dict(dim=768, depth=12, num_heads=12, mlp_dim=3072),
    "quickstart": dict(dim=64, depth=4, num_heads=4, mlp_dim=128),
}


def linear(
    din: int, dout: int, dtype: Any, param_dtype: Any, rngs: nnx.Rngs, *, use_bias: bool = True
) -> nnx.Linear:
  """A Linear with timm's N(0, 0.02) kernel init (shared by the ViT and Swin backbones)."""
  return nnx.Linear(
      din,
      dout,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=_LINEAR_INIT,
      rngs=rngs,
  )


def layer_norm(
    dim: int, dtype: Any, param_dtype: Any, rngs: nnx.Rngs, *, epsilon: float = _LAYER_NORM_EPS
) -> nnx.LayerNorm:
  return nnx.LayerNorm(dim, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def patch_conv(
    patch_size: int, dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs
) -> nnx.Conv:
  """Non-overlapping patch projection, a conv with stride = patch size (PyTorch's init)."""
  return nnx.Conv(
      3,
      dim,
      kernel_size=(patch_size, patch_size),
      strides=(patch_size, patch_size),
      padding="VALID",
      kernel_init=_CONV_INIT,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
  )


class PatchEmbed(nnx.Module):
  """Non-overlapping patches -> tokens, via a conv with stride = patch size."""

  def __init__(self, patch_size: int, dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    self.proj = patch_conv(patch_size, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """[B, H, W, 3] -> [B, (H / p) * (W / p), D], patches in row-major order."""
    x = self.proj(images)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
  """softmax(q k^T / sqrt(Dh) + bias) v for q, k, v [B, N, H, Dh], logits and softmax in float32.

  Lowered for a GPU, bf16/fp16 attention without a bias runs cuDNN's fused kernel, which never
  writes the [B, H, N, N] logits to memory; elsewhere, or where jax finds no cuDNN at trace time
  (a CPU or TPU host), XLA's. `implementation=None` is XLA in jax 0.10-0.12, hence the switch.
  """
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias)
  # jax checks the head dim only when differentiating, which `jax.checkpoint` defers past the
  # `except` below: check it here (<= 128 and a multiple of 8 before Hopper).
  head_dim = q.shape[-1]
  cudnn_shapes = q.dtype in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
  if bias is not None or not cudnn_shapes:
    return xla(q, k, v)
  try:
    return jax.lax.platform_dependent(q, k, v, cuda=_cudnn_attention, default=xla)
  except RuntimeError:  # jax found no cuDNN library ("cuDNN not found" / "not detected").
    spmd.report_fallback(
        "attention",
        "XLA's attention, jax found no cuDNN library: a GPU step compiled here writes the "
        "[B, H, N, N] logits that cuDNN's fused kernel would not",
    )
    return xla(q, k, v)


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """cuDNN's fused attention; its training kernel refuses odd lengths (ViT's 197 tokens), so an odd
  sequence gets one padding token, masked out of the keys by their length, its row dropped."""
  seq_len = q.shape[1]
  if seq_len % 2 == 0:
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  q, k, v = (jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0))) for t in (q, k, v))
  lengths = jnp.full((q.shape[0],), seq_len, jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")
  return out[:, :seq_len]


class Attention(nnx.Module):
  """Multi-head self-attention with a fused qkv projection (timm layout)."""

  def __init__(
      self,
      dim: int,
      num_heads: int,
      *,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
  ):
    if dim % num_heads:
      raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
    self.num_heads = num_heads
    self.head_dim = dim // num_heads
    self.qkv = linear(dim, 3 * dim, dtype, param_dtype, rngs)
    self.proj = linear(dim, dim, dtype, param_dtype, rngs)
    self.proj_drop = nnx.Dropout(dropout_rate)

  def logits_bias(self, mask: Any, batch: int) -> jax.Array | None:
    """A float32 bias added to the logits, broadcastable to [batch, heads, N, N] (none here; Swin's
    windows have one)."""
    del mask, batch
    return None

  def __call__(
      self, x: jax.Array, mask: Any = None, *, train: bool, rngs: nnx.Rngs | None
  ) -> jax.Array:
    batch, seq_len, dim = x.shape
    # timm splits the fused output as (3, heads, head_dim); keep that order so
    # converted checkpoints need no permutation.
    qkv = self.qkv(x).reshape(batch, seq_len, 3, self.num_heads, self.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, N, H, Dh]
    out = dot_product_attention(q, k, v, self.logits_bias(mask, batch))
    out = out.reshape(batch, seq_len, dim)
    return self.proj_drop(self.proj(out), deterministic=not train, rngs=rngs)


class Mlp(nnx.Module):
  """Dense ViT feed-forward: fc1 -> GELU -> fc2."""

  def __init__(
      self,
      dim: int,
      hidden_dim: int,
      *,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
  ):
    self.fc1 = linear(dim, hidden_dim, dtype, param_dtype, rngs)
    self.fc2 = linear(hidden_dim, dim, dtype, param_dtype, rngs)
    self.drop = nnx.Dropout(dropout_rate)

  def __call__(self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
    h = jax.nn.gelu(self.fc1(x), approximate=False)
    h = self.drop(h, deterministic=not train, rngs=rngs)
    return self.drop(self.fc2(h), deterministic=not train, rngs=rngs)


class CheckpointedBlock:
  """What the ViT and Swin blocks share: the feed-forward (dense or a `SparseMoE`), and `__call__`,
  the block's `forward` under `trainkit.remat.checkpointed` in training when `remat` is set."""

  remat: str

  def init_mlp(self, dim, mlp_dim, moe, dropout_rate, dtype, param_dtype, rngs) -> None:
    self.is_moe = moe is not None
    if moe is not None:
      self.mlp = SparseMoE(dim, mlp_dim, **moe, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    else:
      self.mlp = Mlp(
          dim, mlp_dim, dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs
      )
    # The MoE has no internal dropout; the block applies it to the MoE output.
    self.mlp_drop = nnx.Dropout(dropout_rate)

  def feed_forward(
      self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Any
  ) -> tuple[jax.Array, MoEAux | None]:
    """Tokens [B, N, D] (normalised) -> (the MLP's output, the MoE's aux or None)."""
    if self.is_moe:
      y, aux = self.mlp(x, train=train, rngs=rngs, context=context)
      return self.mlp_drop(y, deterministic=not train, rngs=rngs), aux
    return self.mlp(x, train=train, rngs=rngs), None

  def __call__(
      self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Context = None
  ) -> tuple[jax.Array, MoEAux | None]:
    if train and self.remat != "none":  # An evaluation has no backward pass to save memory for.
      forward = lambda block, x, rngs, context: block.forward(
          x, train=True, rngs=rngs, context=context
      )
      return checkpointed(forward, self.remat)(self, x, rngs, context)
    return self.forward(x, train=train, rngs=rngs, context=context)


class Block(CheckpointedBlock, nnx.Module):
  """Pre-norm transformer block; the MLP is dense or a `SparseMoE`."""

  def __init__(
      self,
      dim: int,
      num_heads: int,
      mlp_dim: int,
      *,
      moe: Mapping[str, Any] | None,
      dropout_rate: float,
      dtype: Any,
      param_dtype: Any,
      rngs: nnx.Rngs,
      remat: str = "none",
  ):
    self.remat = check_remat(remat)
    self.norm1 = layer_norm(dim, dtype, param_dtype, rngs)
    self.attn = Attention(
        dim, num_heads, dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.norm2 = layer_norm(dim, dtype, param_dtype, rngs)
    self.init_mlp(dim, mlp_dim, moe, dropout_rate, dtype, param_dtype, rngs)

  def forward(
      self, x: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Context = None
  ) -> tuple[jax.Array, MoEAux | None]:
    """The block without rematerialisation (what `__call__` checkpoints)."""
    x = x + self.attn(self.norm1(x), train=train, rngs=rngs)
    y, aux = self.feed_forward(self.norm2(x), train=train, rngs=rngs, context=context)
    # Tokens dropped by the MoE get y = 0 and pass through on the residual.
    return x + y.astype(x.dtype), aux


class VisionTransformer(BackboneClassifier):
  """ViT / DeiT classifier whose `moe_blocks` use a sparse-MoE feed-forward.

  Args:
    image_size: input height = width (must be divisible by patch_size).
    mlp_dim: hidden width of the MLP and of each expert.
    moe_blocks: indices of blocks whose MLP is a `SparseMoE` (negative from the end; empty
      gives a plain ViT). Default: the last block, as in FairSMoE.
    moe: keyword arguments of `SparseMoE` after (dim, hidden_dim), shared by all MoE blocks,
      e.g. dict(num_experts=4, top_k=2); None gives a plain ViT.
    dropout_rate: after the position embedding, the attention projection and in the MLPs.
    dtype: compute dtype (e.g. jnp.bfloat16); logits are returned in float32.
    remat: a `trainkit.remat.REMAT_POLICIES` name for each block in training.
  """

  def __init__(
      self,
      *,
      num_classes: int,
      image_size: int,
      patch_size: int,
      dim: int,
      depth: int,
      num_heads: int,
      mlp_dim: int,
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
    moe_set = self._set_moe_blocks(moe_blocks, moe, depth)
    self.num_classes = num_classes
    self.image_size = image_size
    self.patch_size = patch_size
    self.dim = dim
    self.num_features = dim
    self.dropout_rate = dropout_rate
    self.dtype = dtype
    num_patches = (image_size // patch_size) ** 2

    self.patch_embed = PatchEmbed(patch_size, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.cls_token = nnx.Param(
        nnx.initializers.normal(stddev=1e-6)(rngs.params(), (1, 1, dim), param_dtype)
    )
    self.pos_embed = nnx.Param(_LINEAR_INIT(rngs.params(), (1, num_patches + 1, dim), param_dtype))
    self.pos_drop = nnx.Dropout(dropout_rate)
    self.blocks = nnx.List(
        [
            Block(
                dim,
                num_heads,
                mlp_dim,
                moe=moe if i in moe_set else None,
                dropout_rate=dropout_rate,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
                remat=remat,
            )
            for i in range(depth)
        ]
    )
    self.norm = layer_norm(dim, dtype, param_dtype, rngs)
    self.head = linear(dim, num_classes, dtype, param_dtype, rngs)

  def _encode(
      self, images: jax.Array, *, train: bool, rngs: nnx.Rngs | None, context: Context
  ) -> tuple[jax.Array, MoEAux]:
    """[B, H, W, 3] -> (final-norm class-token feature [B, dim], merged MoEAux)."""
    self._check_rngs(train, rngs)
    x = self.patch_embed(images.astype(self.dtype))
    cls = jnp.broadcast_to(self.cls_token[...].astype(self.dtype), (x.shape[0], 1, self.dim))
    x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...].astype(self.dtype)
    x = self.pos_drop(x, deterministic=not train, rngs=rngs)
    auxes: dict[str, MoEAux] = {}
    for i, block in enumerate(self.blocks):
      x, aux = block(x, train=train, rngs=rngs, context=context)
      if aux is not None:
        auxes[f"moe_block{i}"] = aux
    return self.norm(x)[:, 0], MoEAux.merge(auxes)

  def classify(self, feats: jax.Array, *, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
    del train, rngs
    return self.head(feats).astype(jnp.float32)
