"""Tests for fairmoe_jax.models.vit: the ViT / DeiT backbone with MoE blocks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fairmoe_jax.models import VIT_PRESETS, VisionTransformer
from fairmoe_jax.models import vit as vit_module
from fairmoe_jax.models.vit import Mlp, dot_product_attention
from fairmoe_jax.moe import SparseMoE


def num_params(module: nnx.Module) -> int:
  # From the shapes: optax's tree_size calls jnp.size, deprecated on an abstract (eval_shape) leaf.
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


TINY = dict(
    num_classes=3,
    image_size=8,
    patch_size=4,
    dim=16,
    depth=2,
    num_heads=2,
    mlp_dim=32,
    moe=dict(num_experts=4, top_k=2),
)


def _images(batch: int = 2, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 8, 8, 3)), jnp.float32)


@functools.partial(jax.jit, static_argnames="train")
def _apply(model: VisionTransformer, images: jax.Array, train: bool = False):
  return model(images, train=train)


def test_shapes_and_default_moe_in_last_block():
  model = VisionTransformer(**TINY, rngs=nnx.Rngs(0))
  assert model.moe_blocks == (1,)
  assert isinstance(model.blocks[0].mlp, Mlp)
  assert isinstance(model.blocks[1].mlp, SparseMoE)

  (logits, aux), feats = jax.jit(lambda m, x: (m(x, train=False), m.features(x, train=False)))(
      model, _images()
  )
  assert logits.shape == (2, 3) and logits.dtype == jnp.float32
  assert feats.shape == (2, 16)
  assert aux.loss.shape == aux.z_loss.shape == ()
  assert set(aux.metrics) == {
      f"moe_block1/{k}"
      for k in (
          "fraction_dropped",
          "tokens_per_expert",
          "example_expert_fraction",
          "example_gate_weight",
          "router_entropy",
          "importance",
      )
  }
  assert aux.metrics["moe_block1/example_expert_fraction"].shape == (2, 4)
  # Per example, the gate weight given to each expert, summed over experts, is the mean total
  # gate of a token (top-k probabilities are not renormalised): between 0 and 1.
  weight = np.asarray(aux.metrics["moe_block1/example_gate_weight"])
  assert weight.shape == (2, 4) and np.all(weight >= 0) and np.all(weight.sum(-1) <= 1 + 1e-5)


def test_plain_vit_and_multiple_moe_blocks():
  plain = VisionTransformer(**TINY, moe_blocks=(), rngs=nnx.Rngs(0))
  assert all(isinstance(b.mlp, Mlp) for b in plain.blocks)
  _, aux = _apply(plain, _images())
  assert float(aux.loss) == 0.0 and float(aux.z_loss) == 0.0 and aux.metrics == {}

  both = VisionTransformer(**TINY, moe_blocks=(0, -1), rngs=nnx.Rngs(0))
  assert both.moe_blocks == (0, 1)
  assert all(isinstance(b.mlp, SparseMoE) for b in both.blocks)
  # Four experts replace one MLP: three extra MLPs plus a bias-free router.
  extra = num_params(both.blocks[1].mlp) - num_params(plain.blocks[1].mlp)
  assert extra == 3 * num_params(plain.blocks[1].mlp) + 16 * 4


def test_timm_parameter_names():
  model = VisionTransformer(**TINY, rngs=nnx.Rngs(0))
  names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  for name in (
      "patch_embed.proj.kernel",
      "cls_token",
      "pos_embed",
      "blocks.0.norm1.scale",
      "blocks.0.attn.qkv.kernel",
      "blocks.0.attn.proj.kernel",
      "blocks.0.norm2.bias",
      "blocks.0.mlp.fc1.kernel",
      "blocks.0.mlp.fc2.bias",
      "blocks.1.mlp.w1",
      "blocks.1.mlp.router.gate.kernel",
      "norm.scale",
      "head.kernel",
  ):
    assert name in names, name
  assert model.pos_embed.shape == (1, 1 + (8 // 4) ** 2, 16)


def test_same_seed_same_params():
  leaves = lambda seed: jax.tree.leaves(
      nnx.state(VisionTransformer(**TINY, rngs=nnx.Rngs(seed)), nnx.Param)
  )
  for a, b in zip(leaves(0), leaves(0)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(0), leaves(1)))


def test_bfloat16_compute():
  model = VisionTransformer(**TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  logits, aux = _apply(model, _images())
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  assert aux.loss.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def attention_reference(q, k, v, bias=None, *, eps: float) -> tuple[np.ndarray, np.ndarray]:
  """The attention the backbones computed before `dot_product_attention`, in float64 from the
  (rounded) inputs q, k, v [B, N, H, Dh] and bias [.., H, N, N], and a bound on each output's
  error when its probabilities and output are rounded with `eps`.

  The output is a convex combination of v's rows: an error d in the logits moves it by at most
  2 d sum_j p_j |v_j| (d: Dh float32 roundings, Dh eps32 scale max(|q| |k|^T)); rounding the
  probabilities and the output adds eps / 2 of sum_j p_j |v_j| each.
  """
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  scale = q.shape[-1] ** -0.5
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  magnitude = np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.abs(k)).max() * scale
  logits_error = q.shape[-1] * np.finfo(np.float32).eps * magnitude
  spread = np.einsum("bhqk,bkhd->bqhd", probs, np.abs(v))
  return np.einsum("bhqk,bkhd->bqhd", probs, v), (2 * logits_error + eps) * spread


@pytest.mark.float32_reference
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_matches_float64_reference(dtype):
  # DeiT's 197 tokens (odd: cuDNN's path pads them) and head dim 64, at a small batch.
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 197, 3, 64)), dtype) for _ in range(3))
  out = jax.jit(dot_product_attention)(q, k, v)
  assert out.shape == q.shape and out.dtype == dtype
  expected, bound = attention_reference(q, k, v, eps=float(jnp.finfo(dtype).eps))
  np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - expected), bound)


def test_attention_without_cudnn_says_so_once(monkeypatch):
  """Where jax finds no cuDNN library at trace time, XLA's attention runs and the run says so
  once (`run_info.json`'s fallbacks): a GPU preflight compiled here is not cuDNN's step."""

  def no_cudnn(q, k, v):
    raise RuntimeError("cuDNN not found")

  monkeypatch.setattr(vit_module, "_cudnn_attention", no_cudnn)
  monkeypatch.setattr(vit_module.spmd, "FALLBACKS", [])
  q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  for _ in range(2):
    out = jax.jit(dot_product_attention)(q, q, q)
  np.testing.assert_array_equal(out, jax.nn.dot_product_attention(q, q, q))
  (line,) = vit_module.spmd.FALLBACKS
  assert line.startswith(f"attention on {jax.default_backend()}: XLA's attention"), line


@pytest.mark.compile_gpu
def test_gpu_compile_runs_deit_attention_in_cudnn():
  # pylint: disable=import-outside-toplevel
  from trainkit.mesh import make_mesh
  from trainkit.preflight.compile import compile_step, persistent_cache_off
  from trainkit.preflight.targets import devices, get_target

  target = get_target("h200x1")
  mesh = make_mesh({"data": 1, "expert": 1}, list(devices(target)))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  q = jax.ShapeDtypeStruct((8, 197, 6, 64), jnp.bfloat16, sharding=sharding)
  try:  # jax asks the cuDNN library for its version when tracing, whatever the target.
    jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"), q, q, q)
  except RuntimeError as e:
    pytest.skip(f"no cuDNN library on this host ({e})")
  loss = lambda q, k, v: dot_product_attention(q, k, v).astype(jnp.float32).sum()
  with persistent_cache_off():  # A deviceless executable cannot be loaded back from it.
    compiled, _ = compile_step(jax.jit(jax.grad(loss, (0, 1, 2))), (q, q, q), mesh, target)
  text = compiled.as_text()
  assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text


def test_dropout_uses_rngs_only_when_training():
  # A dense and an MoE block: every dropout site, with few compiled ops.
  model = VisionTransformer(**TINY, dropout_rate=0.5, rngs=nnx.Rngs(0))
  images = _images()

  @nnx.jit  # one compilation for the three calls
  def run(model, images, rngs):
    train = [model(images, train=True, rngs=rngs)[0] for _ in range(2)]
    return *train, model(images, train=False)[0]  # eval needs no rngs

  train_a, train_b, eval_ = run(model, images, nnx.Rngs(dropout=1))
  assert not np.allclose(train_a, train_b)  # a fresh mask per call
  assert not np.allclose(train_a, eval_)
  with pytest.raises(ValueError, match="rngs"):
    model(images, train=True)


def test_train_step_decreases_loss():
  model = VisionTransformer(**TINY, rngs=nnx.Rngs(0))
  w1_before = np.asarray(model.blocks[1].mlp.w1[...])
  gate_before = np.asarray(model.blocks[1].mlp.router.gate.kernel[...])
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
  # The experts and the router received gradient updates.
  assert not np.allclose(model.blocks[1].mlp.w1[...], w1_before)
  assert not np.allclose(model.blocks[1].mlp.router.gate.kernel[...], gate_before)


def test_presets():
  assert VIT_PRESETS["deit_small"] == dict(dim=384, depth=12, num_heads=6, mlp_dim=1536)
  assert set(VIT_PRESETS) == {"deit_tiny", "deit_small", "deit_base", "quickstart"}
  # DeiT-Tiny without MoE has the well-known ~5.7M parameters (1000 classes, 224px).
  abstract = nnx.eval_shape(
      lambda: VisionTransformer(
          num_classes=1000,
          image_size=224,
          patch_size=16,
          moe_blocks=(),
          **VIT_PRESETS["deit_tiny"],
          rngs=nnx.Rngs(0),
      )
  )
  assert num_params(abstract) == 5_717_416
