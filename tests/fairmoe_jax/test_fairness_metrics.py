"""Tests for fairmoe_jax.metrics: count tensors, fairness metrics and the report."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT
from fairmoe_jax import report as report_lib
from fairmoe_jax.metrics import (
    METRIC_NAMES,
    attribute_counts,
    attribute_fairness,
    confusion_counts,
    fairness_report,
    format_report,
    multi_attribute_fairness,
    overall_counts,
)

# ---------------------------------------------------------------------------
# Helpers: data and an independent float64 reference from raw examples.
# ---------------------------------------------------------------------------


def _random_batch(rng, n, num_groups, num_classes, *, p_mask=0.15, p_missing=0.15):
  labels = rng.integers(0, num_classes, n)
  preds = np.where(rng.random(n) < 0.6, labels, rng.integers(0, num_classes, n))
  groups = rng.integers(0, num_groups, n)
  groups[rng.random(n) < p_missing] = -1
  mask = rng.random(n) >= p_mask
  return labels, preds, groups, mask


def _counts_loop(labels, preds, groups, mask, num_groups, num_classes):
  out = np.zeros((num_groups, num_classes, num_classes))
  for y, p, g, m in zip(labels, preds, groups, mask):
    if m and g >= 0:
      out[g, y, p] += 1
  return out


def _reference_metrics(y, p, g, num_groups, num_classes):
  """Metrics straight from (label, pred, group) arrays, one example at a time in spirit."""
  y, p, g = (np.asarray(a, dtype=np.int64) for a in (y, p, g))
  present = [k for k in range(num_groups) if np.any(g == k)]

  def spread(values):
    return max(values) - min(values) if len(values) >= 2 else None

  def mean_defined(values, default):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else default

  acc = {k: float(np.mean(y[g == k] == p[g == k])) for k in present}
  if len(present) < 2 or max(acc.values()) == 0:
    pqd = 1.0
  else:
    pqd = min(acc.values()) / max(acc.values())

  dp, eopp, eodds = [], [], []
  for c in range(num_classes):
    dp.append(spread([np.mean(p[g == k] == c) for k in present]))
    tpr = [np.mean(p[(g == k) & (y == c)] == c) for k in present if np.any((g == k) & (y == c))]
    fpr = [np.mean(p[(g == k) & (y != c)] == c) for k in present if np.any((g == k) & (y != c))]
    eopp.append(spread(tpr))
    both = [s for s in (spread(tpr), spread(fpr)) if s is not None]
    eodds.append(max(both) if both else None)
  return {
      "pqd": pqd,
      "dp": mean_defined(dp, 0.0),
      "eopp": mean_defined(eopp, 0.0),
      "eodds": mean_defined(eodds, 0.0),
      "group_accuracy": acc,
  }


def _jit_counts(num_groups, num_classes):
  return jax.jit(
      functools.partial(confusion_counts, num_groups=num_groups, num_classes=num_classes)
  )


# ---------------------------------------------------------------------------
# Count tensors.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [bool, np.float32])
def test_counts_match_numpy_loop(mask_dtype):
  rng = np.random.default_rng(0)
  labels, preds, groups, mask = _random_batch(rng, 300, num_groups=3, num_classes=4)
  assert (~mask).any() and (groups < 0).any()  # the data exercises both exclusions

  got = _jit_counts(3, 4)(labels, preds, groups, mask.astype(mask_dtype))
  assert got.shape == (3, 4, 4) and got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), _counts_loop(labels, preds, groups, mask, 3, 4))


def test_out_of_range_indices_are_dropped_not_aliased():
  # With a flattened index y * C + p, pred == C would alias onto cell (y + 1, 0).
  labels = np.array([0, 0, 1, 5])
  preds = np.array([0, 2, 1, 0])
  groups = np.array([0, 0, 1, 0])
  got = np.asarray(_jit_counts(2, 2)(labels, preds, groups, np.ones(4, bool)))
  expected = np.zeros((2, 2, 2))
  expected[0, 0, 0] = 1
  expected[1, 1, 1] = 1
  np.testing.assert_array_equal(got, expected)


def test_attribute_and_overall_counts_accumulate_over_batches():
  rng = np.random.default_rng(1)
  group_sizes, num_classes, n = (2, 3, 4), 5, 400
  labels, preds, _, mask = _random_batch(rng, n, 1, num_classes)
  attributes = np.stack([rng.integers(-1, g, n) for g in group_sizes], axis=1)

  @jax.jit
  def step(labels, preds, attributes, mask):
    return (
        overall_counts(labels, preds, mask, num_classes=num_classes),
        attribute_counts(
            labels, preds, attributes, mask, group_sizes=group_sizes, num_classes=num_classes
        ),
    )

  acc = jax.tree.map(jnp.zeros_like, step(labels[:100], preds[:100], attributes[:100], mask[:100]))
  for start in range(0, n, 100):
    sl = slice(start, start + 100)
    acc = jax.tree.map(jnp.add, acc, step(labels[sl], preds[sl], attributes[sl], mask[sl]))
  whole = step(labels, preds, attributes, mask)

  jax.tree.map(np.testing.assert_array_equal, acc, whole)
  overall, per_attribute = acc
  np.testing.assert_array_equal(
      np.asarray(overall), _counts_loop(labels, preds, np.zeros(n, int), mask, 1, num_classes)[0]
  )
  for i, g in enumerate(group_sizes):
    np.testing.assert_array_equal(
        np.asarray(per_attribute[i]),
        _counts_loop(labels, preds, attributes[:, i], mask, g, num_classes),
    )
  # Missing attribute values shrink the per-attribute totals but not the overall one.
  assert np.asarray(overall).sum() == mask.sum()
  assert all(np.asarray(c).sum() < mask.sum() for c in per_attribute)


def test_attribute_counts_rejects_wrong_number_of_columns():
  with pytest.raises(ValueError):
    attribute_counts(
        np.zeros(4, int),
        np.zeros(4, int),
        np.zeros((4, 2), int),
        np.ones(4),
        group_sizes=(2, 2, 2),
        num_classes=2,
    )


# ---------------------------------------------------------------------------
# Metrics against independent references.
# ---------------------------------------------------------------------------


def _multiclass_data():
  """C=4, G=5: group 4 is empty, group 2 has no label 1, label 3 only occurs in group 0."""
  rng = np.random.default_rng(2)
  num_groups, num_classes, n = 5, 4, 600
  labels, preds, groups, mask = _random_batch(rng, n, 4, num_classes)
  labels[(groups == 2) & (labels == 1)] = 0
  labels[(groups != 0) & (labels == 3)] = 2
  # Rows of group 4 exist but are all padding, so the group must come out empty.
  groups[:10] = 4
  mask[:10] = False
  return labels, preds, groups, mask, num_groups, num_classes


def test_multiclass_metrics_match_reference():
  labels, preds, groups, mask, num_groups, num_classes = _multiclass_data()
  counts = np.asarray(_jit_counts(num_groups, num_classes)(labels, preds, groups, mask))
  got = attribute_fairness(counts)

  keep = mask & (groups >= 0)
  ref = _reference_metrics(labels[keep], preds[keep], groups[keep], num_groups, num_classes)
  for name in METRIC_NAMES:
    assert getattr(got, name) == pytest.approx(ref[name], abs=1e-12), name
  assert got.empty_groups == [4]
  assert got.group_n.tolist() == [int(np.sum(groups[keep] == k)) for k in range(num_groups)]
  for k, acc in ref["group_accuracy"].items():
    assert got.group_accuracy[k] == pytest.approx(acc, abs=1e-12)
  assert math.isnan(got.group_accuracy[4])
  # The data is built so that the skip rules matter: sanity-check they changed something.
  assert 0.0 < got.eopp and 0.0 < got.dp and got.pqd < 1.0


def test_multiclass_dp_is_mean_of_one_vs_rest_fairlearn():
  from fairlearn.metrics import demographic_parity_difference

  labels, preds, groups, mask, num_groups, num_classes = _multiclass_data()
  counts = np.asarray(_jit_counts(num_groups, num_classes)(labels, preds, groups, mask))
  keep = mask & (groups >= 0)
  y, p, g = labels[keep], preds[keep], groups[keep]
  per_class = [
      demographic_parity_difference(y == c, p == c, sensitive_features=g)
      for c in range(num_classes)
  ]
  assert attribute_fairness(counts).dp == pytest.approx(np.mean(per_class), abs=1e-12)


def test_binary_metrics_match_fairlearn():
  from fairlearn.metrics import (
      MetricFrame,
      accuracy_score_ratio,
      demographic_parity_difference,
      equal_opportunity_difference,
      equalized_odds_difference,
      true_positive_rate,
  )
  from sklearn.metrics import accuracy_score

  rng = np.random.default_rng(3)
  n = 500
  groups = rng.integers(0, 3, n)
  # Group-dependent base rates and error rates so that every metric is nonzero.
  labels = (rng.random(n) < np.array([0.3, 0.5, 0.7])[groups]).astype(int)
  flip = rng.random(n) < np.array([0.1, 0.25, 0.4])[groups]
  preds = np.where(flip, 1 - labels, labels)
  counts = np.asarray(_jit_counts(3, 2)(labels, preds, groups, np.ones(n, bool)))
  got = attribute_fairness(counts)

  assert got.dp == pytest.approx(
      demographic_parity_difference(labels, preds, sensitive_features=groups), abs=1e-12
  )
  assert got.eodds == pytest.approx(
      equalized_odds_difference(labels, preds, sensitive_features=groups), abs=1e-12
  )
  assert got.pqd == pytest.approx(
      accuracy_score_ratio(labels, preds, sensitive_features=groups), abs=1e-12
  )

  # EOpp averages the TPR spread of both one-vs-rest classes.
  def tpr_of_class(c):
    def tpr(y_true, y_pred):
      return true_positive_rate(y_true, y_pred, pos_label=c)

    return tpr

  tpr_spread = {
      c: MetricFrame(
          metrics=tpr_of_class(c), y_true=labels, y_pred=preds, sensitive_features=groups
      ).difference()
      for c in (0, 1)
  }
  assert tpr_spread[1] == pytest.approx(
      equal_opportunity_difference(labels, preds, sensitive_features=groups), abs=1e-12
  )
  assert got.eopp == pytest.approx((tpr_spread[0] + tpr_spread[1]) / 2, abs=1e-12)

  by_group = MetricFrame(
      metrics=accuracy_score, y_true=labels, y_pred=preds, sensitive_features=groups
  ).by_group
  np.testing.assert_allclose(got.group_accuracy, by_group.sort_index().to_numpy(), atol=1e-12)
  assert min(got.dp, got.eopp, got.eodds) > 0.0 and got.pqd < 1.0


def test_hand_computed_example():
  # Group 0: labels [0, 0, 1, 1], preds [0, 1, 1, 1] -> acc 3/4, P(pred=1) = 3/4
  #          TPR_1 = 2/2 = 1, FPR_1 = 1/2;  TPR_0 = 1/2, FPR_0 = 0/2 = 0
  # Group 1: labels [0, 0, 1],    preds [1, 0, 0]    -> acc 1/3, P(pred=1) = 1/3
  #          TPR_1 = 0/1 = 0, FPR_1 = 1/2;  TPR_0 = 1/2, FPR_0 = 1/1 = 1
  # PQD   = (1/3) / (3/4)                                  = 4/9
  # DP    = mean(|1/4 - 2/3|, |3/4 - 1/3|) = mean(5/12, 5/12) = 5/12
  # EOpp  = mean(TPR_0 spread 0, TPR_1 spread 1)           = 1/2
  # EOdds = mean(max(0, 1), max(1, 0))                     = 1
  labels = np.array([0, 0, 1, 1, 0, 0, 1])
  preds = np.array([0, 1, 1, 1, 1, 0, 0])
  groups = np.array([0, 0, 0, 0, 1, 1, 1])
  counts = np.asarray(_jit_counts(2, 2)(labels, preds, groups, np.ones(7)))
  got = attribute_fairness(counts)
  assert got.pqd == pytest.approx(4 / 9)
  assert got.dp == pytest.approx(5 / 12)
  assert got.eopp == pytest.approx(1 / 2)
  assert got.eodds == pytest.approx(1.0)
  np.testing.assert_allclose(got.group_accuracy, [3 / 4, 1 / 3])
  assert got.group_n.tolist() == [4, 3] and got.empty_groups == []


def test_empty_groups_are_listed_and_ignored():
  rng = np.random.default_rng(4)
  labels, preds, groups, mask = _random_batch(rng, 200, 3, 3, p_mask=0.0, p_missing=0.0)
  dense = np.asarray(_jit_counts(3, 3)(labels, preds, groups, mask))
  # Same examples, but spread over groups {0, 2, 4} of a 6-group attribute.
  sparse = np.asarray(_jit_counts(6, 3)(labels, preds, groups * 2, mask))
  a, b = attribute_fairness(dense), attribute_fairness(sparse)

  assert b.empty_groups == [1, 3, 5]
  for name in METRIC_NAMES:
    value = getattr(b, name)
    assert not math.isnan(value)
    assert value == pytest.approx(getattr(a, name), abs=1e-12), name
  assert np.isnan(b.group_accuracy[[1, 3, 5]]).all()
  np.testing.assert_array_equal(b.group_accuracy[[0, 2, 4]], a.group_accuracy)


@pytest.mark.parametrize("num_nonempty", [0, 1])
def test_fewer_than_two_groups_means_no_disparity(num_nonempty):
  counts = np.zeros((3, 2, 2))
  if num_nonempty:
    counts[1] = [[5, 2], [1, 7]]
  got = attribute_fairness(counts)
  assert (got.pqd, got.dp, got.eopp, got.eodds) == (1.0, 0.0, 0.0, 0.0)
  assert len(got.empty_groups) == 3 - num_nonempty


def test_all_groups_zero_accuracy_gives_pqd_one():
  counts = np.zeros((2, 2, 2))
  counts[0] = [[0, 3], [1, 0]]
  counts[1] = [[0, 2], [4, 0]]
  assert attribute_fairness(counts).pqd == 1.0


def test_class_defined_in_one_group_only_is_skipped_by_eopp():
  # Class 1 appears only in group 0 -> TPR_1 has one group -> skipped; EOpp = TPR_0 spread.
  counts = np.zeros((2, 2, 2))
  counts[0] = [[4, 0], [1, 1]]  # TPR_0 = 1
  counts[1] = [[1, 3], [0, 0]]  # TPR_0 = 1/4, no label 1
  got = attribute_fairness(counts)
  assert got.eopp == pytest.approx(3 / 4)
  # EOdds class 1: TPR_1 undefined, FPR_1 spread |0 - 3/4|; class 0: TPR_0 spread 3/4,
  # FPR_0 = P(pred 0 | y 1) only in group 0 -> undefined. Mean(3/4, 3/4).
  assert got.eodds == pytest.approx(3 / 4)


def test_multi_attribute_fairness_is_mean_over_attributes():
  a = attribute_fairness(np.array([[[3, 1], [0, 4]], [[1, 1], [2, 2]]], dtype=float))
  b = attribute_fairness(np.array([[[5, 0], [0, 5]], [[2, 3], [1, 4]]], dtype=float))
  mf = multi_attribute_fairness([a, b])
  for name in METRIC_NAMES:
    assert mf[name] == pytest.approx((getattr(a, name) + getattr(b, name)) / 2)
  with pytest.raises(ValueError):
    multi_attribute_fairness([])


def test_rejects_malformed_counts():
  with pytest.raises(ValueError):
    attribute_fairness(np.zeros((2, 2, 3)))
  with pytest.raises(ValueError):
    attribute_fairness(-np.ones((2, 2, 2)))


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------


def _report_inputs():
  rng = np.random.default_rng(5)
  group_sizes, num_classes, n = (2, 3), 3, 300
  labels, preds, _, mask = _random_batch(rng, n, 1, num_classes)
  attributes = np.stack([rng.integers(-1, 2, n), rng.integers(-1, 2, n)], axis=1)  # group 2 empty
  overall = np.asarray(overall_counts(labels, preds, mask, num_classes=num_classes))
  per_attribute = [
      np.asarray(c)
      for c in attribute_counts(
          labels, preds, attributes, mask, group_sizes=group_sizes, num_classes=num_classes
      )
  ]
  names = ["sex", "age"]
  group_names = [["male", "female"], ["young", "middle", "senior"]]
  return overall, per_attribute, names, group_names, mask


def test_report_schema_and_values():
  overall, per_attribute, names, group_names, mask = _report_inputs()
  report = fairness_report(overall, per_attribute, names, group_names)
  json.dumps(report, allow_nan=False)

  assert set(report) == {"accuracy", "num_examples", "attributes", "mf"}
  assert type(report["accuracy"]) is float and type(report["num_examples"]) is int
  assert report["num_examples"] == int(mask.sum())
  assert report["accuracy"] == pytest.approx(np.trace(overall) / overall.sum())
  assert list(report["attributes"]) == names
  assert set(report["mf"]) == set(METRIC_NAMES)

  for name, counts in zip(names, per_attribute):
    attr = report["attributes"][name]
    assert set(attr) == {*METRIC_NAMES, "groups", "empty_groups", "single_group"}
    assert attr["single_group"] is False
    assert all(type(attr[m]) is float for m in METRIC_NAMES)
    ref = attribute_fairness(counts)
    for m in METRIC_NAMES:
      assert attr[m] == getattr(ref, m)
    for group in attr["groups"].values():
      assert set(group) == {"n", "accuracy"}
      assert type(group["n"]) is int and group["n"] > 0
      assert type(group["accuracy"]) is float
  assert report["attributes"]["age"]["empty_groups"] == ["senior"]
  assert list(report["attributes"]["age"]["groups"]) == ["young", "middle"]
  assert report["attributes"]["sex"]["empty_groups"] == []
  for m in METRIC_NAMES:
    expected = np.mean([report["attributes"][a][m] for a in names])
    assert report["mf"][m] == pytest.approx(expected)


def test_the_console_report_gives_training_s_and_the_test_s_dropped_fractions():
  report = fairness_report(*_report_inputs()[:4])
  assert "Dropped" not in format_report(report)  # No MoE block.
  report["fraction_dropped"] = {"block_1": 0.95, "block_3": 0.85}
  records = [{"step": 10, "train/block_1/fraction_dropped": 0.2, "val/block_1/fraction_dropped": 1}]
  records.append({"step": 20, "train/block_1/fraction_dropped": 0.114})
  report["dropped"] = report_lib.dropped_summary(report, records)
  (line,) = [line for line in format_report(report).splitlines() if "Dropped" in line]
  assert "training 15.7%, test 90.0%" in line
  report["dropped"] = report_lib.dropped_summary(report, [{"step": 10}])
  assert "training not logged, test 90.0%" in format_report(report)


def test_a_fairsmoe_run_prints_vanilla_smoe_s_record_only_for_the_record_s_settings():
  from fairmoe_jax.config import quickstart_config

  report = {**fairness_report(*_report_inputs()[:4]), "method": "fairsmoe"}
  base = report_lib.matching_baseline(quickstart_config(None))  # The quickstart's: a record.
  assert base["command"].startswith(
      "python -m fairmoe_jax.main --config=configs/quickstart.py --config.method=vanilla_smoe"
  )
  lines = format_report({**report, "baseline": base}).splitlines()
  heading = lines.index(
      f"Vanilla SMoE on the same data, size, steps and seed (one run, {base['date']}, jax "
      f"{base['jax']}, {base['machine']}; results/records/quickstart_vanilla_smoe.json):"
  )
  assert lines[heading + 1 : heading + 3] == [
      f"  {base['command']}",
      f"  accuracy {100 * base['accuracy']:.2f}% (this run {100 * report['accuracy']:.2f}%), "
      f"MF-PQD {base['mf']['pqd']:.3f} ({report['mf']['pqd']:.3f}), MF-DP "
      f"{base['mf']['dp']:.3f} ({report['mf']['dp']:.3f})",
  ]
  for other in ("steps=100", "experts=8", "cues=false"):
    assert report_lib.matching_baseline(quickstart_config(other)) is None
  seed_1 = quickstart_config(None)
  seed_1.seed = 1
  assert report_lib.matching_baseline(seed_1) is None
  text = format_report({**report, "baseline": None})
  assert "no vanilla SMoE record matches this run's data, size, steps and seed" in text
  assert "Vanilla SMoE on the same data" not in text


def test_the_shipped_vanilla_smoe_record_is_the_checkout_s_record():
  shipped = pathlib.Path(report_lib.__file__).with_name("quickstart_vanilla_smoe.json")
  assert shipped.read_bytes() == (REPO_ROOT / report_lib.BASELINE_RECORD).read_bytes()


def test_fem_s_reading_names_an_expert_a_change_emptied_and_the_idle_ones():
  emptied = {"step": 150, "attribute": "age", "change": "grow", "experts": [1]}
  emptied.update(share_before=0.381, share_after=0.001, usage_changed=True)
  report = {
      "allocation_history": [{}] * 6,
      "expert_share": {"choices": {"moe_block3": [0.5, 0.001, 0.3, 0.199]}},
      "fem_changes": [emptied],
  }
  assert report_lib.fem_reading(report, "expert_competence") == (
      "FEM's reading: 1 change(s) in 6 reviews, routing moved after 1 (under expert_competence, "
      "FEM changes what its experts learn, never the router: routing follows only through the "
      "task loss); expert 1 emptied by FEM's move: age gained it at step 150, and its share of "
      "the validation choices fell 38.1% -> 0.1%; at the end 3 of 4 experts serve 1% or more of "
      "the test choices (idle: expert 1 0.1%)"
  )
  report["fem_changes"] = [dict(emptied, share_after=0.35, usage_changed=True)]  # Not emptied.
  report["expert_share"]["choices"]["moe_block3"][1] = 0.35
  reading = report_lib.fem_reading(report, "class_routing")
  assert reading == (
      "FEM's reading: 1 change(s) in 6 reviews, routing moved after 1; at the end 4 of 4 "
      "experts serve 1% or more of the test choices"
  )
  assert reading in format_report(
      {**fairness_report(*_report_inputs()[:4]), "fem_reading": reading}
  )


def test_format_report_lists_groups_and_mf():
  overall, per_attribute, names, group_names, _ = _report_inputs()
  report = fairness_report(overall, per_attribute, names, group_names)
  text = format_report(report)
  for name in names:
    assert f"[{name}]" in text
  for groups in group_names:
    for group in groups:
      assert group in text
  assert "empty groups (excluded): senior" in text
  mf_lines = text.splitlines()[text.splitlines().index("MF (mean over 2 attributes)") + 1]
  assert f"PQD {report['mf']['pqd']:.4f}" in mf_lines
  assert f"EOdds {report['mf']['eodds']:.4f}" in mf_lines
  assert f"{100 * report['accuracy']:.2f}%" in text


def test_an_attribute_with_one_group_in_the_split_is_left_out_of_mf_and_flagged():
  # `data.sensitive=Male,Bald` on an identity fold without a Bald person: Bald scored
  # PQD 1.0 / DP 0.0 by definition and MF-PQD averaged it in (0.849 against Male's 0.698),
  # with no word of it.
  rng = np.random.default_rng(3)
  n, num_classes = 200, 2
  labels, preds, _, mask = _random_batch(rng, n, 1, num_classes)
  male = rng.integers(0, 2, n)
  bald = np.zeros(n, np.int64)  # Everyone "not_Bald".
  overall = np.asarray(overall_counts(labels, preds, mask, num_classes=num_classes))
  per_attribute = [
      np.asarray(c)
      for c in attribute_counts(
          labels,
          preds,
          np.stack([male, bald], 1),
          mask,
          group_sizes=(2, 2),
          num_classes=num_classes,
      )
  ]
  names, groups = ["Male", "Bald"], [["not_Male", "Male"], ["not_Bald", "Bald"]]
  report = fairness_report(overall, per_attribute, names, groups)
  json.dumps(report, allow_nan=False)
  for m in METRIC_NAMES:  # The mean over the measurable attribute alone.
    assert report["mf"][m] == report["attributes"]["Male"][m]
  assert report["mf"]["pqd"] < 1.0
  assert attribute_fairness(per_attribute[1]).measurable is False
  assert report["attributes"]["Bald"]["single_group"] is True
  assert report["attributes"]["Male"]["single_group"] is False
  assert report["mf_excluded"] == ["Bald"]
  text = format_report(report)
  assert "MF (mean over 1 of 2 attributes; left out, one group only: Bald)" in text
  bald_section = text.split("[Bald]")[1].split("\n\n")[0]
  assert "Warning: one group only in this split" in bald_section
  # Every attribute measurable: no key, the heading as before.
  full = fairness_report(overall, per_attribute[:1], names[:1], groups[:1])
  assert "mf_excluded" not in full and "MF (mean over 1 attributes)" in format_report(full)


def test_report_rejects_mismatched_names():
  overall, per_attribute, names, group_names, _ = _report_inputs()
  with pytest.raises(ValueError):
    fairness_report(overall, per_attribute, names[:1], group_names)
  with pytest.raises(ValueError):
    fairness_report(overall, per_attribute, names, [["male", "female"], ["young", "old"]])
  with pytest.raises(ValueError):
    fairness_report(overall, per_attribute, names, [["a", "a"], ["x", "y", "z"]])


def test_the_report_says_whether_the_sa_classifiers_beat_the_majority_rate():
  from fairmoe_jax.evaluation import sa_classifier_report
  from fairmoe_jax.metrics.report import format_report

  info = types.SimpleNamespace(attribute_names=("sex", "age"))
  report = {
      "attributes": {
          "sex": {"groups": {"f": {"n": 60}, "m": {"n": 40}}},
          "age": {"groups": {"<30": {"n": 50}, "30+": {"n": 50}}},
      }
  }
  unknown = {"attributes": {"sex": {"groups": {}}, "age": {"groups": {}}}}  # E.g. predict mode.
  assert sa_classifier_report({"b": {0: np.array([0, 0])}}, unknown, info) == {}
  counts = {"moe_block3": {0: np.array([90, 100]), 1: np.array([50, 100])}}
  result = sa_classifier_report(counts, report, info)["moe_block3"]
  assert result["sex"] == {"accuracy": 0.9, "majority_rate": 0.6, "above_majority": True}
  assert result["age"] == {"accuracy": 0.5, "majority_rate": 0.5, "above_majority": False}
  base = {
      "accuracy": 0.5,
      "num_examples": 100,
      "attributes": {},
      "mf": dict.fromkeys(("pqd", "dp", "eopp", "eodds"), 0.0),
  }
  text = format_report({**base, "sa_classifiers": {"moe_block3": result}})
  assert "sex 90.0% (majority 60.0%)" in text and "same vote for every group" not in text
  result["sex"]["above_majority"] = False
  text = format_report({**base, "sa_classifiers": {"moe_block3": result}})
  # Not a fault of the run: Eq. 7's aim, and where to look for routing by group.
  assert "the SA branch adds the same vote for every group" in text and "Warning" not in text
  assert "--config.fair.route_by=label" in text
  # A run that routed by the labels is not pointed to them again, nor told that its SA branch
  # (which read the labels) gave every group the same vote.
  by_label = format_report(
      {**base, "sa_classifiers": {"moe_block3": result}, "note": "route_by=label: ..."}
  )
  assert "same vote" not in by_label and "--config.fair.route_by=label" not in by_label
  assert "under route_by=label the SA branch votes by each image's true group" in by_label


def test_routing_by_group_names_the_group_routed_least_like_the_split():
  """`routing_by_group`: the largest total-variation distance between a group's expert shares and
  the split's, against a float64 reference; 0 when every group routes alike, and the console
  prints it."""
  from fairmoe_jax.evaluation import group_divergence
  from fairmoe_jax.metrics.report import format_report

  split = np.array([30.0, 30.0, 20.0, 20.0])  # Counts: normalised inside.
  alike = {"sex": {"m": [0.3, 0.3, 0.2, 0.2], "f": [0.3, 0.3, 0.2, 0.2]}}
  assert group_divergence(split, alike) == (0.0, "sex=m")
  assert group_divergence(np.zeros(4), alike) == (0.0, "")  # No routed choice: no NaN.
  groups = {
      "sex": {"m": [0.3, 0.3, 0.2, 0.2], "f": [0.3, 0.3, 0.2, 0.2]},
      "site": {"head": [0.0, 0.0, 0.5, 0.5], "palm": [0.4, 0.4, 0.1, 0.1], "none": [0, 0, 0, 0]},
  }
  reference = {
      f"{a}={g}": 0.5 * np.abs(np.float64(v) / np.sum(v) - split / split.sum()).sum()
      for a, by in groups.items()
      for g, v in by.items()
      if np.sum(v) > 0
  }
  divergence, group = group_divergence(split, groups)
  assert group == max(reference, key=reference.get) == "site=head"
  assert divergence == pytest.approx(reference["site=head"], abs=1e-15) and divergence == 0.6
  base = {
      "accuracy": 0.5,
      "num_examples": 100,
      "attributes": {},
      "mf": dict.fromkeys(("pqd", "dp", "eopp", "eodds"), 0.0),
  }
  text = format_report(
      {**base, "routing_by_group": {"moe_block3": {"divergence": 0.6, "group": "site=head"}}}
  )
  assert (
      "Routing by group (moe_block3): the group routed least like the split is site=head, "
      "60.0% of its choices away" in text
  )


@pytest.mark.parametrize("method", ["fairsmoe", "multifair"])
def test_gradient_cosines_are_those_of_each_attribute_s_own_gradient_of_the_moe_weights(method):
  """fairmoe_jax/metrics/gradients.py against one backward pass per attribute over the whole
  model, cut to the MoE blocks' weights, its cosines in float64; {} for a model without MoE."""
  import flax.nnx as nnx

  from fairmoe_jax import config as fairmoe_config
  from fairmoe_jax import train
  from fairmoe_jax.data.augment import normalize_on_device
  from fairmoe_jax.fairness.surrogates import fairness_surrogate
  from fairmoe_jax.methods import METHODS
  from fairmoe_jax.metrics.gradients import gradient_cosines, moe_paths

  config = fairmoe_config.base_config()
  config.method = method
  config.data.update(train_size=32, val_size=32, test_size=32, num_threads=0, image_size=16)
  config.model.update(dim=16, depth=2, num_heads=2, mlp_dim=32)
  config.update(batch_size=16, eval_batch_size=16, num_train_steps=1)
  fairmoe_config.validate(config, num_devices=jax.device_count())
  info, splits = train.load_data(config)
  model = METHODS[method].build_model(config, info, nnx.Rngs(params=0), None)
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  val = splits["val"]
  batches = [
      {
          "image": jnp.asarray(val["image"][rows]),
          "label": jnp.asarray(val["label"][rows]),
          "attributes": jnp.asarray(val["attributes"][rows]),
          "mask": jnp.ones(16, jnp.float32),
      }
      for rows in (slice(0, 16), slice(16, 32))
  ]
  names = info.attribute_names
  got = gradient_cosines(
      graphdef,
      params,
      model_state,
      batches,
      attribute_names=names,
      group_sizes=info.group_sizes,
      psi="pqd",
  )
  prefixes = moe_paths(model)
  if method == "multifair":  # A plain ViT: no MoE weights to compare.
    assert not prefixes and got == {}
    return
  assert len(names) >= 3 and prefixes

  def task_loss(params, batch, i):
    logits, _ = nnx.merge(graphdef, params, model_state)(
        normalize_on_device(batch["image"], batch["mask"]),
        train=False,
        context={"attributes": batch["attributes"]},
    )
    return fairness_surrogate(
        logits, batch["label"], batch["attributes"], info.group_sizes, "pqd", attribute_indices=(i,)
    )

  @jax.jit  # One program, one separate backward pass per attribute in it.
  def task_gradients(params, batch):
    return [jax.grad(task_loss)(params, batch, i) for i in range(len(names))]

  def moe_gradients(batch):
    return [
        np.concatenate(
            [
                np.ravel(np.asarray(x[...] if hasattr(x, "get_value") else x, np.float64))
                for path, x in nnx.to_flat_state(gradient)
                if any(tuple(path[: len(p)]) == tuple(p) for p in prefixes)
            ]
        )
        for gradient in task_gradients(params, batch)
    ]

  for n, batch in enumerate(batches):
    grads = moe_gradients(batch)
    assert all(np.linalg.norm(g) > 0 for g in grads)  # Every attribute's task moves the MoE.
    for a in range(len(names)):
      for b in range(a + 1, len(names)):
        want = grads[a] @ grads[b] / (np.linalg.norm(grads[a]) * np.linalg.norm(grads[b]))
        # The report rounds to 6 decimals; float32 sums over P MoE weights err by about
        # sqrt(P) roundings (measured: at most 6e-7 on both stacks, also with AVX2 only).
        tolerance = 5e-7 + np.sqrt(grads[a].size) * np.finfo(np.float32).eps
        assert got[f"{names[a]}|{names[b]}"][n] == pytest.approx(want, abs=tolerance)


