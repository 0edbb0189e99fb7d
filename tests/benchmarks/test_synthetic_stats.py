"""Smoke test of scripts/synthetic_stats.py (the numbers in docs/dataset.md) on a small dataset."""

import importlib.util
import json
import shutil

import numpy as np
import pytest

from conftest import DENSE_RUN_STEPS, REPO_ROOT
from fairmoe_jax.data import synthetic


@pytest.fixture(scope="module")
def stats_module():
  path = REPO_ROOT / "scripts" / "synthetic_stats.py"
  spec = importlib.util.spec_from_file_location("synthetic_stats", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def stats(stats_module, tmp_path_factory):
  output = tmp_path_factory.mktemp("stats") / "stats.json"
  returned = stats_module.main(
      ["--seed=0", "--train-size=800", "--val-size=16", "--test-size=300", f"--output={output}"]
  )
  with open(output) as f:
    written = json.load(f)
  assert written == json.loads(json.dumps(returned))  # the JSON file holds what main returned
  return written


def test_group_sizes_add_up(stats):
  for split, size in {"train": 800, "val": 16, "test": 300}.items():
    for attr, groups in stats["group_sizes"][split].items():
      assert sum(groups.values()) == size, (split, attr)
  assert tuple(stats["group_sizes"]["train"]["site"]) == synthetic.SITE_GROUPS


def test_label_frequencies_are_distributions(stats):
  lf = stats["label_frequencies"]
  assert lf["split"] == "train"
  for attr in ("sex", "age", "site"):
    for group, v in lf[attr].items():
      for kind in ("measured", "expected"):
        assert len(v[kind]) == 4
        assert sum(v[kind]) == pytest.approx(1.0), (attr, group, kind)
  # The generator's age tilt: class 0 is more frequent in the youngest group than the oldest.
  assert lf["age"]["<30"]["expected"][0] > lf["age"]["75+"]["expected"][0]


def test_marker_agreement(stats):
  train = stats["marker_agreement"]["train"]
  decoding = train["decoding"]
  assert decoding["max_distance_to_nearest"] < decoding["min_distance_to_second"] / 4
  sites = train["measured"]["attributes"]["site"]["groups"]
  assert sites["anterior_torso"]["accuracy"] > sites["oral_genital"]["accuracy"] + 0.2
  # Measured from the images, it matches the generator's expected rate.
  assert train["measured"]["accuracy"] == pytest.approx(train["expected"]["all"], abs=0.06)
  assert train["expected"]["site"]["anterior_torso"] > train["expected"]["site"]["oral_genital"]


def test_logistic_regression_report(stats):
  lr = stats["logistic_regression"]
  test = lr["test"]
  assert test["num_examples"] == 300
  assert 0.25 < test["accuracy"] <= 1.0
  assert set(test["attributes"]) == {"sex", "age", "site"}
  assert 0.0 <= test["mf"]["pqd"] <= 1.0


def test_logistic_regression_fits_separable_data(stats_module):
  rng = np.random.default_rng(0)
  y = rng.integers(0, 3, 300)
  x = np.eye(3)[y] * 3 + rng.normal(0, 0.3, (300, 3))
  w = stats_module.fit_logistic_regression(x, y, 3, l2=1e-3)
  predictions = np.argmax(np.concatenate([x, np.ones((300, 1))], 1) @ w, axis=1)
  assert np.mean(predictions == y) == 1.0


def test_testbed_stats_have_the_oracle_reader(stats_module):
  stats = stats_module.compute(
      seed=0, sizes={"train": 600, "test": 300}, dataset="synthetic_testbed"
  )
  assert stats["dataset"]["name"] == "synthetic_testbed"
  oracle = stats["oracle_reader"]["test"]
  marker = stats["marker_agreement"]["test"]["measured"]
  assert oracle["num_examples"] == 300
  assert oracle["accuracy"] > marker["accuracy"] + 0.1
  assert "Oracle reader (test)" in stats_module.format_stats(stats)
  with pytest.raises(ValueError, match="dataset"):
    stats_module.compute(seed=0, sizes={"train": 10, "test": 10}, dataset="celeba")


@pytest.mark.slow
def test_a_trained_run_s_predictions_are_the_run_s_own(stats_module, dense_run, tmp_path):
  """--workdir restores the run and predicts the test split as the run's evaluation did (it once
  fed the model raw uint8 pixels, which the run normalises inside its step, and reported a
  wrong accuracy). The run is the session's dense one, trained without cues (tests/conftest.py)."""
  workdir = shutil.copytree(dense_run.workdir, tmp_path / "run")  # Its config.json is changed.
  sizes = {"train_size": 512, "val_size": 64, "test_size": 128}
  _, splits = synthetic.load_synthetic(
      image_size=32, num_classes=4, seed=0, sizes={"train": 512, "val": 64, "test": 128}
  )
  predictions, step, probabilities = stats_module.model_predictions(
      str(workdir), splits["test"], sizes
  )
  with open(workdir / "predictions.csv") as f:
    header, *rows = [line.rstrip("\n").split(",") for line in f]
  recorded = np.array([int(row[header.index("prediction")]) for row in rows])
  recorded_probabilities = np.array(
      [[float(row[header.index(f"prob_{c}")]) for c in range(4)] for row in rows]
  )
  assert step == DENSE_RUN_STEPS
  np.testing.assert_array_equal(predictions, recorded)
  # A run on the tinted images (the quickstart's default) is refused, not predicted untinted.
  config = json.loads((workdir / "config.json").read_text())
  config["data"]["attribute_cues"] = True
  (workdir / "config.json").write_text(json.dumps(config))
  with pytest.raises(SystemExit, match="attribute cues"):
    stats_module.model_predictions(str(workdir), splits["test"], sizes)
  # A 4-step model may answer one class for every image; its probabilities still tell.
  np.testing.assert_allclose(probabilities, recorded_probabilities, atol=1e-5)
