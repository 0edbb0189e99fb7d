"""Tests of the synthetic testbed (fairmoe_jax/data/synthetic_testbed.py): the properties its
design promises (docs/dataset.md, "The synthetic testbed"), checked on the generated data."""

import importlib.util

import numpy as np
import pytest

from conftest import REPO_ROOT
from fairmoe_jax import data as data_lib
from fairmoe_jax.config import quickstart_config, validate
from fairmoe_jax.data import synthetic
from fairmoe_jax.data import synthetic_testbed as testbed

SEX, AGE, SITE = 0, 1, 2
ROOT = REPO_ROOT


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def train(request):
  return testbed.load_synthetic_testbed(sizes={"train": 8000}, seed=request.param)[1]["train"]


def _marker_reader(images: np.ndarray, num_classes: int) -> np.ndarray:
  """Reads the corner marker as scripts/synthetic_stats.py does: the palette colour nearest the
  mean of the marker square's interior."""
  m = synthetic.marker_side(images.shape[1])
  colour = images[:, 2:m, 2:m].astype(np.float64).mean(axis=(1, 2))
  palette = synthetic.marker_palette(num_classes).astype(np.float64)
  return np.argmin(((colour[:, None] - palette[None]) ** 2).sum(-1), axis=1)


def _group_accuracies(correct: np.ndarray, groups: np.ndarray) -> np.ndarray:
  return np.array([correct[groups == g].mean() for g in range(groups.max() + 1)])


def _gap(correct: np.ndarray, groups: np.ndarray) -> float:
  """Largest minus smallest group accuracy."""
  accuracies = _group_accuracies(correct, groups)
  return float(accuracies.max() - accuracies.min())


def _expected_tint_accuracy(amplitude: np.ndarray, num_classes: int) -> np.ndarray:
  """Reference P(correct) of reading the drawn tint (amplitude along the class direction plus
  isotropic jitter) by its nearest class direction, per example: Monte Carlo in float64 with a
  fixed seed, independent of the images."""
  jitter = testbed.TINT_JITTER * np.random.default_rng(0).standard_normal((20000, 2))
  directions = testbed.tint_directions(num_classes)
  table = {
      a: np.mean(np.argmax((a * directions[0] + jitter) @ directions.T, axis=1) == 0)
      for a in np.unique(amplitude)
  }
  return np.array([table[a] for a in amplitude])


def test_info_shapes_and_registry():
  info, splits = data_lib.get_dataset("synthetic_testbed", sizes={"train": 300, "val": 20})
  assert info.name == "synthetic_testbed" and info.group_sizes == (2, 5, 8)
  assert info.attribute_names == ("sex", "age", "site")
  assert info.class_names == ("tint_000deg", "tint_090deg", "tint_180deg", "tint_270deg")
  assert splits["train"]["image"].shape == (300, 32, 32, 3)
  assert splits["train"]["image"].dtype == np.uint8
  assert splits["val"]["label"].dtype == np.int32 and splits["val"]["attributes"].shape == (20, 3)
  assert data_lib.GENERATED_INFO["synthetic_testbed"](32, 4) == info


def test_same_seed_same_data_and_the_old_synthetic_data_differs():
  a = testbed.load_synthetic_testbed(sizes={"val": 200}, seed=0)[1]["val"]
  b = testbed.load_synthetic_testbed(sizes={"val": 200}, seed=0)[1]["val"]
  c = testbed.load_synthetic_testbed(sizes={"val": 200}, seed=1)[1]["val"]
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(a["image"], c["image"])
  old = synthetic.load_synthetic(sizes={"val": 200}, seed=0)[1]["val"]
  # The same seeds draw the same groups and labels; only the images differ.
  np.testing.assert_array_equal(a["attributes"], old["attributes"])
  np.testing.assert_array_equal(a["label"], old["label"])
  assert not np.array_equal(a["image"], old["image"])


