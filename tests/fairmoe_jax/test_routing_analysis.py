"""fairmoe_jax/analysis/routing.py: the routing-concentration measures of Sec. 3.2 / Figure 2,
against hand-computed numpy references, and the sweep that applies them to the testbed."""

import csv
import json
import math
import types

import numpy as np
import pytest

from fairmoe_jax.analysis import routing
from fairmoe_jax.moe.dispatch.capacity import compute_capacity
from paper_runner import spec


def _report(split_share, groups=None, dropped=0.0, block="moe_block3"):
  groups = groups or {"sex": {"male": split_share, "female": split_share}}
  return {
      "expert_share": {"choices": {block: list(split_share)}},
      "expert_utilisation": {block: groups},
      "fraction_dropped": {block: dropped},
  }


def test_uniform_and_collapsed_routing_are_the_two_ends():
  uniform = routing.routing_concentration(_report([0.25] * 4), top_k=2)["moe_block3"]
  assert uniform["utilisation"] == pytest.approx(1.0)
  assert uniform["top_k_share"] == pytest.approx(0.5) == uniform["uniform_top_k_share"]
  collapsed = routing.routing_concentration(_report([0.0, 0.5, 0.0, 0.5]), top_k=2)["moe_block3"]
  assert collapsed["utilisation"] == pytest.approx(2 / 4)  # Two experts alike: 2 active of 4.
  assert collapsed["top_k_share"] == pytest.approx(1.0)


def test_measures_match_a_float64_reference():
  share = np.array([0.4, 0.3, 0.2, 0.05, 0.05, 0.0, 0.0, 0.0])
  measures = routing.routing_concentration(_report(share), top_k=2)["moe_block3"]
  p = share[share > 0]
  assert measures["utilisation"] == pytest.approx(np.exp(-(p * np.log(p)).sum()) / 8, rel=1e-12)
  assert measures["top_k_share"] == pytest.approx(0.7)
  assert measures["uniform_top_k_share"] == pytest.approx(0.25)
  assert measures["num_experts"] == 8 and measures["top_k"] == 2
  # Without predictions.csv the per-image measures are unknown, not zero.
  assert math.isnan(measures["image_utilisation"]) and math.isnan(measures["image_top_k_share"])


def test_per_image_concentration_is_what_a_split_average_hides():
  # Two images, each routing to its own two experts: the split looks uniform, each image is not.
  images = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
  measures = routing.routing_concentration(
      _report(images.mean(axis=0)), top_k=2, image_shares={"moe_block3": images}
  )["moe_block3"]
  assert measures["utilisation"] == pytest.approx(1.0)
  assert measures["image_utilisation"] == pytest.approx(0.5)
  assert measures["image_top_k_share"] == pytest.approx(1.0)


def test_a_dropped_choice_is_not_concentration():
  # An image whose choices were half dropped reads as its served half; an all-dropped one is left out.
  served = np.array([[0.25, 0.25, 0.25, 0.25]])
  half_dropped = np.array([[0.125, 0.125, 0.125, 0.125], [0.0, 0.0, 0.0, 0.0]])
  assert routing.per_image(half_dropped, 2) == pytest.approx(routing.per_image(served, 2))
  assert all(math.isnan(v) for v in routing.per_image(np.zeros((2, 4)), 2))


def test_group_divergence_names_the_group_that_routes_differently():
  split = [0.25] * 4
  same = {"sex": {"male": split, "female": split}, "age": {"young": split}}
  assert routing.group_divergence(split, same) == (0.0, "sex=male")
  apart = {"sex": {"male": split}, "age": {"young": split, "old": [1.0, 0.0, 0.0, 0.0]}}
  distance, group = routing.group_divergence(split, apart)
  assert distance == pytest.approx(0.75) and group == "age=old"  # 0.5 * (0.75 + 3 * 0.25)


