"""Tests for fairmoe_jax.models.swin: the Swin Transformer backbone with MoE blocks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_vit import attention_reference

from fairmoe_jax.models import SWIN_PRESETS, SwinTransformer
from fairmoe_jax.models.swin import (
    PatchMerging,
    SwinBlock,
    relative_position_index,
    shifted_window_mask,
    window_partition,
    window_reverse,
)
from fairmoe_jax.models.vit import Mlp, dot_product_attention
from fairmoe_jax.moe import SparseMoE

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

# 32 px, patch 4: stage 0 at 8x8 (four 4x4 windows, second block shifted),
# stage 1 at 4x4 (a single window, no shift). Four blocks in all.
TINY = dict(
    num_classes=3,
    image_size=32,
    patch_size=4,
    embed_dim=16,
    depths=(2, 2),
    num_heads=(2, 4),
    window_size=4,
    moe=dict(num_experts=4, top_k=2),
)


def _images(batch: int = 2, seed: int = 0, size: int = 32) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)


@functools.partial(jax.jit, static_argnames="train")
def _apply(model: SwinTransformer, images: jax.Array, train: bool = False):
  return model(images, train=train)


def _blocks(model: SwinTransformer) -> list[SwinBlock]:
  return [b for stage in model.layers for b in stage.blocks]


def _np(x) -> np.ndarray:
  return np.asarray(x[...], np.float64)


def test_shapes_and_default_moe_in_last_block():
  model = SwinTransformer(**TINY, rngs=nnx.Rngs(0))
  assert model.moe_blocks == (3,)
  blocks = _blocks(model)
  assert [isinstance(b.mlp, SparseMoE) for b in blocks] == [False, False, False, True]
  assert [(b.window, b.shift) for b in blocks] == [(4, 0), (4, 2), (4, 0), (4, 0)]

  logits, aux = _apply(model, _images())
  assert logits.shape == (2, 3) and logits.dtype == jnp.float32
  assert aux.loss.shape == aux.z_loss.shape == ()
  assert {k.split("/")[0] for k in aux.metrics} == {"moe_block3"}
  assert aux.metrics["moe_block3/example_expert_fraction"].shape == (2, 4)


def test_moe_blocks_index_the_flattened_blocks():
  model = SwinTransformer(**TINY, moe_blocks=(0, -2), rngs=nnx.Rngs(0))
  assert model.moe_blocks == (0, 2)
  assert [isinstance(b.mlp, SparseMoE) for b in _blocks(model)] == [True, False, True, False]
  # Experts have the stage's MLP width: 4 * 16 in stage 0, 4 * 32 in stage 1.
  assert model.layers[0].blocks[0].mlp.w1.shape == (4, 16, 64)
  assert model.layers[1].blocks[0].mlp.w1.shape == (4, 32, 128)

  plain = SwinTransformer(**{**TINY, "moe": None}, rngs=nnx.Rngs(0))
  assert all(isinstance(b.mlp, Mlp) for b in _blocks(plain)) and plain.moe_blocks == ()
  (logits, aux), feats = jax.jit(lambda m, x: (m(x, train=False), m.features(x, train=False)))(
      plain, _images()
  )
  assert float(aux.loss) == 0.0 and aux.metrics == {}
  # The pooled pre-head feature, width embed_dim * 2 ** (stages - 1); the head maps it to logits.
  assert feats.shape == (2, 32)
  np.testing.assert_allclose(
      logits, feats @ plain.head.fc.kernel[...] + plain.head.fc.bias[...], rtol=1e-5, atol=1e-6
  )
  with pytest.raises(ValueError, match="out of range"):
    SwinTransformer(**TINY, moe_blocks=(4,), rngs=nnx.Rngs(0))


def test_timm_parameter_names():
  model = SwinTransformer(**TINY, rngs=nnx.Rngs(0))
  names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  for name in (
      "patch_embed.proj.kernel",
      "patch_embed.norm.scale",
      "layers.0.blocks.0.norm1.scale",
      "layers.0.blocks.1.attn.qkv.kernel",
      "layers.0.blocks.1.attn.proj.bias",
      "layers.0.blocks.1.attn.relative_position_bias_table",
      "layers.0.blocks.1.mlp.fc1.kernel",
      "layers.0.blocks.1.mlp.fc2.bias",
      "layers.1.downsample.norm.scale",
      "layers.1.downsample.reduction.kernel",
      "layers.1.blocks.1.mlp.w1",
      "layers.1.blocks.1.mlp.router.gate.kernel",
      "norm.bias",
      "head.fc.kernel",
  ):
    assert name in names, name
  # Patch merging at the start of stages > 0 (timm >= 0.9), bias-free reduction;
  # the relative position index is a constant, not state.
  assert not any(n.startswith("layers.0.downsample") for n in names)
  assert "layers.1.downsample.reduction.bias" not in names
  assert not any("relative_position_index" in n for n in names)
  assert model.layers[0].blocks[0].attn.relative_position_bias_table.shape == (7 * 7, 2)


def test_presets_match_timm_parameter_counts():
  assert set(SWIN_PRESETS) == {"swin_small", "swin_base", "swin_tiny_cpu"}

  def count(preset: str, image_size: int = 224) -> int:
    model = nnx.eval_shape(
        lambda: SwinTransformer(
            num_classes=1000, image_size=image_size, **SWIN_PRESETS[preset], rngs=nnx.Rngs(0)
        )
    )
    # From the shapes: optax's tree_size calls jnp.size, deprecated on an abstract leaf.
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))

  # timm's swin_small_patch4_window7_224 / swin_base_patch4_window7_224.
  assert count("swin_small") == 49_606_258
  assert count("swin_base") == 87_768_224
  assert count("swin_tiny_cpu", 64) < 3_000_000


def test_window_partition_and_reverse():
  x = np.random.default_rng(0).normal(size=(2, 8, 12, 3)).astype(np.float32)
  windows = np.asarray(window_partition(jnp.asarray(x), 4))
  assert windows.shape == (2 * 2 * 3, 4, 4, 3)
  # Windows are row-major per image: window (b, r, c) sits at index b * 6 + r * 3 + c.
  np.testing.assert_array_equal(windows[1 * 6 + 1 * 3 + 2], x[1, 4:8, 8:12])
  np.testing.assert_array_equal(np.asarray(window_reverse(jnp.asarray(windows), 4, 8, 12)), x)


def test_patch_merging_matches_numpy():
  merge = PatchMerging(3, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  merge.norm.scale[...] = jnp.asarray(rng.normal(size=12), jnp.float32)
  merge.norm.bias[...] = jnp.asarray(rng.normal(size=12), jnp.float32)
  x = rng.normal(size=(2, 4, 6, 3)).astype(np.float32)
  # timm's order: x0 = (even row, even col), x1 = (odd, even), x2 = (even, odd), x3 = (odd, odd).
  cat = np.concatenate(
      [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], axis=-1
  ).astype(np.float64)
  mean, var = cat.mean(-1, keepdims=True), cat.var(-1, keepdims=True)
  normed = (cat - mean) / np.sqrt(var + 1e-5) * _np(merge.norm.scale) + _np(merge.norm.bias)
  expected = normed @ _np(merge.reduction.kernel)
  out = merge(jnp.asarray(x))
  assert out.shape == (2, 2, 3, 6)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_relative_position_index_matches_offsets():
  w = 3
  index = relative_position_index(w)
  coords = [(i, j) for i in range(w) for j in range(w)]
  for a, (ya, xa) in enumerate(coords):
    for b, (yb, xb) in enumerate(coords):
      assert index[a, b] == (ya - yb + w - 1) * (2 * w - 1) + (xa - xb + w - 1)


def _allowed_reference(size: int, window: int, shift: int) -> np.ndarray:
  """[size^2, size^2] bool: may token p (original row-major position) attend to q?

  Independent of timm's region labelling: after the cyclic shift by -shift,
  tokens attend within their window, but not across the wrap-around seam
  (shifted coordinate >= size - shift came from the other side of the image).
  """
  pos = np.array([(a, b) for a in range(size) for b in range(size)])
  shifted = (pos - shift) % size
  window_id = shifted[:, 0] // window * size + shifted[:, 1] // window
  wrapped = shifted >= size - shift
  same = lambda v: v[:, None] == v[None, :]
  return same(window_id) & same(wrapped[:, 0]) & same(wrapped[:, 1])


def test_shifted_window_mask_against_reference():
  size, window, shift = 8, 4, 2
  mask = shifted_window_mask(size, size, window, shift)
  assert mask.shape == (4, 16, 16) and set(np.unique(mask)) == {0.0, -100.0}
  allowed = _allowed_reference(size, window, shift)
  # Mask entries of window k are for the tokens of window k of the shifted map.
  shifted_pos = np.arange(size * size).reshape(1, size, size, 1)
  orig_of_shifted = np.roll(shifted_pos, (-shift, -shift), axis=(1, 2))  # shifted -> original id
  ids = np.asarray(window_partition(orig_of_shifted, window)).reshape(4, 16)
  for k in range(4):
    np.testing.assert_array_equal(mask[k] == 0, allowed[np.ix_(ids[k], ids[k])])


def test_shifted_attention_only_mixes_allowed_tokens():
  model = SwinTransformer(**{**TINY, "moe": None}, rngs=nnx.Rngs(0))
  block = model.layers[0].blocks[1]
  assert (block.window, block.shift) == (4, 2)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(1, 8, 8, 16)), jnp.float32)
  probe = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  attend = jax.jit(lambda x: block.attention(x, train=False, rngs=None))
  base = attend(x)
  # Perturb each token q in turn (one batched call): outputs change exactly where allowed.
  xs = jnp.broadcast_to(x, (64, 8, 8, 16)).reshape(64, 64, 16)
  xs = xs.at[jnp.arange(64), jnp.arange(64)].add(probe).reshape(64, 8, 8, 16)
  changed = np.abs(np.asarray(attend(xs) - base)).reshape(64, 64, 16).max(-1) > 1e-6  # [q, p]
  np.testing.assert_array_equal(changed.T, _allowed_reference(8, 4, 2))


def _numpy_attention(x: np.ndarray, attn, bias: np.ndarray | None) -> np.ndarray:
  """Plain multi-head attention over all tokens of x [N, C] with the module's weights."""
  n, c = x.shape
  heads = attn.num_heads
  qkv = x @ _np(attn.qkv.kernel) + _np(attn.qkv.bias)
  q, k, v = qkv.reshape(n, 3, heads, c // heads).transpose(1, 2, 0, 3)  # [H, N, Dh] each
  logits = q @ k.transpose(0, 2, 1) / np.sqrt(c // heads)
  if bias is not None:
    logits = logits + bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = (probs @ v).transpose(1, 0, 2).reshape(n, c)
  return out @ _np(attn.proj.kernel) + _np(attn.proj.bias)


def test_single_window_block_equals_plain_attention():
  model = SwinTransformer(**{**TINY, "moe": None}, rngs=nnx.Rngs(0))
  block = model.layers[1].blocks[1]  # 4x4 map, one window; odd block but no shift (res <= window)
  assert (block.resolution, block.window, block.shift) == (4, 4, 0)
  attn = block.attn
  x = np.random.default_rng(3).normal(size=(1, 4, 4, 32)).astype(np.float32)
  # nnx.jit takes the block as an argument, so the second call sees the new table.
  attend = lambda x: nnx.jit(lambda b, x: b.attention(x, train=False, rngs=None))(block, x)

  attn.relative_position_bias_table[...] = jnp.zeros_like(attn.relative_position_bias_table[...])
  out = np.asarray(attend(jnp.asarray(x))).reshape(16, 32)
  np.testing.assert_allclose(out, _numpy_attention(x.reshape(16, 32), attn, None), atol=1e-5)

  # A random table adds table[offset(p, q)] per head, offsets from the token coordinates.
  table = np.random.default_rng(4).normal(size=(49, 4)).astype(np.float32)
  attn.relative_position_bias_table[...] = jnp.asarray(table)
  coords = np.array([(i, j) for i in range(4) for j in range(4)])
  rel = coords[:, None] - coords[None, :] + 3
  bias = table[rel[..., 0] * 7 + rel[..., 1]].transpose(2, 0, 1)  # [H, N, N]
  out = np.asarray(attend(jnp.asarray(x))).reshape(16, 32)
  np.testing.assert_allclose(out, _numpy_attention(x.reshape(16, 32), attn, bias), atol=1e-5)


def test_shifted_window_bias_matches_float64_reference():
  # Two 8x8 maps, four shifted 4x4 windows each: the bias of window row i is the table's entry
  # for each token offset plus the mask of window i % 4 (the windows of one image, then the next).
  block = SwinTransformer(**{**TINY, "moe": None}, rngs=nnx.Rngs(0)).layers[0].blocks[1]
  attn = block.attn
  rng = np.random.default_rng(5)
  attn.relative_position_bias_table[...] = jnp.asarray(rng.normal(size=(49, 2)), jnp.float32)
  mask = shifted_window_mask(8, 8, 4, 2)
  q, k, v = (jnp.asarray(rng.normal(size=(8, 16, 2, 8)), jnp.float32) for _ in range(3))
  out = nnx.jit(lambda a, q, k, v: dot_product_attention(q, k, v, a.logits_bias(mask, 8)))(
      attn, q, k, v
  )
  table = _np(attn.relative_position_bias_table)
  coords = np.array([(i, j) for i in range(4) for j in range(4)])
  rel = coords[:, None] - coords[None, :] + 3
  position = table[rel[..., 0] * 7 + rel[..., 1]].transpose(2, 0, 1)  # [H, N, N]
  bias = np.stack([position + mask[i % 4] for i in range(8)])
  expected, bound = attention_reference(q, k, v, bias, eps=float(jnp.finfo(jnp.float32).eps))
  np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - expected), bound)


