"""Tests for fairmoe_jax.models.convert_timm: timm state dicts <-> our ViT and Swin."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf

from fairmoe_jax.models import (
    SwinTransformer,
    VisionTransformer,
    export_timm_state_dict,
    load_timm_checkpoint,
)
from fairmoe_jax.models.convert_timm import (
    resample_pos_embed,
    resample_relative_position_bias_table,
)
from trainkit.errors import UserError

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

VIT = dict(
    num_classes=3,
    image_size=8,
    patch_size=4,
    dim=16,
    depth=2,
    num_heads=2,
    mlp_dim=32,
    moe=dict(num_experts=4, top_k=2),
)
# 32 px, patch 4: stage 0 at 8x8 with a shifted second block, stage 1 at 4x4.
SWIN = dict(
    num_classes=3,
    image_size=32,
    patch_size=4,
    embed_dim=16,
    depths=(2, 2),
    num_heads=(2, 4),
    window_size=4,
    moe=dict(num_experts=4, top_k=2),
)
BUILDERS = {"vit": lambda seed, **kw: VisionTransformer(**{**VIT, **kw}, rngs=nnx.Rngs(seed))}
BUILDERS["swin"] = lambda seed, **kw: SwinTransformer(**{**SWIN, **kw}, rngs=nnx.Rngs(seed))


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return {".".join(map(str, p)): np.asarray(v[...]) for p, v in flat}


def _randomize(model: nnx.Module, seed: int = 0) -> None:
  """Random values everywhere (inits hold zeros and ones that would hide layout mix-ups)."""
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    var[...] = jnp.asarray(rng.normal(size=var.shape), var.dtype)


def _save(state: dict[str, np.ndarray], path) -> str:
  path = str(path)
  if path.endswith(".npz"):
    np.savez(path, **state)
  else:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file(state, path)
  return path


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
@pytest.mark.parametrize("kind", ["vit", "swin"])
def test_export_load_round_trip(kind, fmt, tmp_path):
  model_a = BUILDERS[kind](0)
  _randomize(model_a)
  state = export_timm_state_dict(model_a)
  head = "head.weight" if kind == "vit" else "head.fc.weight"
  moe = "blocks.1.mlp" if kind == "vit" else "layers.1.blocks.1.mlp"
  assert state[head].shape == (3, 16 if kind == "vit" else 32)  # [out, in]
  hidden, dim = (32, 16) if kind == "vit" else (128, 32)
  assert state[f"{moe}.experts.fc1.weight"].shape == (4, hidden, dim)
  assert state[f"{moe}.router.gate.weight"].shape == (4, dim)
  path = _save(state, tmp_path / f"ckpt.{fmt}")

  model_b = BUILDERS[kind](1)
  assert load_timm_checkpoint(model_b, path, skip=()) == []
  a, b = _params(model_a), _params(model_b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)

  # Default skip=("head",): the classifier keeps its init, the rest is loaded.
  model_c = BUILDERS[kind](1)
  init = _params(model_c)
  notes = load_timm_checkpoint(model_c, path)
  assert any(n.startswith("kept at init") and head in n for n in notes), notes
  for name, value in _params(model_c).items():
    np.testing.assert_array_equal(value, (init if name.startswith("head") else a)[name], name)


def test_missing_and_misshapen_tensors_raise_one_error(tmp_path):
  model = BUILDERS["vit"](0)
  state = export_timm_state_dict(model)
  del state["blocks.0.attn.qkv.weight"]
  state["norm.weight"] = np.ones(17, np.float32)
  path = _save(state, tmp_path / "bad.npz")
  before = _params(model)
  with pytest.raises(UserError) as info:
    load_timm_checkpoint(model, path)
  message = str(info.value)
  assert path in message and "blocks.0.attn.qkv.weight" in message
  assert "norm.weight (expected (16,), found (17,))" in message
  # Nothing was written.
  for name, value in _params(model).items():
    np.testing.assert_array_equal(value, before[name])

  with pytest.raises(UserError, match="does not exist"):
    load_timm_checkpoint(model, str(tmp_path / "absent.npz"))
  (tmp_path / "x.pt").write_bytes(b"")
  with pytest.raises(UserError, match="unknown format"):
    load_timm_checkpoint(model, str(tmp_path / "x.pt"))


def _timm_vit_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A dense timm ViT state dict for `VIT`, written by hand in PyTorch layouts."""
  d, h, c = 16, 32, 3
  r = lambda *shape: rng.normal(size=shape).astype(np.float32)
  state = {
      "patch_embed.proj.weight": r(d, 3, 4, 4),  # OIHW
      "patch_embed.proj.bias": r(d),
      "cls_token": r(1, 1, d),
      "pos_embed": r(1, 5, d),
      "norm.weight": r(d),
      "norm.bias": r(d),
      "head.weight": r(c, d),  # [out, in]
      "head.bias": r(c),
  }
  for i in range(2):
    for name, shape in (
        ("norm1.weight", (d,)),
        ("norm1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)),
        ("attn.proj.bias", (d,)),
        ("norm2.weight", (d,)),
        ("norm2.bias", (d,)),
        ("mlp.fc1.weight", (h, d)),
        ("mlp.fc1.bias", (h,)),
        ("mlp.fc2.weight", (d, h)),
        ("mlp.fc2.bias", (d,)),
    ):
      state[f"blocks.{i}.{name}"] = r(*shape)
  return state


def test_hand_written_timm_dict_gives_numpy_layers_and_upcycled_experts(tmp_path):
  rng = np.random.default_rng(0)
  state = _timm_vit_state(rng)
  state["blocks.0.attn.relative_position_index"] = np.zeros(3, np.int64)  # a buffer: ignored
  state["head_dist.weight"] = np.zeros((3, 16), np.float32)  # unused: reported
  path = _save(state, tmp_path / "deit.npz")
  model = BUILDERS["vit"](0)
  router_before = np.asarray(model.blocks[1].mlp.router.gate.kernel[...])
  notes = load_timm_checkpoint(model, path, skip=())
  assert "unused checkpoint tensors: head_dist.weight" in notes
  assert any("blocks.1.mlp: experts upcycled" in n for n in notes), notes
  assert not any("relative_position_index" in n for n in notes)

  # Conv: out[b, i, j, o] = sum_{c, y, x} W[o, c, y, x] * img[b, 4i + y, 4j + x, c] + bias[o].
  images = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
  patches = images.reshape(2, 2, 4, 2, 4, 3)  # [b, i, y, j, x, c]
  expected = np.einsum("biyjxc,ocyx->bijo", patches, state["patch_embed.proj.weight"])
  expected += state["patch_embed.proj.bias"]
  np.testing.assert_allclose(
      model.patch_embed.proj(jnp.asarray(images)), expected, rtol=1e-5, atol=1e-5
  )
  # Linear: y = x W^T + b.
  feats = rng.normal(size=(2, 16)).astype(np.float32)
  np.testing.assert_allclose(
      model.head(jnp.asarray(feats)),
      feats @ state["head.weight"].T + state["head.bias"],
      rtol=1e-5,
      atol=1e-5,
  )
  # Fused qkv keeps timm's order; every expert of the MoE block is the dense MLP.
  np.testing.assert_array_equal(
      model.blocks[0].attn.qkv.kernel[...], state["blocks.0.attn.qkv.weight"].T
  )
  moe = model.blocks[1].mlp
  for e in range(4):
    np.testing.assert_array_equal(moe.w1[e], state["blocks.1.mlp.fc1.weight"].T)
    np.testing.assert_array_equal(moe.b1[e], state["blocks.1.mlp.fc1.bias"])
    np.testing.assert_array_equal(moe.w2[e], state["blocks.1.mlp.fc2.weight"].T)
    np.testing.assert_array_equal(moe.b2[e], state["blocks.1.mlp.fc2.bias"])
  np.testing.assert_array_equal(moe.router.gate.kernel[...], router_before)

  # Without upcycling the experts must be in the checkpoint, or skipped.
  with pytest.raises(UserError, match=re.escape("blocks.1.mlp.experts.fc1.weight")):
    load_timm_checkpoint(BUILDERS["vit"](0), path, upcycle_moe=False)
  fresh = BUILDERS["vit"](0)
  w1 = np.asarray(fresh.blocks[1].mlp.w1[...])
  load_timm_checkpoint(fresh, path, skip=("head", "blocks.1.mlp"), upcycle_moe=False)
  np.testing.assert_array_equal(fresh.blocks[1].mlp.w1[...], w1)
  np.testing.assert_array_equal(fresh.blocks[0].mlp.fc1.bias[...], state["blocks.0.mlp.fc1.bias"])


def _torch_bilinear(x: np.ndarray, size: int) -> np.ndarray:
  """[h, w, C] -> [size, size, C]: F.interpolate(mode="bilinear", align_corners=False)."""

  def axis_weights(n_in: int) -> np.ndarray:
    src = np.maximum((np.arange(size) + 0.5) * n_in / size - 0.5, 0.0)
    lo = np.floor(src).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    m = np.zeros((size, n_in))
    np.add.at(m, (np.arange(size), lo), 1 - (src - lo))
    np.add.at(m, (np.arange(size), hi), src - lo)
    return m

  return np.einsum("ih,jw,hwc->ijc", axis_weights(x.shape[0]), axis_weights(x.shape[1]), x)


def test_pos_embed_resampling(tmp_path):
  pos = np.random.default_rng(0).normal(size=(1, 1 + 16, 5)).astype(np.float32)
  np.testing.assert_array_equal(resample_pos_embed(pos, 17), pos)
  for grid in (6, 3):  # up and down
    out = resample_pos_embed(pos, 1 + grid * grid)
    assert out.shape == (1, 1 + grid * grid, 5)
    np.testing.assert_array_equal(out[:, 0], pos[:, 0])  # class token kept
    expected = _torch_bilinear(pos[0, 1:].reshape(4, 4, 5).astype(np.float64), grid)
    np.testing.assert_allclose(out[0, 1:], expected.reshape(-1, 5), rtol=1e-5, atol=1e-6)

  # Through the loader: a 2x2-grid checkpoint into a 3x3-grid model.
  source = BUILDERS["vit"](0)
  _randomize(source)
  path = _save(export_timm_state_dict(source), tmp_path / "vit.npz")
  bigger = BUILDERS["vit"](1, image_size=12)
  notes = load_timm_checkpoint(bigger, path)
  assert any(n.startswith("pos_embed: resampled from (1, 5, 16)") for n in notes), notes
  np.testing.assert_array_equal(bigger.pos_embed[0, 0], source.pos_embed[0, 0])


def test_relative_position_bias_table_resampling(tmp_path):
  table = np.random.default_rng(0).normal(size=(49, 3)).astype(np.float32)
  np.testing.assert_array_equal(resample_relative_position_bias_table(table, 4), table)
  out = resample_relative_position_bias_table(table, 2)
  expected = _torch_bilinear(table.reshape(7, 7, 3).astype(np.float64), 3).reshape(9, 3)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)

  source = BUILDERS["swin"](0)
  path = _save(export_timm_state_dict(source), tmp_path / "swin.npz")
  small_window = BUILDERS["swin"](1, window_size=2)
  notes = load_timm_checkpoint(small_window, path)
  name = "layers.0.blocks.0.attn.relative_position_bias_table"
  assert any(n.startswith(f"{name}: resampled from (49, 2) to (9, 2)") for n in notes), notes
  # Stage 1 (4x4 map) now has 2x2 windows too: its tables shrink as well.
  assert small_window.layers[1].blocks[0].attn.relative_position_bias_table.shape == (9, 4)


