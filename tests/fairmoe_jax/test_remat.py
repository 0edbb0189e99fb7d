"""`model.remat` (trainkit/remat.py): each policy trains the same model with less kept memory.

For every model family (ViT with an MoE block, Swin with an MoE block, the Causal Transformer's
pair classifier and its encoder-decoder), each policy gives the loss and gradients of no remat,
and changes the program: fewer bytes kept for the backward pass, more FLOPs recomputed, and
(on an H100 described to the GPU compiler) fewer temporaries. The MoE layer is checked on
meshes too, where it runs inside `shard_map` with FairSMoE's router and its losses.

Tolerance. A checkpoint recomputes the forward pass of a block from the same inputs with the
same operations, so the values are the same up to how XLA fuses the recomputation: a fusion
that differs from the original forward pass's may sum a float32 reduction in another order,
which moves it by at most about n * eps relative for n terms (eps = 2**-23 = 1.2e-7). The
largest reductions here have 64 terms (the attention over 64 tokens, a width of 32 or 64), so
one reordered reduction moves a value by at most 64 * 1.2e-7 = 7.6e-6 relative; a gradient
passes through a few of them. GRAD_RTOL = 2e-5 covers that bound; the differences seen are
1.6e-7 to 3.1e-7 (a rounding or two). Gradient entries near zero get an absolute tolerance of
the same relative size on the model's largest gradient entry, as their relative error is
unbounded: a gradient that cancels to zero (an attention key bias's) is rounding noise of the
terms it sums.
"""

from __future__ import annotations

import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_attn_jax import config as causal_config
from causal_attn_jax import models as causal_models
from causal_attn_jax import train as causal_train
from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import train as fairmoe_train
from fairmoe_jax.models import VisionTransformer
from fairmoe_jax.models.swin import SwinTransformer
from trainkit.errors import ConfigError
from trainkit.mesh import make_mesh, shard_batch
from trainkit.optim import make_optimizer
from trainkit.remat import MOST_AGGRESSIVE_REMAT, REMAT_CHOICES, checkpointed

GRAD_RTOL = 2e-5
LOSS_RTOL = 2e-6  # The loss is one value: a reordered reduction or two, 2 * 64 * eps / 8.
POLICIES = [p for p in REMAT_CHOICES if p != "none"]
VOCAB = 24


def _images(batch: int, size: int) -> jax.Array:
  return jnp.asarray(np.random.default_rng(0).normal(size=(batch, size, size, 3)), jnp.float32)


def _vision_loss(model, batch, rngs):
  logits, aux = model(batch["image"], train=True, rngs=rngs)
  # The MoE's auxiliary losses join the loss so that their gradients are checked too.
  return (logits**2).mean() + aux.loss + aux.z_loss, aux.metrics


def _vit(remat: str):
  # Dropout on: the recomputation must draw the forward pass's masks.
  return VisionTransformer(
      num_classes=3,
      image_size=16,
      patch_size=4,
      dim=32,
      depth=2,
      num_heads=2,
      mlp_dim=64,
      moe=dict(num_experts=4, top_k=2),
      dropout_rate=0.1,
      rngs=nnx.Rngs(0),
      remat=remat,
  )


def _swin(remat: str):
  # One stage of a plain and a shifted-window block (4x4 windows of an 8x8 map), the MoE last.
  return SwinTransformer(
      num_classes=3,
      image_size=32,
      patch_size=4,
      embed_dim=32,
      depths=(2,),
      num_heads=(2,),
      window_size=4,
      moe=dict(num_experts=4, top_k=2),
      dropout_rate=0.1,
      rngs=nnx.Rngs(0),
      remat=remat,
  )


def _causal_config(task: str, remat: str):
  config = causal_config.base_config()
  config.task = task
  config.model.update(
      attention="causal",
      dim=32,
      num_layers=1,
      num_decoder_layers=1,
      num_heads=2,
      mlp_dim=64,
      dropout_rate=0.1,
      remat=remat,
  )
  config.data.update(max_len=16, max_source_len=12, max_target_len=12)
  config.nmt.max_decode_len = 12
  return config


def _causal_loss(config):
  # The task loss and the Markov-blanket Lagrangian, which reads each layer's attention.
  loss_fn = causal_train.make_loss_fn(config)
  extra = causal_train.initial_extra(config)
  extra = dict(extra, multipliers=jnp.ones_like(extra["multipliers"]))

  def loss(model, batch, rngs):
    value, metrics = loss_fn(model, batch, rngs.dropout(), jnp.int32(0), extra)
    return value, {k: v for k, v in metrics.items() if not k.startswith("_")}

  return loss


def _pair(remat: str):
  config = _causal_config("classification", remat)
  spec = causal_models.TransformerSpec.from_config(config.model, max_len=16)
  return causal_models.PairClassifier(VOCAB, 3, spec, rngs=nnx.Rngs(0))


def _seq2seq(remat: str):
  config = _causal_config("translation", remat)
  spec = causal_models.TransformerSpec.from_config(config.model, max_len=13)
  return causal_models.Seq2Seq(VOCAB, spec, rngs=nnx.Rngs(0))


