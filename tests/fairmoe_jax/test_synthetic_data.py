"""Tests of the generated fairness benchmark (fairmoe_jax/data/synthetic.py)."""

import hashlib

import ml_collections
import numpy as np
import pytest

from fairmoe_jax import config as config_lib
from fairmoe_jax import data as data_lib
from fairmoe_jax import preflight
from fairmoe_jax.data import synthetic
from fairmoe_jax.data.types import DatasetInfo
from trainkit.errors import UserError

SEX, AGE, SITE = 0, 1, 2


@pytest.fixture(scope="module")
def default_data():
  return synthetic.load_synthetic()


@pytest.fixture(scope="module")
def train(default_data):
  return default_data[1]["train"]


def _small(**kwargs):
  return synthetic.load_synthetic(sizes={"train": 300, "val": 50}, **kwargs)[1]


def _marker_class(images: np.ndarray, num_classes: int) -> np.ndarray:
  """Class whose palette colour is nearest to the centre of the corner marker."""
  centre = images[:, 3:5, 3:5].astype(np.float32).mean((1, 2))
  palette = synthetic.marker_palette(num_classes)
  return np.argmin(((centre[:, None] - palette[None]) ** 2).sum(-1), axis=1)


def _group_means(values: np.ndarray, groups: np.ndarray, num_groups: int) -> np.ndarray:
  return np.array([values[groups == g].mean() for g in range(num_groups)])


def test_info_and_shapes(default_data):
  info, splits = default_data
  assert info.name == "synthetic"
  assert info.num_classes == 4 and len(info.class_names) == 4
  assert info.attribute_names == ("sex", "age", "site")
  assert info.group_sizes == (2, 5, 8)
  assert info.image_size == 32
  assert {k: len(v["label"]) for k, v in splits.items()} == {
      "train": 8000,
      "val": 1000,
      "test": 2000,
  }
  for split in splits.values():
    n = len(split["label"])
    assert split["image"].shape == (n, 32, 32, 3) and split["image"].dtype == np.uint8
    assert split["label"].dtype == np.int32 and split["attributes"].dtype == np.int32
    assert split["attributes"].shape == (n, 3)
    assert 0 <= split["label"].min() and split["label"].max() < 4
    for j, cardinality in enumerate(info.group_sizes):
      column = split["attributes"][:, j]
      assert column.min() == 0 and column.max() == cardinality - 1  # no missing


def test_same_seed_same_data_different_seed_different_data():
  a, b, c = _small(seed=0), _small(seed=0), _small(seed=1)
  for split in a:
    for key in a[split]:
      np.testing.assert_array_equal(a[split][key], b[split][key])
  assert not np.array_equal(a["train"]["image"], c["train"]["image"])
  assert not np.array_equal(a["train"]["label"], c["train"]["label"])


def test_splits_have_independent_seeds():
  small = _small()
  grown = synthetic.load_synthetic(sizes={"train": 1500, "val": 50})[1]
  for key in small["val"]:
    np.testing.assert_array_equal(small["val"][key], grown["val"][key])
    # Growing a split keeps the examples it already had.
    np.testing.assert_array_equal(small["train"][key], grown["train"][key][:300])
  assert not np.array_equal(small["train"]["image"][:50], small["val"]["image"])


def test_image_size_num_classes_and_empty_split():
  info, splits = synthetic.load_synthetic(
      image_size=48, num_classes=3, sizes={"test": 70, "empty": 0}
  )
  assert info.image_size == 48 and info.num_classes == 3
  assert info.class_names == ("stripes_00deg", "stripes_45deg", "stripes_90deg")
  assert splits["test"]["image"].shape == (70, 48, 48, 3)
  assert splits["test"]["label"].max() <= 2
  assert splits["empty"]["image"].shape == (0, 48, 48, 3)
  with pytest.raises(ValueError):
    synthetic.load_synthetic(num_classes=1)


def test_missing_rate_only_hides_attributes():
  full = _small()["train"]
  partial = _small(missing_rate=0.3)["train"]
  np.testing.assert_array_equal(full["image"], partial["image"])
  np.testing.assert_array_equal(full["label"], partial["label"])
  missing = partial["attributes"] == -1
  assert 0.2 < missing.mean() < 0.4
  np.testing.assert_array_equal(partial["attributes"][~missing], full["attributes"][~missing])