# --- A numpy transcription of timm's Swin forward, run on a timm state dict. -------------


def _ln(x, state, name, eps=1e-5):
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * state[f"{name}.weight"] + state[f"{name}.bias"]


def _lin(x, state, name):
  y = x @ state[f"{name}.weight"].T
  return y + state[f"{name}.bias"] if f"{name}.bias" in state else y


def _partition(x, ws):
  b, h, w, c = x.shape
  x = x.reshape(b, h // ws, ws, w // ws, ws, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, c)


def _timm_block(x, state, name, heads, ws, shift):
  b, h, w, c = x.shape
  shortcut, x = x, _ln(x, state, f"{name}.norm1")
  if shift:
    x = np.roll(x, (-shift, -shift), axis=(1, 2))
  windows = _partition(x, ws).reshape(-1, ws * ws, c)
  n = ws * ws
  qkv = _lin(windows, state, f"{name}.attn.qkv").reshape(-1, n, 3, heads, c // heads)
  q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # [B_, heads, N, Dh]
  attn = (q * (c // heads) ** -0.5) @ k.transpose(0, 1, 3, 2)
  # get_relative_position_index, as timm writes it.
  coords = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
  rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (ws - 1)
  index = rel[..., 0] * (2 * ws - 1) + rel[..., 1]
  table = state[f"{name}.attn.relative_position_bias_table"]
  attn = attn + table[index.reshape(-1)].reshape(n, n, heads).transpose(2, 0, 1)[None]
  if shift:  # timm's img_mask with slices
    img_mask = np.zeros((1, h, w, 1))
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
      for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        img_mask[:, hs, wsl, :] = cnt
        cnt += 1
    mw = _partition(img_mask, ws).reshape(-1, n)
    mask = np.where(mw[:, None, :] - mw[:, :, None] != 0, -100.0, 0.0)
    nw = mask.shape[0]
    attn = (attn.reshape(-1, nw, heads, n, n) + mask[None, :, None]).reshape(-1, heads, n, n)
  attn = np.exp(attn - attn.max(-1, keepdims=True))
  attn /= attn.sum(-1, keepdims=True)
  out = _lin((attn @ v).transpose(0, 2, 1, 3).reshape(-1, n, c), state, f"{name}.attn.proj")
  out = out.reshape(-1, h // ws, w // ws, ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
  if shift:
    out = np.roll(out, (shift, shift), axis=(1, 2))
  x = shortcut + out
  hid = _lin(_ln(x, state, f"{name}.norm2"), state, f"{name}.mlp.fc1")
  hid = 0.5 * hid * (1 + erf(hid / np.sqrt(2)))
  return x + _lin(hid, state, f"{name}.mlp.fc2")


def _timm_swin_forward(state, images, depths, heads, window):
  w = state["patch_embed.proj.weight"]  # OIHW
  p = w.shape[-1]
  b, size = images.shape[0], images.shape[1] // p
  patches = images.reshape(b, size, p, size, p, 3)
  x = np.einsum("biyjxc,ocyx->bijo", patches, w) + state["patch_embed.proj.bias"]
  x = _ln(x, state, "patch_embed.norm")
  for i, depth in enumerate(depths):
    if i > 0:  # timm 0.6's explicit PatchMerging
      x0, x1, x2, x3 = x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]
      x = _lin(
          _ln(np.concatenate([x0, x1, x2, x3], -1), state, f"layers.{i}.downsample.norm"),
          state,
          f"layers.{i}.downsample.reduction",
      )
    res = x.shape[1]
    ws = min(res, window)
    for j in range(depth):
      shift = ws // 2 if j % 2 and res > window else 0
      x = _timm_block(x, state, f"layers.{i}.blocks.{j}", heads[i], ws, shift)
  x = _ln(x, state, "norm").mean(axis=(1, 2))
  return _lin(x, state, "head.fc")


def test_swin_forward_matches_numpy_transcription_of_timm(tmp_path):
  """A timm-style Swin state dict gives the logits of timm's forward, written in numpy."""
  source = BUILDERS["swin"](0, moe=None)
  _randomize(source, seed=3)
  # Scale the random weights down so activations stay O(1) through the blocks.
  state = {k: (v * 0.3).astype(np.float32) for k, v in export_timm_state_dict(source).items()}
  model = BUILDERS["swin"](1, moe=None)
  load_timm_checkpoint(model, _save(state, tmp_path / "swin.safetensors"), skip=())
  images = np.random.default_rng(5).normal(size=(2, 32, 32, 3))
  logits, _ = jax.jit(lambda m, x: m(x, train=False))(model, jnp.asarray(images, jnp.float32))
  state64 = {k: v.astype(np.float64) for k, v in state.items()}
  expected = _timm_swin_forward(state64, images, SWIN["depths"], SWIN["num_heads"], 4)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