def _pair_batch():
  rng = np.random.default_rng(1)
  ids = rng.integers(5, VOCAB, size=(8, 16)).astype(np.int32)
  ids[:, 0] = 2
  ids[:, 12:] = 0  # Padding.
  segments = np.where(ids > 0, 1 + (np.arange(16) >= 6), 0).astype(np.int32)
  return {"ids": ids, "segment_ids": segments, "label": rng.integers(0, 3, 8).astype(np.int32)}


def _translation_batch():
  rng = np.random.default_rng(2)
  src = rng.integers(5, VOCAB, size=(8, 12)).astype(np.int32)
  tgt = rng.integers(5, VOCAB, size=(8, 13)).astype(np.int32)
  src[:, 10:] = 0
  tgt[:, 11:] = 0
  return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


# family -> (make_model(remat), loss(model, batch, rngs) -> (loss, metrics), batch)
FAMILIES = {
    "vit": (_vit, _vision_loss, lambda: {"image": _images(32, 16)}),
    "swin": (_swin, _vision_loss, lambda: {"image": _images(16, 32)}),
    "pair_classifier": (_pair, _causal_loss(_causal_config("classification", "none")), _pair_batch),
    "seq2seq": (_seq2seq, _causal_loss(_causal_config("translation", "none")), _translation_batch),
}


def _split(family: str, remat: str):
  make, loss, batch = FAMILIES[family]
  graphdef, params, rest = nnx.split(make(remat), nnx.Param, ...)

  def objective(params, batch, key):
    model = nnx.merge(graphdef, params, rest)
    return loss(model, batch, nnx.Rngs(dropout=key))

  return objective, params, {k: jnp.asarray(v) for k, v in batch().items()}


@functools.lru_cache(maxsize=None)
def _train_step(family: str, remat: str):
  """(loss, metrics, gradients) of one step, and the FLOPs of its compiled program."""
  objective, params, batch = _split(family, remat)
  key = jax.random.key(1)
  step = jax.jit(jax.value_and_grad(objective, has_aux=True))
  compiled = step.lower(params, batch, key).compile()
  cost = compiled.cost_analysis()
  flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
  (loss, metrics), grads = compiled(params, batch, key)
  return jax.device_get((loss, metrics, grads)), flops


def _assert_same_gradients(grads, reference):
  # Absolute tolerance on the largest gradient entry of the model: an entry that cancels to
  # (near) zero, such as an attention key bias's (softmax ignores a shift shared by a row),
  # holds only the rounding of terms of that size.
  scale = max(float(np.max(np.abs(r))) for r in jax.tree.leaves(reference))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference)):
    np.testing.assert_allclose(
        g, r, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_policy_gives_the_loss_and_gradients_of_no_remat(family, policy):
  (loss, metrics, grads), _ = _train_step(family, policy)
  (ref_loss, ref_metrics, ref_grads), _ = _train_step(family, "none")
  np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
  assert set(metrics) == set(ref_metrics)  # Router metrics and constraint statistics pass out.
  for name in metrics:
    np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=GRAD_RTOL, err_msg=name)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  _assert_same_gradients(grads, ref_grads)


def _kept_bytes(family: str, remat: str) -> int:
  """Bytes the backward pass keeps: the residuals `jax.vjp` closes over (parameters included),
  traced, not computed."""
  objective, params, batch = _split(family, remat)

  def backward(params):
    return jax.vjp(lambda p: objective(p, batch, jax.random.key(1))[0], params)[1]

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(backward, params)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_policy_keeps_less_and_recomputes_more(family):
  # Fails if a policy were ignored: the same residuals, the same compiled FLOPs as no remat.
  kept = [_kept_bytes(family, p) for p in REMAT_CHOICES]
  flops = [_train_step(family, p)[1] for p in REMAT_CHOICES]
  assert kept == sorted(kept, reverse=True) and len(set(kept)) == len(kept), dict(
      zip(REMAT_CHOICES, kept)
  )
  assert flops == sorted(flops) and len(set(flops)) == len(flops), dict(zip(REMAT_CHOICES, flops))


