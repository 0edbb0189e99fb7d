"""The fairmoe train step on meshes of 8 fake CPU devices: same losses as on one device."""

import json
import re
import subprocess

import flax.nnx as nnx
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import train
from fairmoe_jax.methods import METHODS
from trainkit.mesh import make_mesh
from trainkit.metric_writers import read_metrics
from trainkit.optim import make_optimizer
from trainkit.train_state import create_train_state


def _tiny_config(data: int, expert: int, dtype: str = "float32", method: str = "smoe"):
  config = fairmoe_config.base_config()
  config.method = method
  config.data.update(train_size=256, val_size=32, test_size=64, num_threads=0)
  config.model.update(dim=32, depth=2, num_heads=2, mlp_dim=64)
  config.moe.num_experts = 8
  config.update(
      batch_size=32,
      eval_batch_size=32,
      num_train_steps=4,
      log_every_steps=1,
      eval_every_steps=0,
      checkpoint_every_steps=0,
      compute_dtype=dtype,
      analysis_batches=0,  # The gradient-cosine analysis and the plots are not what these
      plots=False,  # tests compare.
  )
  config.mesh.update(data=data, expert=expert)
  fairmoe_config.validate(config, num_devices=jax.device_count())
  return config


def _train_losses(config, workdir) -> np.ndarray:
  train.train_and_evaluate(config, str(workdir))
  return np.array([m["loss"] for m in read_metrics(str(workdir))])


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
  return _train_losses(_tiny_config(1, 1), tmp_path_factory.mktemp("single"))


@pytest.mark.slow
@pytest.mark.parametrize("data,expert", [(2, 4), (4, 2)])
def test_sharded_training_matches_one_device(tmp_path, single_device_losses, data, expert):
  losses = _train_losses(_tiny_config(data, expert), tmp_path)
  assert len(losses) == 4
  np.testing.assert_allclose(losses, single_device_losses, rtol=2e-5)


@pytest.mark.slow
def test_fairsmoe_on_an_expert_parallel_mesh_matches_one_device(tmp_path):
  # The fairness-guided router, its losses and the attributes travelling to it under shard_map.
  single = _train_losses(_tiny_config(1, 1, method="fairsmoe"), tmp_path / "single")
  sharded = _train_losses(_tiny_config(2, 4, method="fairsmoe"), tmp_path / "sharded")
  np.testing.assert_allclose(sharded, single, rtol=2e-5)


def test_expert_weights_are_sharded_over_the_expert_axis():
  config = _tiny_config(2, 4)
  mesh = make_mesh(config.mesh)
  info, _ = train.load_data(config)
  tx = make_optimizer(config.optimizer, config.num_train_steps)
  build = lambda: METHODS[config.method].build_model(config, info, nnx.Rngs(0), None)
  _, state = create_train_state(build, tx, mesh, 0)
  moe = state.params["blocks"][1]["mlp"]
  expert_sharded = NamedSharding(mesh, P("expert", None, None))
  assert moe["w1"].sharding.is_equivalent_to(expert_sharded, 3)
  assert moe["w1"].addressable_shards[0].data.shape == (2, 32, 64)  # 8 experts over 4 shards.
  assert state.params["blocks"][0]["mlp"]["fc1"]["kernel"].sharding.spec == P()
  # Adam's moments follow their parameters' sharding.
  adam = next(
      s
      for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
      if hasattr(s, "mu")
  )
  mu = adam.mu["blocks"][1]["mlp"]["w1"]
  assert mu.sharding.is_equivalent_to(expert_sharded, 3)


def _ample_capacity_config(dispatch: str):
  config = _tiny_config(1, 1)
  # Capacity suffices for every token, so all algorithms compute the same function.
  config.moe.update(dispatch=dispatch, capacity_factor=8.0)
  return config


@pytest.fixture(scope="module")
def einsum_losses(tmp_path_factory):
  return _train_losses(_ample_capacity_config("einsum"), tmp_path_factory.mktemp("einsum"))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dense", "sort", "dropless", "einsum_fused"])
def test_every_dispatch_algorithm_trains_like_einsum(tmp_path, einsum_losses, dispatch):
  losses = _train_losses(_ample_capacity_config(dispatch), tmp_path)
  np.testing.assert_allclose(losses, einsum_losses, rtol=2e-5)
  if dispatch == "einsum_fused":  # XLA's MLP on the CPU: said, and kept in run_info.json
    # (the step sees no mesh on this 8-device process, so its per-group form says "no mesh: ").
    fallbacks = json.loads((tmp_path / "run_info.json").read_text())["fallbacks"]
    assert any(re.match(r"einsum_fused on cpu: (no mesh: )?XLA's MLP", f) for f in fallbacks)


@pytest.mark.slow
def test_bfloat16_compute_trains_with_float32_parameters(tmp_path):
  losses = _train_losses(_tiny_config(1, 1, "bfloat16"), tmp_path)
  assert np.all(np.isfinite(losses))


def test_local_launcher_dry_run_prints_the_command(repo_root):
  result = subprocess.run(
      [
          "bash",
          str(repo_root / "launch/local.sh"),
          "--dry-run",
          "configs/quickstart.py",
          "/tmp/wd",
          "--config.batch_size=64",
      ],
      capture_output=True,
      text=True,
  )
  assert result.returncode == 0
  assert (
      "will run: python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/wd "
      "--config.batch_size=64"
  ) in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "router,batch_priority", [("noisy_topk", False), ("expert_choice", False), ("topk", True)]
)
def test_every_router_trains_in_the_jitted_step(
    tmp_path, single_device_losses, router, batch_priority
):
  config = _tiny_config(1, 1)
  config.moe.update(router=router, batch_priority=batch_priority)
  losses = _train_losses(config, tmp_path)
  assert len(losses) == 4 and np.all(np.isfinite(losses))
  # Same data and initial weights as the top-k run: the router changes the computation.
  assert not np.allclose(losses, single_device_losses)
