"""Every method of paper Tables 1-2 trains in the jitted step; FEM changes the expert
assignment between steps without recompiling."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import numpy as np
import pytest

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import methods, train
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.moe.fair_router import FairRouter
from trainkit.mesh import make_mesh, shard_batch
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.train_state import jit_train_step, make_train_step


def _config(method: str, backbone: str = "vit", image_size: int = 16):
  config = fairmoe_config.base_config()
  config.method = method
  config.model.backbone = backbone
  config.data.update(train_size=64, val_size=32, test_size=32, num_threads=0, image_size=image_size)
  config.model.update(dim=16, depth=2, num_heads=2, mlp_dim=32)
  config.update(batch_size=16, eval_batch_size=16, num_train_steps=4)
  config.muffin.pretrain_fraction = 0.5
  fairmoe_config.validate(config, num_devices=jax.device_count())
  return config


def _setup(config):
  mesh = make_mesh({"data": 1, "expert": 1})
  info, splits = train.load_data(config)
  tx = make_optimizer(config.optimizer, config.num_train_steps)
  graphdef, state = train.create_state(config, info, tx, mesh)
  schedule = learning_rate_schedule(config.optimizer, config.num_train_steps)
  step = jit_train_step(
      make_train_step(graphdef, train.make_loss_fn(config, info), tx, schedule), state, mesh
  )
  batch = {
      "image": np.asarray(splits["train"]["image"][:16], np.float32) / 127.5 - 1,
      "label": splits["train"]["label"][:16],
      "attributes": splits["train"]["attributes"][:16],
      "mask": np.ones(16, np.float32),
  }
  return mesh, info, graphdef, state, step, shard_batch(batch, mesh)


@pytest.mark.parametrize(
    "method,backbone",
    [(m, "vit") for m in sorted(methods.METHODS)] + [("fairsmoe", "swin_tiny_cpu")],
)
def test_every_method_trains_in_the_jitted_step(method, backbone):
  config = _config(method, backbone, image_size=32 if backbone.startswith("swin") else 16)
  mesh, info, graphdef, state, step, batch = _setup(config)
  model = nnx.merge(graphdef, state.params, state.model_state)
  has_fair_router = any(isinstance(n, FairRouter) for _, n in nnx.iter_graph(model))
  assert has_fair_router == methods.METHODS[method].fair_router
  assert isinstance(model, Muffin) == (method == "muffin")
  losses, phases = [], []
  for _ in range(4):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    phases.append(float(metrics.get("muffin_phase", 0)))
  assert np.all(np.isfinite(losses)), losses
  if method == "muffin":
    assert phases == [1.0, 1.0, 2.0, 2.0]  # Backbones first, then the fusion head.
  if method == "vanilla_smoe":
    assert "moe_aux_loss" not in metrics and "specialization" not in metrics
  if method == "fairsmoe":
    assert {"confusion", "attribute_ce", "specialization", "fairness_surrogate"} <= set(metrics)


def test_expert_management_changes_the_assignment_without_recompiling():
  config = _config("fairsmoe")
  config.fair.patience = 1
  mesh, info, graphdef, state, step, batch = _setup(config)
  state, _ = step(state, batch)
  compiled = step._cache_size()
  manage = train.make_expert_manager(config, info, graphdef, mesh)

  def scalars(sf, loss):
    values = {f"val/{n}/pqd": sf for n in info.attribute_names}
    return dict(values, **{"val/loss": loss})

  def assignment(state):
    model = nnx.merge(graphdef, state.params, state.model_state)
    return next(
        np.asarray(n.assignment[...]) for _, n in nnx.iter_graph(model) if isinstance(n, FairRouter)
    )

  before = assignment(state)
  state, _ = manage(state, scalars(0.5, 1.0))  # Baseline.
  state, logged = manage(state, scalars(0.6, 0.9))  # Improved: sex (2 groups) grows.
  after = assignment(state)
  assert logged["fem/experts_per_class/sex"] == 2
  assert after.sum() > before.sum()
  state, metrics = step(state, batch)
  state, metrics = step(state, batch)
  assert step._cache_size() == compiled  # New assignment, same compiled step.
  assert np.isfinite(float(metrics["loss"]))
  np.testing.assert_array_equal(np.asarray(state.extra["fem"]["counts"])[0], 2)


@pytest.mark.parametrize("method", ["fairsmoe", "muffin"])
def test_pretrained_checkpoint_initialises_every_backbone(tmp_path, method):
  from fairmoe_jax.models.convert_timm import export_timm_state_dict

  config = _config(method)
  info, _ = train.load_data(config)
  # A "timm checkpoint" of the plain backbone, exported from a differently seeded model.
  plain = _config("vanilla_smoe")
  plain.moe.blocks = ()
  source = train.build_model(plain, info, nnx.Rngs(7))
  path = tmp_path / "backbone.npz"
  np.savez(path, **export_timm_state_dict(source))
  config.model.pretrained = str(path)
  model = train.build_model(config, info, nnx.Rngs(0))
  backbones = model.backbones if method == "muffin" else [model]
  for backbone in backbones:
    np.testing.assert_array_equal(backbone.pos_embed[...], source.pos_embed[...])
    np.testing.assert_array_equal(
        backbone.blocks[0].attn.qkv.kernel[...], source.blocks[0].attn.qkv.kernel[...]
    )
  if method == "fairsmoe":  # The MoE experts are upcycled from the dense MLP of their block.
    moe = model.blocks[-1].mlp
    for e in range(moe.num_experts):
      np.testing.assert_array_equal(moe.w1[...][e], source.blocks[-1].mlp.fc1.kernel[...])