def _has_checkpoint(jaxpr) -> bool:
  """Whether a jaxpr, or one nested in it, holds a checkpoint (its primitive is named "remat2"
  in jax 0.10, "checkpoint" in some other versions)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("remat2", "checkpoint"):
      return True
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)  # A ClosedJaxpr's jaxpr, or a Jaxpr.
      if hasattr(inner, "eqns") and _has_checkpoint(inner):
        return True
  return False


def test_evaluation_and_no_remat_trace_no_checkpoint():
  images = _images(2, 16)

  def checkpoints(remat: str, train: bool) -> bool:
    graphdef, state = nnx.split(_vit(remat))

    def apply(state, images):
      return nnx.merge(graphdef, state)(images, train=train, rngs=nnx.Rngs(dropout=0))[0]

    return _has_checkpoint(jax.make_jaxpr(apply)(state, images).jaxpr)

  assert checkpoints(MOST_AGGRESSIVE_REMAT, train=True)
  assert not checkpoints(MOST_AGGRESSIVE_REMAT, train=False)  # No backward pass to save for.
  assert not checkpoints("none", train=True)  # The program of a model without the option.


def test_an_unknown_policy_is_refused():
  with pytest.raises(ValueError, match="remat='all'; known: none, dots, block"):
    _vit("all")
  with pytest.raises(ValueError, match="known: none, dots, block"):
    checkpointed(lambda m: m, "everything")


@pytest.mark.parametrize("package", ["fairmoe_jax", "causal_attn_jax"])
def test_the_config_key_is_checked_naming_it_and_the_choices(package):
  module = fairmoe_config if package == "fairmoe_jax" else causal_config
  config = module.base_config()
  assert config.model.remat == "none"
  config.model.remat = "all"
  with pytest.raises(ConfigError) as e:
    module.validate(config, num_devices=8, check_data=False)
  assert e.value.key == "model.remat"
  assert "'none', 'dots', 'block'" in str(e.value) and "'all'" in str(e.value)


def _fairsmoe_loss_and_grads(remat: str, data: int, expert: int):
  config = fairmoe_config.base_config()
  config.method = "fairsmoe"
  config.data.update(train_size=64, val_size=16, test_size=16, num_threads=0, image_size=16)
  config.model.update(dim=16, depth=1, num_heads=2, mlp_dim=32, remat=remat)  # The MoE block.
  config.moe.num_experts = 8
  config.update(batch_size=16, eval_batch_size=16, num_train_steps=2)
  config.mesh.update(data=data, expert=expert)
  fairmoe_config.validate(config, num_devices=jax.device_count())
  mesh = make_mesh(config.mesh)
  info, splits = fairmoe_train.load_data(config)
  tx = make_optimizer(config.optimizer, config.num_train_steps)
  graphdef, state = fairmoe_train.create_state(config, info, tx, mesh)
  loss_fn = fairmoe_train.make_loss_fn(config, info)
  train = splits["train"]
  batch = shard_batch(
      {
          "image": np.asarray(train["image"][:16], np.float32) / 127.5 - 1,
          "label": train["label"][:16],
          "attributes": train["attributes"][:16],
          "mask": np.ones(16, np.float32),
      },
      mesh,
  )

  def objective(params):
    model = nnx.merge(graphdef, params, state.model_state)
    return loss_fn(model, batch, jax.random.key(3), state.step, state.extra)

  with jax.set_mesh(mesh):
    (loss, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state.params)
  return jax.device_get((loss, metrics, grads))


@pytest.mark.slow
@pytest.mark.parametrize("data,expert", [(8, 1), (4, 2)], ids=["data_parallel", "expert_parallel"])
def test_fairsmoe_on_a_mesh_gives_the_loss_and_gradients_of_no_remat(data, expert):
  # The MoE layer inside shard_map (all_to_all when expert-parallel), FGR's context and its
  # losses (confusion, attribute_ce, the competence pass's specialization), all checkpointed.
  loss, metrics, grads = _fairsmoe_loss_and_grads(MOST_AGGRESSIVE_REMAT, data, expert)
  ref_loss, ref_metrics, ref_grads = _fairsmoe_loss_and_grads("none", data, expert)
  np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
  assert {"loss/confusion", "loss/specialization"} <= set(metrics) == set(ref_metrics)
  for name in metrics:
    np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=GRAD_RTOL, err_msg=name)
  _assert_same_gradients(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.compile_gpu
def test_the_gpu_compiler_keeps_fewer_temporaries_with_each_policy():
  # pylint: disable=import-outside-toplevel
  from trainkit.preflight.compile import persistent_cache_off
  from trainkit.preflight.targets import devices, get_target

  target = get_target("h100x1")
  mesh = make_mesh({"data": 1, "expert": 1}, list(devices(target)))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  temporaries = {}
  for policy in REMAT_CHOICES:
    objective, params, _ = _split("vit", policy)
    images = jax.ShapeDtypeStruct((128, 16, 16, 3), jnp.float32, sharding=sharding)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params
    )
    grad = jax.jit(
        jax.grad(lambda p, images: objective(p, {"image": images}, jax.random.key(1))[0])
    )
    # cuBLAS GEMMs: the policies are compared under one compiler, which then compiles no candidate
    # Triton tilings per dot to find one that compiles (it cannot time them without a GPU). From a
    # cold cache, CPU-s: 25.5 against 32.5 on the pinned stack, 38.5 against 50 on the newest.
    with jax.set_mesh(mesh), persistent_cache_off():  # A deviceless executable: not cached.
      compiled = grad.lower(params, images).compile({"xla_gpu_enable_triton_gemm": False})
    temporaries[policy] = compiled.memory_analysis().temp_size_in_bytes
  values = [temporaries[p] for p in REMAT_CHOICES]
  assert values == sorted(values, reverse=True) and len(set(values)) == 3, temporaries