def test_other_sizes_and_missing_attributes():
  info, splits = testbed.load_synthetic_testbed(
      image_size=48, num_classes=3, sizes={"test": 400}, missing_rate=0.3
  )
  assert info.num_classes == 3 and splits["test"]["image"].shape == (400, 48, 48, 3)
  missing = splits["test"]["attributes"] == -1
  assert 0.2 < missing.mean() < 0.4
  # The oracle reader works at any size and number of classes.
  read = testbed.read_lesion_tint(splits["test"]["image"], 3)
  assert np.mean(read == splits["test"]["label"]) > 0.75
  with pytest.raises(ValueError, match="num_classes"):
    testbed.load_synthetic_testbed(num_classes=1)


def test_oracle_reader_reads_the_drawn_signal(train):
  """Read from the images, the tint is as accurate as the generator's design says: per site and
  age group, the oracle's accuracy matches a float64 reference that never sees an image."""
  attributes = train["attributes"]
  correct = testbed.read_lesion_tint(train["image"], 4) == train["label"]
  expected = _expected_tint_accuracy(
      testbed.signal_amplitude(attributes[:, AGE], attributes[:, SITE]), 4
  )
  assert correct.mean() == pytest.approx(expected.mean(), abs=0.02)
  for column in (AGE, SITE):
    measured = _group_accuracies(correct, attributes[:, column])
    reference = _group_accuracies(expected, attributes[:, column])
    counts = np.bincount(attributes[:, column])
    # Four binomial standard errors of each group's measured accuracy, at least 0.02.
    tolerance = np.maximum(4 * np.sqrt(reference * (1 - reference) / counts), 0.02)
    assert np.all(np.abs(measured - reference) < tolerance), (column, measured, reference)


def test_the_task_needs_more_than_the_marker(train):
  labels = train["label"]
  marker = np.mean(_marker_reader(train["image"], 4) == labels)
  oracle = np.mean(testbed.read_lesion_tint(train["image"], 4) == labels)
  majority = np.bincount(labels).max() / len(labels)
  assert 0.55 < marker < 0.75  # the marker is a shortcut: right on about two images in three
  assert oracle > marker + 0.15  # the signal is clearly better
  assert marker > majority + 0.25  # and the marker is still worth learning


def test_attributes_differ_in_difficulty(train):
  """The oracle reader's accuracy gap across groups: close to zero for sex, large for age,
  larger for site (the paper's Sec. 3.1: attributes differ in how hard they are)."""
  correct = testbed.read_lesion_tint(train["image"], 4) == train["label"]
  names = ("sex", "age", "site")
  gaps = {name: _gap(correct, train["attributes"][:, j]) for j, name in enumerate(names)}
  assert gaps["sex"] < 0.04, gaps
  assert gaps["age"] > 0.1, gaps
  assert gaps["site"] > gaps["age"] + 0.1, gaps
  # Rarer sites and older groups are harder, not only some of them.
  by_site = _group_accuracies(correct, train["attributes"][:, SITE])
  assert by_site[:2].min() > by_site[-2:].max() + 0.15
  by_age = _group_accuracies(correct, train["attributes"][:, AGE])
  assert by_age[:3].min() > by_age[-1] + 0.05


def test_config_file_loads_the_testbed():
  spec = importlib.util.spec_from_file_location("cfg", ROOT / "configs" / "synthetic_testbed.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("experts=8")
  validate(config, num_devices=1)
  assert config.data.name == "synthetic_testbed" and config.moe.num_experts == 8
  # The quickstart's run in all but the data.
  quickstart = quickstart_config("experts=8")
  quickstart.data.name = "synthetic_testbed"
  quickstart.data.attribute_cues = False  # The quickstart's colour casts are the synthetic data's.
  assert config.to_dict() == quickstart.to_dict()
  config.data.train_size, config.data.val_size, config.data.test_size = 300, 10, 20
  info, splits = data_lib.dataset_from_config(config.data)
  assert info.name == "synthetic_testbed" and len(splits["train"]["label"]) == 300