def _write_run(run_dir, report, top_k=2, rows=None):
  run_dir.mkdir()
  (run_dir / "config.json").write_text(json.dumps({"moe": {"top_k": top_k}}))
  (run_dir / "report.json").write_text(json.dumps(report))
  if rows is not None:
    with open(run_dir / "predictions.csv", "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerows(rows)


def test_expert_columns_are_read_in_expert_order_per_block(tmp_path):
  header = ["example_id", "label", "b/expert_10"] + [f"b/expert_{e}" for e in range(10)]
  header += ["a/expert_1", "a/expert_0", "sex"]
  row = ["x.png", "0", "0.5"] + ["0.05"] * 10 + ["1", "0", "male"]
  _write_run(tmp_path / "run", {}, rows=[header, row])
  shares = routing.read_expert_columns(str(tmp_path / "run" / "predictions.csv"))
  assert sorted(shares) == ["a", "b"]
  np.testing.assert_array_equal(shares["a"], [[0.0, 1.0]])
  assert shares["b"].shape == (1, 11) and shares["b"][0, 10] == 0.5


def test_routing_table_collector_writes_a_row_per_run_and_block(tmp_path):
  header = ["example_id", "moe_block3/expert_0", "moe_block3/expert_1"]
  ok = tmp_path / "runs" / "ok"
  (tmp_path / "runs").mkdir()
  _write_run(ok, _report([0.9, 0.1]), top_k=1, rows=[header, ["a", "1", "0"], ["b", "0.8", "0.2"]])
  bare = tmp_path / "runs" / "bare"
  _write_run(bare, _report([0.5, 0.5]), top_k=1)  # No predictions.csv.

  def run(name, path, status="ok"):
    report = json.loads((path / "report.json").read_text()) if status == "ok" else None
    return types.SimpleNamespace(
        name=name, point={"seed": 0}, run_dir=str(path), status=status, report=report
    )

  runs = [run("ok", ok), run("bare", bare), run("failed", tmp_path, "failed")]
  md, js = routing.write_routing_table(str(tmp_path), runs)
  rows = json.loads(open(js).read())
  assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
  first = rows[0]["blocks"]["moe_block3"]
  assert first["top_k_share"] == pytest.approx(0.9) and first["uniform_top_k_share"] == 0.5
  assert first["image_top_k_share"] == pytest.approx((1.0 + 0.8) / 2)
  assert rows[1]["blocks"]["moe_block3"]["image_utilisation"] is None  # NaN is not JSON.
  table = open(md).read()
  assert "| ok | moe_block3 | 2 | " in table and "0.900 (0.500)" in table
  assert "| failed | failed |" in table


def test_the_validation_table_reads_the_validation_split_s_routing(tmp_path):
  (tmp_path / "runs").mkdir()
  header = ["example_id", "moe_block3/expert_0", "moe_block3/expert_1"]
  both = tmp_path / "runs" / "both"
  report = dict(_report([0.5, 0.5]), validation=dict(_report([0.8, 0.2]), accuracy=0.5))
  _write_run(both, report, top_k=1, rows=[header, ["a", "1", "0"]])
  old = tmp_path / "runs" / "old"
  _write_run(old, dict(_report([0.5, 0.5]), validation={"accuracy": 0.5}), top_k=1)
  runs = [
      types.SimpleNamespace(
          name=path.name,
          point={"seed": 0},
          run_dir=str(path),
          status="ok",
          report=json.loads((path / "report.json").read_text()),
      )
      for path in (both, old)
  ]
  md, js = routing.write_validation_routing_table(str(tmp_path), runs)
  assert md.endswith("routing_validation.md")
  rows = json.loads(open(js).read())
  block = rows[0]["blocks"]["moe_block3"]
  assert block["top_k_share"] == pytest.approx(0.8)  # Validation's 0.8, not test's 0.5.
  assert block["image_utilisation"] is None  # predictions.csv holds test images only.
  assert rows[1]["status"] == routing.NO_VALIDATION_ROUTING and "blocks" not in rows[1]
  table = open(md).read()
  assert f"| old | {routing.NO_VALIDATION_ROUTING} |" in table
  assert "| both | moe_block3 | 2 | 0.825 | 0.800 (0.500) | — | — |" in table
  test_rows = json.loads(open(routing.write_routing_table(str(tmp_path), runs)[1]).read())
  assert test_rows[0]["blocks"]["moe_block3"]["top_k_share"] == pytest.approx(0.5)
  with pytest.raises(ValueError, match="split='train'"):
    routing.run_concentration(str(both), report, "train")


def test_testbed_routing_sweep_evaluates_every_choice():
  sweep = spec.load_sweep("configs/sweeps/testbed_routing.py")
  points = spec.grid_points(sweep)
  assert len(points) == 12 and sweep.overrides["method"] == "vanilla_smoe"
  assert {p["moe.blocks"] for p in points} == {(-1,), (0,)}
  assert list(sweep.tables) == [
      "fairmoe_jax.analysis.routing:write_routing_table",
      "fairmoe_jax.analysis.routing:write_validation_routing_table",
  ]
  # The evaluation capacity fits every token of a 32x32 image in 4x4 patches at any E: the
  # test split shows the router's choices, none dropped.
  for experts in {p["moe.num_experts"] for p in points}:
    tokens = (32 // 4) ** 2
    assert (
        compute_capacity(tokens, experts, 2, sweep.overrides["moe.eval_capacity_factor"]) == tokens
    )
