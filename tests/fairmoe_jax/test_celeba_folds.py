"""Identity-grouped k-fold cross-validation of CelebA (fairmoe_jax/data/celeba.py) and the pooled
score over the folds (fairmoe_jax/metrics/pooling.py), on tiny layouts and the real sample."""

import collections
import csv
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import FAIR_TINY_ARGS, ONE_DEVICE_XLA_FLAGS, REPO_ROOT, SHARED_DATA
from fairmoe_jax import config as config_lib
from fairmoe_jax.data import celeba, dataset_from_config
from fairmoe_jax.metrics import pooling
from trainkit.errors import ConfigError, UserError

CELEBA = SHARED_DATA / "celeba"
_SPEC = importlib.util.spec_from_file_location("celeba_config", REPO_ROOT / "configs" / "celeba.py")
celeba_config = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(celeba_config)


def _celeba_target():
  """scripts/celeba_target.py as a module, loaded once (it defines absl flags)."""
  if "celeba_target" not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        "celeba_target", REPO_ROOT / "scripts" / "celeba_target.py"
    )
    sys.modules["celeba_target"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["celeba_target"])
  return sys.modules["celeba_target"]


needs_celeba = pytest.mark.skipif(
    not (CELEBA / "identity_CelebA.txt").is_file(),
    reason=f"real CelebA sample with identity_CelebA.txt not found at {CELEBA}",
)

# A tiny layout: identity -> number of images, uneven so the dealing has something to balance.
IDENTITY_SIZES = {"7": 5, "3": 4, "11": 3, "5": 3, "2": 2, "13": 2, "1": 1, "9": 1}


def write_fold_layout(root: pathlib.Path) -> dict[str, str]:
  """Writes an official-format layout with an identity file; returns {image: identity}."""
  (root / "img_align_celeba").mkdir(parents=True)
  identity_of, rows = {}, []
  number = 0
  for identity, size in IDENTITY_SIZES.items():
    for _ in range(size):
      number += 1
      image = f"{number:06d}.jpg"
      identity_of[image] = identity
      # Attractive alternates, Male is the identity's parity: values to check against the file.
      rows.append(f"{image} {1 if number % 2 else -1:2d} {1 if int(identity) % 2 else -1:2d}")
      Image.new("RGB", (18, 22), (number, 100, 30)).save(root / "img_align_celeba" / image)
  (root / "list_attr_celeba.txt").write_text(
      "\n".join([str(number), "Attractive Male", *rows]) + "\n"
  )
  (root / "identity_CelebA.txt").write_text("".join(f"{i} {p}\n" for i, p in identity_of.items()))
  return identity_of


def load_fold(root, fold, num_folds=3, **kwargs):
  return celeba.load_celeba(
      root=str(root),
      sensitive=("Male",),
      image_size=8,
      preload=False,
      num_folds=num_folds,
      fold=fold,
      **kwargs,
  )


def images_of(split) -> list[str]:
  return [os.path.basename(p) for p in split["path"]]


def test_folds_partition_the_images_by_identity(tmp_path):
  identity_of = write_fold_layout(tmp_path)
  num_folds = 3
  test_images, val_images = [], []
  for fold in range(num_folds):
    info, splits = load_fold(tmp_path, fold, num_folds)
    parts = {name: images_of(split) for name, split in splits.items()}
    # Every image is in exactly one of the run's three splits ...
    assert sorted(sum(parts.values(), [])) == sorted(identity_of)
    # ... and no identity is in two of them.
    identities = {name: {identity_of[i] for i in images} for name, images in parts.items()}
    assert not identities["train"] & identities["val"]
    assert not identities["train"] & identities["test"]
    assert not identities["val"] & identities["test"]
    assert info.load_stats["identities"] == len(IDENTITY_SIZES)
    assert info.load_stats["test_identities"] == len(identities["test"])
    # Labels and attributes are the file's (rows keep the attribute file's order).
    for name, split in splits.items():
      numbers = [int(i[:6]) for i in parts[name]]
      assert numbers == sorted(numbers)
      np.testing.assert_array_equal(split["label"], [n % 2 for n in numbers])
      np.testing.assert_array_equal(
          split["attributes"][:, 0], [int(identity_of[i]) % 2 for i in parts[name]]
      )
    test_images += parts["test"]
    val_images += parts["val"]
    # The validation split of fold f is the test split of fold f + 1 (mod k).
    _, following = load_fold(tmp_path, (fold + 1) % num_folds, num_folds)
    assert parts["val"] == images_of(following["test"])
  # Over the k runs every image is tested once (and validates once).
  assert sorted(test_images) == sorted(identity_of) == sorted(val_images)