def test_groups_are_imbalanced(train):
  for j, min_ratio in [(SEX, 1.1), (AGE, 3.0), (SITE, 4.0)]:
    counts = np.bincount(train["attributes"][:, j])
    assert counts.max() / counts.min() > min_ratio


def test_label_distribution_depends_on_age_and_site(train):
  label = train["label"]
  overall = np.bincount(label, minlength=4) / len(label)
  for j in (AGE, SITE):
    column = train["attributes"][:, j]
    conditional = np.stack(
        [
            np.bincount(label[column == g], minlength=4) / (column == g).sum()
            for g in range(column.max() + 1)
        ]
    )
    total_variation = 0.5 * np.abs(conditional - overall).sum(-1)
    assert total_variation.max() > 0.15
    weights = np.bincount(column) / len(column)
    mutual_info = np.sum(weights[:, None] * conditional * np.log(conditional / overall))
    assert mutual_info > 0.03


def test_corner_marker_is_a_group_dependent_shortcut(train):
  agrees = (_marker_class(train["image"], 4) == train["label"]).astype(np.float64)
  assert agrees.mean() > 0.55  # chance is 0.25
  by_site = _group_means(agrees, train["attributes"][:, SITE], 8)
  by_sex = _group_means(agrees, train["attributes"][:, SEX], 2)
  assert by_site[:2].min() > 0.7 and by_site[-1] < 0.4
  assert by_sex[1] - by_sex[0] > 0.1


def test_difficulty_depends_on_site_and_age(train):
  images = train["image"].astype(np.float32)
  # The marker interior is flat before noise, so its spread measures the noise.
  noise = images[:, 2:6, 2:6].std((1, 2)).mean(-1)
  noise_by_site = _group_means(noise, train["attributes"][:, SITE], 8)
  assert np.all(np.diff(noise_by_site) > 0)
  assert noise_by_site[-1] > 2.5 * noise_by_site[0]
  # The image centre lies inside the lesion; its spread is the stripe contrast
  # (plus noise, which does not depend on age).
  contrast = images.mean(-1)[:, 10:22, 10:22].std((1, 2))
  contrast_by_age = _group_means(contrast, train["attributes"][:, AGE], 5)
  assert np.all(np.diff(contrast_by_age) < 0)
  assert contrast_by_age[0] > 1.25 * contrast_by_age[-1]


def test_label_probs_are_distributions():
  probs = synthetic.label_probs(5)
  assert probs.shape == (5, 8, 5)
  np.testing.assert_allclose(probs.sum(-1), 1.0)


def test_dataset_info_validation():
  info = synthetic.synthetic_info()
  assert info.num_attributes == 3
  with pytest.raises(ValueError):
    DatasetInfo("x", 3, ("a", "b"), ("s",), (("m", "f"),), 32)
  with pytest.raises(ValueError):
    DatasetInfo("x", 2, ("a", "b"), ("s", "t"), (("m", "f"),), 32)


def test_registry():
  info, splits = data_lib.get_dataset("synthetic", sizes={"val": 10}, seed=3)
  assert info.name == "synthetic" and list(splits) == ["val"]
  np.testing.assert_array_equal(
      splits["val"]["image"], synthetic.load_synthetic(sizes={"val": 10}, seed=3)[1]["val"]["image"]
  )
  with pytest.raises(ValueError, match="synthetic"):
    data_lib.get_dataset("imagenet")


@pytest.mark.parametrize("name", ["synthetic", "synthetic_testbed"])
def test_data_sensitive_selects_the_generated_attributes_or_is_one_line(name):
  data = config_lib.base_config().data
  data.update(name=name, image_size=8, train_size=8, val_size=4, test_size=4, sensitive="age,sex")
  info, splits = data_lib.dataset_from_config(data)
  assert info.attribute_names == ("age", "sex") and info == preflight.dataset_info(
      ml_collections.ConfigDict({"data": data})
  )
  full = data_lib.GENERATED_INFO[name](8, data.num_classes)
  assert info.group_names == (full.group_names[1], full.group_names[0])
  data.sensitive = ""
  _, all_splits = data_lib.dataset_from_config(data)
  np.testing.assert_array_equal(
      splits["test"]["attributes"], all_splits["test"]["attributes"][:, [1, 0]]
  )
  for bad in ("sex,sex", "sex,skin"):
    data.sensitive = bad
    with pytest.raises(UserError, match=f"^data.sensitive=.*{name}: expected distinct names"):
      data_lib.dataset_from_config(data)