def test_gradient_cosines_on_an_expert_parallel_mesh_move_no_gradient_rows():
  """Compiled for FairSMoE on a data 2 x expert 4 mesh of 8 CPU devices: the attributes'
  gradients of the expert-sharded weights are reduced where they lie. Joined into one [m, P]
  matrix first, they were all-gathered (8 all-gathers of [m, ...] rows, 4 all-reduces)."""
  import re

  import optax

  from fairmoe_jax import config as fairmoe_config
  from fairmoe_jax import evaluation, train
  from fairmoe_jax.metrics.gradients import batch_cosines_fn, split_moe_weights
  from trainkit.mesh import make_mesh

  config = fairmoe_config.base_config()
  config.method = "fairsmoe"
  config.data.update(train_size=32, val_size=32, test_size=32, num_threads=0)
  config.model.update(dim=32, depth=2, num_heads=2, mlp_dim=64)
  config.moe.num_experts = 8
  config.mesh.update(data=2, expert=4)
  config.update(batch_size=32, eval_batch_size=32, num_train_steps=1)
  fairmoe_config.validate(config, num_devices=jax.device_count())
  info, splits = train.load_data(config)
  mesh = make_mesh(config.mesh)
  graphdef, state = train.create_state(config, info, optax.sgd(0.1), mesh, pretrained=False)
  batch = next(iter(evaluation.eval_batches(splits["val"], config, mesh)))
  moe_params, other_params = split_moe_weights(graphdef, state.params, state.model_state)
  sharded = [x for x in jax.tree.leaves(moe_params) if "expert" in str(x.sharding.spec)]
  assert sharded  # The experts' weights are split over the expert axis.
  cosines = batch_cosines_fn(graphdef, info.group_sizes, "pqd")
  with jax.set_mesh(mesh):
    hlo = cosines.lower(moe_params, other_params, state.model_state, batch).compile().as_text()
  m = len(info.group_sizes)
  moved = re.findall(r"= [a-z]\w*\[([\d,]*)\]\S* (?:all-gather|all-reduce)(?:-start)?\(", hlo)
  assert not [dims for dims in moved if dims.split(",")[0] == str(m)], moved
  # Whatever else is gathered (the routing of the batch's tokens) is less than one attribute's
  # gradient of the expert-sharded weights.
  moved_elements = sum(math.prod(int(d) for d in dims.split(",") if d) for dims in moved)
  assert moved_elements < sum(x.size for x in sharded), moved