def test_folds_are_balanced_deterministic_and_independent_of_order():
  identities = [name for name, size in IDENTITY_SIZES.items() for _ in range(size)]
  folds = celeba.identity_folds(identities, 3)
  assert set(folds) == set(IDENTITY_SIZES) and set(folds.values()) == {0, 1, 2}
  sizes = [sum(IDENTITY_SIZES[i] for i, f in folds.items() if f == fold) for fold in range(3)]
  assert sorted(sizes) == [7, 7, 7]  # 21 images: an exact balance exists, and is found.
  rng = np.random.default_rng(0)
  for _ in range(3):  # The same identities in any order, any number of times: the same folds.
    assert celeba.identity_folds(list(rng.permutation(identities)), 3) == folds
  # Many equal identities: sizes differ by at most one identity.
  many = [f"p{i}" for i in range(23) for _ in range(4)]
  counts = collections.Counter(celeba.identity_folds(many, 5).values())
  assert max(counts.values()) - min(counts.values()) <= 1


@pytest.mark.parametrize(
    "edit, kwargs, pattern",
    [
        (
            lambda root: (root / "identity_CelebA.txt").unlink(),
            {},
            r"identity_CelebA.txt does not exist",
        ),
        (
            lambda root: (root / "identity_CelebA.txt").write_text(
                "".join(
                    line + "\n"
                    for line in (root / "identity_CelebA.txt").read_text().splitlines()
                    if not line.startswith("000004.jpg")
                )
            ),
            {},
            r"identity_CelebA.txt: 1 image\(s\) .* no identity \(000004.jpg\)",
        ),
        (
            lambda root: (root / "identity_CelebA.txt").write_text("000001.jpg 7\n000002.jpg\n"),
            {},
            r"identity_CelebA.txt:2: expected 'image identity'",
        ),
        (lambda root: None, dict(fold=3), r"fold 3 is outside 0..2"),
        (lambda root: None, dict(num_folds=2, fold=0), r"num_folds >= 3"),
        (
            lambda root: None,
            dict(num_folds=9, fold=0),
            r"9 identity folds need at least 9 identities; the images have 8",
        ),
    ],
)
def test_bad_fold_input_is_one_user_error(tmp_path, edit, kwargs, pattern):
  write_fold_layout(tmp_path)
  edit(tmp_path)
  with pytest.raises(UserError, match=pattern):
    load_fold(tmp_path, **{"fold": 0, **kwargs})


def test_config_split_argument_and_its_validation(tmp_path):
  official = celeba_config.get_config("size=small")
  assert "identity_folds" not in official.data  # Official-partition configs keep their keys.
  assert official.data.sensitive == "Male,Chubby,Goatee"
  folds = celeba_config.get_config("size=small,split=identity_folds,fold=2")
  assert folds.data.identity_folds.to_dict() == {"num_folds": 5, "fold": 2}
  assert folds.data.sensitive == "Male,Chubby,Goatee"
  with pytest.raises(ConfigError, match="'split': must be one of official, identity_folds"):
    celeba_config.get_config("split=random")
  with pytest.raises(ConfigError, match="'fold': selects a test fold of split=identity_folds"):
    celeba_config.get_config("fold=1")
  folds.data.root = str(tmp_path)
  config_lib.validate(folds, num_devices=1)
  folds.data.identity_folds.fold = 5
  with pytest.raises(ConfigError, match=r"'data.identity_folds.fold': must be <= 4"):
    config_lib.validate(folds, num_devices=1)
  folds.data.identity_folds.update(fold=0, num_folds=2)
  with pytest.raises(ConfigError, match=r"'data.identity_folds.num_folds': must be >= 3"):
    config_lib.validate(folds, num_devices=1)
  folds.data.identity_folds.num_folds = 5
  folds.data.name = "celeba_tfds"
  folds.data.tfds_data_dir = str(tmp_path)
  with pytest.raises(
      ConfigError, match=r"'data.identity_folds': .* must be celeba, not celeba_tfds"
  ):
    config_lib.validate(folds, num_devices=1)


def test_config_reaches_the_loader(tmp_path):
  write_fold_layout(tmp_path)
  config = celeba_config.get_config("size=small,split=identity_folds,fold=1")
  config.data.update(root=str(tmp_path), sensitive="Male", preload=False)
  config.data.identity_folds.num_folds = 3
  _, splits = dataset_from_config(config.data)
  _, direct = load_fold(tmp_path, 1, 3)
  for name in ("train", "val", "test"):
    assert images_of(splits[name]) == images_of(direct[name])


