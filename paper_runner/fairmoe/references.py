"""Reference readers for the FairSMoE results tables: each predicts from the data alone and is
scored by `metrics.report_of_predictions` on the test split and the validation split.

  majority class  the training split's most frequent label (ties: the lowest class index);
  marker reader   (synthetic data) the class the corner marker shows;
  tint reader     (the testbed) the class its signal shows, with the generator's parameters:
                  `"role": "signal"`, what learning can reach (the others are floors);
  chance          a uniform guess: `CHANCE_DRAWS` seeded draws' reports under `"draws"`, whose
                  mean and 95% range a table shows. Its PQD is near 1: a fairness number means
                  something only beside it.
`with_controls` adds the controls of a claim on routing or gradients (`"role": "control"`;
it trains, so only the comparison tables ask for it): vanilla SMoE untrained (one step at
learning rate 0) and the routers that learn nothing, uniform and fixed.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Mapping

import ml_collections
import numpy as np

from fairmoe_jax.data import dataset_from_config, synthetic, synthetic_testbed
from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.metrics import fairness_report, report_of_predictions
from paper_runner.table_spec import CONTROL_ROLE, untrained_control

TEST, VALIDATION, TRAIN = "test", "val", "train"
# Draws of the chance reader: the 2.5% and 97.5% quantiles of 2,000 draws sit within about
# 0.01 (in probability) of the true ones, finer than a table's last printed digit needs.
CHANCE_DRAWS = 2000
CHANCE_SEED = 0
UNTRAINED_SEEDS = (0, 1, 2, 3, 4)  # The testbed tables' seeds.


def _score(split: Mapping[str, np.ndarray], predictions: np.ndarray, info: DatasetInfo) -> dict:
  names = (info.attribute_names, info.group_names, info.num_classes)
  return report_of_predictions(
      split["label"], predictions.astype(np.int32), split["attributes"], *names
  )


def _counts(
    labels: np.ndarray, predictions: np.ndarray, groups: np.ndarray, num_groups: int, k: int
) -> np.ndarray:
  """[D, num_groups, k, k] confusion counts of D rows of predictions at once: what
  `metrics.attribute_counts` counts for one row (an example whose group is negative, a missing
  attribute, is skipped as it skips it; tests/paper_runner/test_references.py checks they agree)."""
  draws = predictions.shape[0]
  keep = groups >= 0
  cell = (groups * k + labels) * k  # Without the prediction: added per draw below.
  offsets = np.arange(draws)[:, None] * (num_groups * k * k)  # Each draw's own counts.
  index = cell[keep][None, :] + predictions[:, keep] + offsets
  counts = np.bincount(index.ravel(), minlength=draws * num_groups * k * k)
  return counts.reshape(draws, num_groups, k, k).astype(np.float64)


def chance_draws(
    split: Mapping[str, np.ndarray], info: DatasetInfo, draws: int = CHANCE_DRAWS
) -> list[dict[str, Any]]:
  """`draws` reports of a uniform guess over the classes on `split`, each scored by the evaluation's
  own `fairness_report` (the metrics of counts, docs/design.md "Fairness metrics")."""
  labels = np.asarray(split["label"], np.int64)
  attributes = np.asarray(split["attributes"], np.int64)
  k = info.num_classes
  seed = zlib.crc32(labels.tobytes() + attributes.tobytes())
  rng = np.random.default_rng([CHANCE_SEED, seed])
  predictions = rng.integers(0, k, size=(draws, len(labels)))
  overall = _counts(labels, predictions, np.zeros_like(labels), 1, k)
  per_attribute = [
      _counts(labels, predictions, attributes[:, i], len(groups), k)
      for i, groups in enumerate(info.group_names)
  ]
  names = (info.attribute_names, info.group_names)
  return [
      fairness_report(overall[d, 0], [c[d] for c in per_attribute], *names) for d in range(draws)
  ]


def _rooted(config: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
  """`config` with a relative data root read from `base_dir` (the directory the runs started in)."""
  root = config["data"].get("root")
  if not root or os.path.isabs(os.path.expanduser(root)):
    return dict(config)
  return {**config, "data": {**config["data"], "root": os.path.join(base_dir, root)}}


def _load(config: Mapping[str, Any], base_dir: str) -> tuple[DatasetInfo, Any]:
  data = ml_collections.ConfigDict(_rooted(config, base_dir)["data"])
  if "preload" in data and data.name != "synthetic":
    data.preload = False  # Only the marker reader looks at pixels.
  return dataset_from_config(data)


def split_sizes(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, int]:
  """{"train", "validation", "test": examples} of the data of a run's saved `config`: what the
  corrected interval of a cross-validated table needs (its folds' test-to-train ratio)."""
  _, splits = _load(config, base_dir)
  names = {"train": TRAIN, "validation": VALIDATION, "test": TEST}
  return {name: len(splits[split]["label"]) for name, split in names.items()}


def reference_reports(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """{reader name: a report.json-shaped dict} for the data of a run's saved `config`; relative
  data paths are read from `base_dir` (the directory the runs started in)."""
  info, splits = _load(config, base_dir)
  k = info.num_classes
  majority = int(np.bincount(splits[TRAIN]["label"], minlength=k).argmax())
  majority_name = f"majority class of the training split ({info.class_names[majority]})"
  readers = {majority_name: lambda split: np.full(len(split["label"]), majority)}
  if info.name in ("synthetic", synthetic_testbed.NAME):  # Both carry the corner marker.
    readers["corner-marker reader"] = lambda split: synthetic.read_marker(split["image"], k)
  if info.name == synthetic_testbed.NAME:
    readers["tint reader (the signal, read with the generator's own directions)"] = (
        lambda split: synthetic_testbed.read_lesion_tint(split["image"], k)
    )
  signal = {name for name in readers if name.startswith("tint reader")}
  reports = {}
  for name, read in readers.items():
    reports[name] = {
        **_score(splits[TEST], read(splits[TEST]), info),
        "validation": _score(splits[VALIDATION], read(splits[VALIDATION]), info),
        **({"role": "signal"} if name in signal else {}),
    }
  # Each draw guesses on the test and the validation split; its report has both, as a run's.
  draws = [
      {**test, "validation": validation}
      for test, validation in zip(
          chance_draws(splits[TEST], info), chance_draws(splits[VALIDATION], info)
      )
  ]
  reports[f"chance ({k} classes, a uniform guess)"] = {"draws": draws}
  return reports


def with_controls(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """`reference_reports` and the controls' routing and gradient measures."""
  from fairmoe_jax import train  # Imports the model: only where the controls are trained.

  config = _rooted(config, base_dir)  # The controls train on the runs' data too.
  experts, top_k = config["moe"]["num_experts"], config["moe"]["top_k"]
  keys, vanilla = ("experts_active", "gradient_cosine"), {"method": "vanilla_smoe"}
  controls = {
      f"uniform router (all {experts} experts alike)": dict(experts_active={"choices": experts}),
      f"fixed router (every token to the same {top_k})": dict(experts_active={"choices": top_k}),
  }
  untrained = untrained_control(train.train_and_evaluate, config, vanilla, keys, UNTRAINED_SEEDS)
  return reference_reports(config) | {
      "vanilla SMoE untrained (1 step at learning rate 0)": untrained,
      **{name: dict(report, role=CONTROL_ROLE) for name, report in controls.items()},
  }