@pytest.mark.parametrize(
    "kwargs, digest",
    [
        (
            dict(sizes={"val": 300}, seed=0),
            "d5a7017c0fef111ccbc11fa6e108da99ee4b09b87425a7d6218d3b8f46b3f1e8",
        ),
        (
            dict(sizes={"test": 100}, seed=1, image_size=48, num_classes=3, missing_rate=0.2),
            "eed9dc1b091c62342b10b1546c0bd044fe6cc7155a5ffe79bca9eb27cc56ffc3",
        ),
    ],
)
def test_data_are_those_the_recorded_tables_were_made_on(kwargs, digest):
  """Recorded results (docs/, results/) were measured on these exact images: a change to the
  generator, or to the helpers it shares with synthetic_testbed, must not alter one byte."""
  split = next(iter(synthetic.load_synthetic(**kwargs)[1].values()))
  h = hashlib.sha256()
  for key in ("image", "label", "attributes"):
    h.update(split[key].tobytes())
  assert h.hexdigest() == digest


def _linear_probe_accuracy(train: dict, test: dict, attribute: int, num_groups: int) -> float:
  """A ridge-regression linear probe (one-hot targets) on 8x8-downsampled pixels: trained on
  `train`, its accuracy at reading `attribute` from `test`'s images alone."""

  def features(images):
    n, size = images.shape[:2]
    pooled = images.astype(np.float64).reshape(n, 8, size // 8, 8, size // 8, 3).mean((2, 4))
    return pooled.reshape(n, -1)

  x = features(train["image"])
  mean, std = x.mean(0), x.std(0) + 1e-6
  design = lambda f: np.c_[(f - mean) / std, np.ones(len(f))]
  x = design(x)
  targets = np.eye(num_groups)[train["attributes"][:, attribute]]
  weights = np.linalg.solve(x.T @ x + 0.1 * np.eye(x.shape[1]), x.T @ targets)
  predicted = (design(features(test["image"])) @ weights).argmax(1)
  return float((predicted == test["attributes"][:, attribute]).mean())


def test_the_quickstart_s_sensitive_attributes_can_be_read_from_its_images(repo_root):
  # FGR routes by group only if its classifiers can tell the groups apart: on the quickstart's
  # data a linear probe reads every attribute well above the majority rate (always answering
  # the largest group). The margin is three binomial standard errors of that rate over the test
  # images, so a probe at the majority rate passes by chance with probability about 0.1%.
  import importlib.util

  spec = importlib.util.spec_from_file_location("quickstart", repo_root / "configs/quickstart.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(None)
  config.data.train_size, config.data.val_size, config.data.test_size = 3000, 10, 1000
  info, splits = data_lib.dataset_from_config(config.data)
  train, test = splits["train"], splits["test"]
  for a, (name, groups) in enumerate(zip(info.attribute_names, info.group_names)):
    counts = np.bincount(test["attributes"][:, a], minlength=len(groups))
    majority = counts.max() / counts.sum()
    margin = 3 * np.sqrt(majority * (1 - majority) / counts.sum())
    accuracy = _linear_probe_accuracy(train, test, a, len(groups))
    assert accuracy > majority + margin, (name, accuracy, majority, margin)
  # Without the cues (the original benchmark, cues=false) only sex's hair says anything.
  _, plain = synthetic.load_synthetic(sizes={"train": 3000, "test": 1000})
  site = _linear_probe_accuracy(plain["train"], plain["test"], SITE, len(synthetic.SITE_GROUPS))
  counts = np.bincount(plain["test"]["attributes"][:, SITE])
  assert site < counts.max() / counts.sum() + 3 * np.sqrt(0.25 * 0.75 / 1000)


def test_attribute_cues_change_only_the_colours():
  # The cues draw no random numbers: labels, attributes and the corner marker are the
  # original data's, and the images differ only by each group's colour cast.
  plain = _small(seed=2)
  cued = synthetic.load_synthetic(sizes={"train": 300, "val": 50}, seed=2, attribute_cues=True)[1]
  for split in ("train", "val"):
    np.testing.assert_array_equal(plain[split]["label"], cued[split]["label"])
    np.testing.assert_array_equal(plain[split]["attributes"], cued[split]["attributes"])
    np.testing.assert_array_equal(
        synthetic.read_marker(plain[split]["image"], 4),
        synthetic.read_marker(cued[split]["image"], 4),
    )
    assert not np.array_equal(plain[split]["image"], cued[split]["image"])