@needs_celeba
def test_real_sample_folds():
  identity_of = dict(
      line.split() for line in (CELEBA / "identity_CelebA.txt").read_text().splitlines() if line
  )
  tested = collections.Counter()
  totals = np.zeros(3, np.int64)
  for fold in range(5):
    info, splits = celeba.load_celeba(
        root=str(CELEBA), image_size=32, preload=False, num_folds=5, fold=fold
    )
    assert info.attribute_names == ("Male", "Chubby", "Goatee")
    people = {name: {identity_of[i] for i in images_of(s)} for name, s in splits.items()}
    assert not (people["train"] & people["val"] or people["train"] & people["test"])
    assert not people["val"] & people["test"]
    assert sum(len(s["label"]) for s in splits.values()) == 3198
    tested.update(images_of(splits["test"]))
    totals += splits["test"]["attributes"].sum(axis=0)
  assert set(tested.values()) == {1} and len(tested) == 3198
  # Every Male, Chubby and Goatee face of the sample is tested once (README of the shared data).
  np.testing.assert_array_equal(totals, [950, 133, 178])
  sizes = collections.Counter(identity_of[i] for i in tested)
  fold_images = collections.Counter(
      celeba.identity_folds([identity_of[i] for i in tested], 5)[p] for p in identity_of.values()
  )
  # 106 people of 30 photos and 18 of one: the folds differ by at most one person's photos.
  assert max(fold_images.values()) - min(fold_images.values()) <= max(sizes.values())
  assert sum(fold_images.values()) == 3198


