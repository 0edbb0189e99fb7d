"""The MoE-layer benchmark compares like with like: every row, vmoe's own dispatchers included,
computes the same layer (same loss value and gradients) when nothing is dropped."""

from __future__ import annotations

import os
import sys

import chex
import jax
import numpy as np
import pytest

from conftest import REPO_ROOT

ROOT = str(REPO_ROOT)
PEER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "vmoe")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import moe_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _value_and_grads(dispatch: str, num_experts: int, capacity_factor: float, peer=None):
  row, compiled, args = moe_layer.compile_case(
      "tiny", num_experts, 2, dispatch, "float32", capacity_factor, peer=peer
  )
  (value, _), grads = compiled(*args)
  return row, float(value), grads


@pytest.mark.slow
@pytest.mark.parametrize("num_experts", [4, 8])
def test_every_row_computes_the_same_layer_without_drops(num_experts):
  peer = moe_layer.import_peer_vmoe(PEER) if os.path.isdir(PEER) else None
  names = ["einsum", "sort", "sort_blocks", "blocksparse", "dropless", moe_layer.REFERENCE]
  if peer is not None:
    names += list(moe_layer.PEER_ROWS)
  # Capacity factor E / k gives C = S: no expert can overflow, so every algorithm serves all.
  results = {n: _value_and_grads(n, num_experts, num_experts / 2, peer) for n in names}
  _, value_ref, grads_ref = results["einsum"]
  assert results["einsum"][0]["capacity"] == 10
  for name, (_, value, grads) in results.items():
    np.testing.assert_allclose(value, value_ref, rtol=1e-5, err_msg=name)
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not os.path.isdir(PEER), reason="../shared/peers/vmoe is not beside the repo")
def test_vmoe_rows_drop_what_ours_drop_under_capacity():
  peer = moe_layer.import_peer_vmoe(PEER)
  # Capacity 2 of 10 tokens x 2 choices over 4 experts: many choices are dropped, and vmoe's
  # priority (all top-1 choices first, earlier tokens first) is ours, so the layers agree.
  values = {
      n: _value_and_grads(n, 4, 0.4, peer)[1] for n in ("einsum", "sort", *moe_layer.PEER_ROWS)
  }
  for name, value in values.items():
    np.testing.assert_allclose(value, values["einsum"], rtol=1e-5, err_msg=name)


def test_ratios_name_vmoes_fastest_dispatcher():
  rows = [
      dict(shape="s", num_experts=8, top_k=2, dispatch=d, time_ms=t, temp_size_in_bytes=1)
      for d, t in (("vmoe_einsum", 10.0), ("vmoe_indices", 8.0), ("sort", 6.0))
  ]
  rows.append(dict(shape="s", num_experts=None, top_k=2, dispatch="dense_mlp", time_ms=5.0))
  moe_layer.add_ratios(rows)
  sort = rows[2]
  assert sort["peer_best"] == "vmoe_indices" and sort["vs_peer"] == pytest.approx(0.75)
  [target] = [t for t in moe_layer.evaluate_targets(rows) if "vmoe's own" in t["target"]]
  assert target["passed"] and "vmoe_indices" in target["detail"]


def test_a_wrong_peer_path_is_one_clear_error(tmp_path):
  with pytest.raises(SystemExit, match="no vmoe/moe.py"):
    moe_layer.import_peer_vmoe(str(tmp_path))


@pytest.mark.slow
def test_the_train_step_benchmark_times_moe_against_its_dense_equivalent():
  import train_step  # pylint: disable=g-import-not-at-top

  rows, steps = [], []
  for dense in (True, False):
    row, step = train_step.benchmark(
        "quickstart",
        num_experts=4,
        top_k=2,
        dispatch="sort",
        method="vanilla_smoe",
        dense=dense,
        batch_size=8,
    )
    rows.append(row)
    steps.append(step)
  train_step.time_interleaved(rows, steps, 1)
  train_step.add_ratios(rows, peak=1e12)
  dense, moe = rows
  assert dense["method"] == "dense" and moe["method"] == "vanilla_smoe"
  assert moe["vs_dense"] == pytest.approx(moe["step_ms"] / dense["step_ms"], rel=1e-2)
  # Equal active FLOPs: the MoE step's XLA FLOPs are within a few percent of the dense step's
  # plus the router (E = 4 capacity slots at factor 1.25 add padding rows).
  assert 0.9 < moe["xla_flops"] / dense["xla_flops"] < 1.5

  # The dense model's last block is a plain MLP of width k * mlp_dim (the quickstart: 2 x 128),
  # where the MoE model's holds the router and the experts.
  def last_block_shapes(step):
    return {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(step.state.params)[0]
        if jax.tree_util.keystr(path).startswith("['blocks'][3]['mlp']")
    }

  dense_shapes = last_block_shapes(steps[0])
  assert dense_shapes["['blocks'][3]['mlp']['fc1']['kernel'].value"] == (64, 256)
  assert not any("router" in k for k in dense_shapes)
  assert any("router" in k for k in last_block_shapes(steps[1]))
