"""Reference readers: what a FairSMoE results table's numbers are read against.

A test accuracy of 63% says nothing until one knows that always answering the training split's
most frequent class scores 72% on that test split, or that reading only the synthetic images'
corner marker scores 63%. Each reader here predicts from the data alone, without a model, and is
scored by the evaluation's own count code (`metrics.report_of_predictions`) on the test split
(report.json's top level) and the validation split (its `validation` entry), so a results table
(`experiments.tables`, a spec's `TABLE["references"]`) prints its rows beside the models':

  majority class  the training split's most frequent label (on a tie, the lowest class index),
                  for every example (its PQD is 1
                  when every group has the same accuracy, which a constant answer need not
                  give: the groups' label mixes differ);
  marker reader   (synthetic data, both kinds) the class the corner marker shows
                  (`synthetic.read_marker`);
  tint reader     (the testbed) the class its signal shows, read with the generator's own
                  parameters (`synthetic_testbed.read_lesion_tint`): what learning the task
                  can reach, the bar a model is read against;
  chance          a uniform guess: accuracy 1 / classes in expectation; no fairness numbers.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import ml_collections
import numpy as np

from fairmoe_jax.data import dataset_from_config, synthetic, synthetic_testbed
from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.metrics import report_of_predictions

TEST, VALIDATION, TRAIN = "test", "val", "train"


def _score(split: Mapping[str, np.ndarray], predictions: np.ndarray, info: DatasetInfo) -> dict:
  return report_of_predictions(
      split["label"],
      predictions.astype(np.int32),
      split["attributes"],
      info.attribute_names,
      info.group_names,
      info.num_classes,
  )


def reference_reports(config: Mapping[str, Any], base_dir: str = ".") -> dict[str, dict[str, Any]]:
  """{reader name: a report.json-shaped dict} for the data of a run's saved `config`; relative
  data paths are read from `base_dir` (the directory the runs started in)."""
  data = ml_collections.ConfigDict(dict(config["data"]))
  if data.get("root") and not os.path.isabs(os.path.expanduser(data.root)):
    data.root = os.path.join(base_dir, data.root)
  if "preload" in data and data.name != "synthetic":
    data.preload = False  # Only the marker reader looks at pixels.
  info, splits = dataset_from_config(data)
  k = info.num_classes
  majority = int(np.bincount(splits[TRAIN]["label"], minlength=k).argmax())
  readers = {
      f"majority class of the training split ({info.class_names[majority]})": (
          lambda split: np.full(len(split["label"]), majority)
      ),
  }
  if info.name in ("synthetic", synthetic_testbed.NAME):  # Both carry the corner marker.
    readers["corner-marker reader"] = lambda split: synthetic.read_marker(split["image"], k)
  if info.name == synthetic_testbed.NAME:
    readers["tint reader (the signal, read with the generator's own directions)"] = (
        lambda split: synthetic_testbed.read_lesion_tint(split["image"], k)
    )
  reports = {}
  for name, read in readers.items():
    reports[name] = {
        **_score(splits[TEST], read(splits[TEST]), info),
        "validation": _score(splits[VALIDATION], read(splits[VALIDATION]), info),
    }
  reports[f"chance ({k} classes, a uniform guess)"] = {
      "accuracy": 1.0 / k,
      "validation": {"accuracy": 1.0 / k},
  }
  return reports