def test_dropout_needs_rngs_when_training():
  model = SwinTransformer(**TINY, dropout_rate=0.5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rngs"):
    model(_images(), train=True)


def test_train_step_decreases_loss():
  model = SwinTransformer(**TINY, rngs=nnx.Rngs(0))
  moe = model.layers[1].blocks[1].mlp
  w1_before = np.asarray(moe.w1[...])
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=1e-4), wrt=nnx.Param)
  images = _images(batch=4, seed=1)
  labels = jnp.array([0, 1, 2, 1])

  @nnx.jit
  def train_step(model, optimizer, images, labels):
    def loss_fn(model):
      logits, aux = model(images, train=True)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return ce + 0.01 * aux.loss + 1e-3 * aux.z_loss, ce

    (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return ce

  losses = [float(train_step(model, optimizer, images, labels)) for _ in range(6)]
  assert losses[-1] < 0.8 * losses[0], losses
  assert not np.allclose(moe.w1[...], w1_before)


def test_bfloat16_compute_keeps_float32_params():
  model = SwinTransformer(**TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  logits, aux = _apply(model, _images())
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  assert aux.loss.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  ref, _ = _apply(SwinTransformer(**TINY, rngs=nnx.Rngs(0)), _images())
  np.testing.assert_allclose(logits, ref, atol=0.1)