# Pooling.
def write_run(run_dir: pathlib.Path, rows, groups=("not_Male", "Male")) -> None:
  """A finished run's report.json and predictions.csv; rows are (image, label, prediction, group)."""
  run_dir.mkdir(parents=True)
  report = {
      "class_names": ["not_Attractive", "Attractive"],
      "attributes": {"Male": {"groups": {g: {} for g in groups}, "empty_groups": []}},
  }
  (run_dir / "report.json").write_text(json.dumps(report))
  with open(run_dir / "predictions.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["example_id", "label", "prediction", "prob_0", "prob_1", "Male"])
    for image, label, prediction, group in rows:
      writer.writerow([image, label, prediction, 0.5, 0.5, group])


def reference_scores(labels, predictions, groups):
  """Accuracy, PQD, DP and EOdds of a binary task over two groups, by their definitions."""
  labels, predictions, groups = map(np.asarray, (labels, predictions, groups))
  accuracy = [np.mean(labels[groups == g] == predictions[groups == g]) for g in (0, 1)]
  positive = [np.mean(predictions[groups == g] == 1) for g in (0, 1)]
  tpr = [np.mean(predictions[(groups == g) & (labels == 1)] == 1) for g in (0, 1)]
  fpr = [np.mean(predictions[(groups == g) & (labels == 0)] == 1) for g in (0, 1)]
  return {
      "accuracy": float(np.mean(labels == predictions)),
      "pqd": min(accuracy) / max(accuracy),
      "dp": abs(positive[0] - positive[1]),
      # One-vs-rest for class 0 gives the same spreads as class 1 in a binary task.
      "eodds": max(abs(tpr[0] - tpr[1]), abs(fpr[0] - fpr[1])),
  }


def test_pooled_score_equals_the_score_of_all_rows(tmp_path):
  rng = np.random.default_rng(3)
  n = 90
  labels = rng.integers(0, 2, n)
  predictions = np.where(rng.random(n) < 0.7, labels, 1 - labels)
  groups = (rng.random(n) < 0.3).astype(int)
  names = np.array(["not_Male", "Male"])
  rows = [(f"{i:06d}.jpg", labels[i], predictions[i], names[groups[i]]) for i in range(n)]
  # Three folds of unequal size; one holds no Male face (its report lists only not_Male).
  only_not_male = [r for r in rows if r[3] == "not_Male"][:20]
  rest = [r for r in rows if r not in only_not_male]
  write_run(tmp_path / "f0", only_not_male, groups=("not_Male",))
  write_run(tmp_path / "f1", rest[:40])
  write_run(tmp_path / "f2", rest[40:])
  report = pooling.pooled_report([str(tmp_path / f"f{k}") for k in range(3)])
  order = [int(r[0][:6]) for r in only_not_male + rest]
  expected = reference_scores(labels[order], predictions[order], groups[order])
  assert report["num_examples"] == n and report["run_examples"] == [20, 40, n - 60]
  assert report["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-12)
  male = report["attributes"]["Male"]
  for metric in ("pqd", "dp", "eodds"):
    assert male[metric] == pytest.approx(expected[metric], abs=1e-12), metric
    assert report["mf"][metric] == pytest.approx(expected[metric], abs=1e-12)
  assert male["groups"]["Male"]["n"] == int(groups.sum())
  assert male["small_groups"] == ["Male"]  # 90 rows, a third of them Male: under 50.
  assert (
      pooling.pooled_report([str(tmp_path / "f1")], min_group_size=3)["attributes"]["Male"][
          "small_groups"
      ]
      == []
  )


def test_pooling_refuses_runs_that_share_an_image_or_a_task(tmp_path):
  write_run(tmp_path / "a", [("000001.jpg", 1, 1, "Male"), ("000002.jpg", 0, 1, "not_Male")])
  write_run(tmp_path / "b", [("000002.jpg", 0, 0, "not_Male")])
  with pytest.raises(UserError, match=r"image 000002.jpg is predicted by both .*a and .*b"):
    pooling.pooled_report([str(tmp_path / "a"), str(tmp_path / "b")])
  report = json.loads((tmp_path / "b" / "report.json").read_text())
  report["attributes"] = {"Young": report["attributes"]["Male"]}
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "report.json").write_text(json.dumps(report))
  with pytest.raises(UserError, match=r"does not exist: is .*c a finished run"):
    pooling.pooled_report([str(tmp_path / "a"), str(tmp_path / "c")])
  (tmp_path / "c" / "predictions.csv").write_text((tmp_path / "b" / "predictions.csv").read_text())
  with pytest.raises(UserError, match=r"only runs of one task pool"):
    pooling.pooled_report([str(tmp_path / "a"), str(tmp_path / "c")])


@pytest.mark.slow
@needs_celeba
def test_one_fold_trains_reports_three_attributes_and_pools(tmp_path):
  args = [a for a in FAIR_TINY_ARGS if not a.startswith("--config.data.sensitive")]
  workdir = tmp_path / "fold3"
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device.
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.main",
          f"--config={REPO_ROOT / 'configs/celeba.py'}:size=small,split=identity_folds,fold=3",
          f"--config.data.root={CELEBA}",
          "--config.num_epochs=0",
          "--config.num_train_steps=2",
          f"--workdir={workdir}",
          *args,
      ],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "test_identities=25" in result.stdout
  report = json.loads((workdir / "report.json").read_text())
  assert list(report["attributes"]) == ["Male", "Chubby", "Goatee"]
  # predictions.csv names each test image, all of fold 3's people.
  _, splits = celeba.load_celeba(
      root=str(CELEBA), sensitive=("Male",), image_size=8, preload=False, num_folds=5, fold=3
  )
  with open(workdir / "predictions.csv") as f:
    ids = [row["example_id"] for row in csv.DictReader(f)]
  assert ids == images_of(splits["test"])[:96]
  pooled = subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.metrics.pooling",
          str(workdir),
          f"--output={tmp_path / 'p.json'}",
      ],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert pooled.returncode == 0, pooled.stderr[-3000:]
  assert "[Chubby]" in pooled.stdout
  written = json.loads((tmp_path / "p.json").read_text())
  for key in ("accuracy", "num_examples", "mf"):
    assert written[key] == report[key]
  bad = subprocess.run(
      [sys.executable, "-m", "fairmoe_jax.metrics.pooling", str(tmp_path / "missing")],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert bad.returncode != 0 and "Traceback" not in bad.stderr
  assert "does not exist: is" in bad.stderr


def test_second_target_rule_helpers():
  celeba_target = _celeba_target()

  labels = np.array([0, 0, 0, 1, 1, 1, 1, 1])
  assert celeba_target.balanced_accuracy(labels, np.ones(8, int)) == 0.5  # A constant guess.
  assert celeba_target.balanced_accuracy(labels, np.array([0, 0, 1, 1, 1, 1, 1, 0])) == (
      pytest.approx((2 / 3 + 4 / 5) / 2)
  )
  assert celeba_target.phi(labels, labels) == pytest.approx(1.0)
  assert celeba_target.phi(labels, 1 - labels) == pytest.approx(-1.0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(400, 5))
  y = (x[:, 2] - 0.5 * x[:, 4] > 0.3).astype(np.int64)  # Linear in the features, off-centre.
  predictions = celeba_target.ridge_probe(x[:300], y[:300], x[300:], lam=1.0)
  assert np.mean(predictions == y[300:]) > 0.9


@needs_celeba
def test_second_target_rule_on_the_sample():
  celeba_target = _celeba_target()

  ranked = celeba_target.rank_targets(str(CELEBA))
  assert ranked[0]["attribute"] == "Smiling"  # The choice docs/protocol.md records.
  assert len(ranked) == 36  # 40 less Attractive and the three sensitive attributes.
  for entry in ranked:
    eligible = 0.2 <= entry["positive_rate"] <= 0.8 and entry["max_phi"] <= 0.5
    assert (entry["excluded"] == "") == eligible
    assert ("validation_balanced_accuracy" in entry) == eligible
