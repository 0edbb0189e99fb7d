"""Tests of the ISIC 2019 reader (fairmoe_jax/data/isic.py) on the real files and tiny layouts."""

import csv
import os
import pathlib
import re

import numpy as np
import pytest
from PIL import Image

from conftest import SHARED_DATA
from fairmoe_jax.data import isic, pipeline
from trainkit.errors import UserError

ISIC = SHARED_DATA / "isic2019"
SPLIT_DIR = ISIC / "splits_fair_multi_exit"
needs_isic = pytest.mark.skipif(
    not (ISIC / isic.GROUND_TRUTH_FILE).is_file(),
    reason=f"real ISIC 2019 files not found at {ISIC} (shared data is not checked out)",
)


def read_rows(path: pathlib.Path) -> dict[str, dict[str, str]]:
  with open(path, newline="") as f:
    return {row["image"]: row for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def real():
  """Loads the real files once (paths only) and reads them independently with csv."""
  if not (ISIC / isic.GROUND_TRUTH_FILE).is_file():
    pytest.skip(f"real ISIC 2019 files not found at {ISIC}")
  info, splits = isic.load_isic2019(root=str(ISIC), image_size=32, preload=False)
  return (
      info,
      splits,
      read_rows(ISIC / isic.GROUND_TRUTH_FILE),
      read_rows(ISIC / isic.METADATA_FILE),
  )


def image_ids(split) -> list[str]:
  return [os.path.basename(p)[: -len(".jpg")] for p in split["path"]]


@needs_isic
def test_real_counts(real):
  info, splits, truth, metadata = real
  on_disk = {f[:-4] for f in os.listdir(ISIC / isic.IMAGE_DIR) if f.endswith(".jpg")}
  assert len(truth) == len(metadata) == 25331
  stats = info.load_stats
  assert stats["label_rows"] == 25331 and stats["image_files"] == len(on_disk) == 132
  assert stats["rows_without_image"] == 25331 - 132
  assert (stats["missing_sex"], stats["missing_age"], stats["missing_site"]) == (384, 437, 2631)
  assert stats["rows_without_metadata"] == stats["metadata_rows_without_label"] == 0
  assert stats["unassigned_rows"] == stats["split_rows_unknown_image"] == 0
  kept = [image for split in splits.values() for image in image_ids(split)]
  assert sorted(kept) == sorted(on_disk)
  assert sum(stats[f"{s}_examples"] for s in isic.SPLITS) == 132


@needs_isic
def test_real_labels_and_attributes_match_the_csvs(real):
  info, splits, truth, metadata = real
  assert info.class_names == isic.CLASS_NAMES and info.num_classes == 8
  assert info.attribute_names == ("sex", "age", "site")
  assert info.group_names[0] == ("female", "male", "unknown")
  assert info.group_names[1] == ("0-19", "20-39", "40-59", "60-79", "80+", "unknown")
  assert len(info.group_names[2]) == 9 and info.group_names[2][-1] == "unknown"
  sites = {row["anatom_site_general"] for row in metadata.values()} - {""}
  assert sites == set(isic.SITE_GROUPS)
  for split in splits.values():
    for i, image in enumerate(image_ids(split)):
      onehot = [float(truth[image][c]) for c in isic.CLASS_NAMES]
      assert split["label"][i] == onehot.index(1.0)
      row = metadata[image]
      sex, age, site = split["attributes"][i]
      assert info.group_names[0][sex] == (row["sex"] or "unknown")
      assert info.group_names[2][site] == (row["anatom_site_general"] or "unknown")
      if row["age_approx"]:
        low, _, high = info.group_names[1][age].partition("-")
        years = float(row["age_approx"])
        assert int(low.rstrip("+")) <= years <= (int(high) if high else 200)
      else:
        assert age == 5


@needs_isic
def test_real_exclude_mode_and_sensitive_subset(real):
  _, unknown_splits, _, _ = real
  info, splits = isic.load_isic2019(
      root=str(ISIC), image_size=32, preload=False, missing="exclude", sensitive=("site", "sex")
  )
  assert info.group_names[1] == ("female", "male")
  assert info.group_names[0] == isic.SITE_GROUPS
  for name, split in splits.items():
    reference = unknown_splits[name]["attributes"][:, [2, 0]]
    expected = np.where(reference == np.array([8, 2]), -1, reference)
    np.testing.assert_array_equal(split["attributes"], expected)
    assert (split["attributes"] == -1).any() or name == "val"


def test_age_bins():
  ages = [0, 5, 19, 19.9, 20, 39, 40, 59, 60, 79, 80, 85, 110]
  assert [isic.age_group(a) for a in ages] == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4]


def test_random_split_is_seeded_disjoint_and_covering():
  names = [f"ISIC_{i:07d}" for i in range(25331)]
  a = isic.random_split(names, 0, 0.2, 0.05)
  assert a == isic.random_split(names, 0, 0.2, 0.05)
  assert a != isic.random_split(names, 1, 0.2, 0.05)
  counts = np.bincount(list(a.values()), minlength=3)
  assert counts.tolist() == [20265 - 1013, 1013, 5066]
  assert set(a) == set(names)


@needs_isic
def test_real_random_split_depends_only_on_the_seed(real):
  _, first, _, _ = real
  _, again = isic.load_isic2019(root=str(ISIC), image_size=32, preload=False)
  _, other = isic.load_isic2019(root=str(ISIC), image_size=32, preload=False, split_seed=7)
  for name in isic.SPLITS:
    np.testing.assert_array_equal(first[name]["path"], again[name]["path"])
  assert any(not np.array_equal(first[name]["path"], other[name]["path"]) for name in isic.SPLITS)
  sets = [set(first[name]["path"]) for name in isic.SPLITS]
  assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
  # The split is drawn over all 25,331 label rows, so it matches random_split.
  assignment = isic.random_split(list(read_rows(ISIC / isic.GROUND_TRUTH_FILE)), 0, 0.2, 0.05)
  for split_id, name in enumerate(isic.SPLITS):
    assert all(assignment[image] == split_id for image in image_ids(first[name]))


@needs_isic
def test_real_split_directory(real):
  info, splits = isic.load_isic2019(
      root=str(ISIC), image_size=32, preload=False, split=str(SPLIT_DIR)
  )
  on_disk = {f[:-4] for f in os.listdir(ISIC / isic.IMAGE_DIR) if f.endswith(".jpg")}
  listed = set()
  for name in isic.SPLITS:
    rows = read_rows(SPLIT_DIR / f"{name}.csv")
    listed |= set(rows)
    assert sorted(image_ids(splits[name])) == sorted(set(rows) & on_disk)
  assert [len(read_rows(SPLIT_DIR / f"{n}.csv")) for n in isic.SPLITS] == [14904, 4965, 4971]
  assert [info.load_stats[f"{n}_examples"] for n in isic.SPLITS] == [46, 22, 17]
  assert info.load_stats["unassigned_rows"] == len(on_disk - listed) == 47
  assert info.load_stats["split_rows_unknown_image"] == 0


@needs_isic
def test_real_preload_and_pipeline():
  info, splits = isic.load_isic2019(
      root=str(ISIC), image_size=24, preload=True, max_examples_per_split=8
  )
  assert splits["train"]["image"].shape == (8, 24, 24, 3)
  batch = next(pipeline.train_iterator(splits["train"], global_batch_size=4, image_size=24, seed=0))
  assert batch["image"].shape == (4, 24, 24, 3) and batch["attributes"].shape == (4, 3)
  _, lazy = isic.load_isic2019(
      root=str(ISIC), image_size=24, preload=False, max_examples_per_split=8
  )
  lazy_batch = next(pipeline.eval_batches(lazy["test"], batch_size=8, image_size=24))
  eager_batch = next(pipeline.eval_batches(splits["test"], batch_size=8, image_size=24))
  np.testing.assert_array_equal(lazy_batch["image"], eager_batch["image"])


# Tiny layouts with known defects.
HEADER = "image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK"
META_HEADER = "image,age_approx,anatom_site_general,lesion_id,sex"


def onehot(k: int) -> str:
  return ",".join("1.0" if i == k else "0.0" for i in range(9))


def write_layout(root: pathlib.Path, truth=None, meta=None, present=("a", "b", "c", "d")):
  truth = truth or [
      f"a,{onehot(0)}",
      f"b,{onehot(1)}",
      f"c,{onehot(7)}",
      f"d,{onehot(2)}",
      f"e,{onehot(1)}",
  ]
  meta = meta or [
      "a,15,anterior torso,,female",
      "b,20,head/neck,l1,male",
      "c,85.0,,l2,",
      "d,,palms/soles,,male",
      "e,60,oral/genital,,female",
  ]
  (root / isic.IMAGE_DIR).mkdir(parents=True, exist_ok=True)
  for name in present:
    Image.new("RGB", (12, 9), (200, 100, 50)).save(root / isic.IMAGE_DIR / f"{name}.jpg")
  (root / isic.GROUND_TRUTH_FILE).write_text("\n".join([HEADER, *truth]) + "\n")
  (root / isic.METADATA_FILE).write_text("\n".join([META_HEADER, *meta]) + "\n")


def test_tiny_layout_values_and_missing_modes(tmp_path):
  write_layout(tmp_path)
  split = tmp_path / "split.csv"
  split.write_text("image,split\na,train\nb,train\nc,test\nd,val\nzzz,test\n")
  info, splits = isic.load_isic2019(root=str(tmp_path), image_size=8, split=str(split))
  assert info.load_stats["rows_without_image"] == 1  # e
  assert info.load_stats["split_rows_unknown_image"] == 1  # zzz
  np.testing.assert_array_equal(splits["train"]["label"], [0, 1])
  np.testing.assert_array_equal(splits["train"]["attributes"], [[0, 0, 0], [1, 1, 1]])
  np.testing.assert_array_equal(splits["test"]["attributes"], [[2, 4, 8]])
  np.testing.assert_array_equal(splits["val"]["attributes"], [[1, 5, 5]])
  assert splits["test"]["label"].tolist() == [7]
  assert splits["val"]["image"].shape == (1, 8, 8, 3)
  _, excluded = isic.load_isic2019(
      root=str(tmp_path), image_size=8, split=str(split), missing="exclude", preload=False
  )
  np.testing.assert_array_equal(excluded["test"]["attributes"], [[-1, 4, -1]])
  np.testing.assert_array_equal(excluded["val"]["attributes"], [[1, -1, 5]])


def test_tiny_split_directory_rejects_overlap_and_counts_unknown(tmp_path):
  write_layout(tmp_path)
  split_dir = tmp_path / "splits"
  split_dir.mkdir()
  (split_dir / "train.csv").write_text("image,label\na,0\nb,1\n")
  (split_dir / "val.csv").write_text("image,label\nd,2\n")
  (split_dir / "test.csv").write_text("image,label\nc,7\nnope,1\n")
  info, splits = isic.load_isic2019(
      root=str(tmp_path), image_size=8, split=str(split_dir), preload=False
  )
  assert [len(splits[n]["label"]) for n in isic.SPLITS] == [2, 1, 1]
  assert info.load_stats["split_rows_unknown_image"] == 1
  (split_dir / "val.csv").write_text("image,label\nd,2\na,0\n")
  with pytest.raises(
      UserError, match=r"val\.csv:3: image a is already in the split at .*train\.csv:2"
  ):
    isic.load_isic2019(root=str(tmp_path), image_size=8, split=str(split_dir))
  (split_dir / "val.csv").unlink()
  with pytest.raises(UserError, match=r"val\.csv does not exist"):
    isic.load_isic2019(root=str(tmp_path), image_size=8, split=str(split_dir))
  with pytest.raises(UserError, match="neither 'random' nor"):
    isic.load_isic2019(root=str(tmp_path), image_size=8, split=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "file, row, replacement, pattern",
    [
        (
            "truth",
            2,
            "c," + onehot(1).replace("0.0", "1.0", 1),
            r"GroundTruth\.csv:4: .* not one-hot",
        ),
        ("truth", 2, f"c,{onehot(8)}", r"GroundTruth\.csv:4: column UNK is 1"),
        ("truth", 1, "b,0,x,0,0,0,0,0,0,0", r"GroundTruth\.csv:3: column NV has value 'x'"),
        ("truth", 0, "a,0.5,0.5,0,0,0,0,0,0,0", r"GroundTruth\.csv:2: column MEL has value '0.5'"),
        ("truth", 3, "d,1.0,0.0", r"GroundTruth\.csv:5: expected 10 comma-separated fields"),
        ("truth", 4, f"a,{onehot(1)}", r"GroundTruth\.csv:6: image a is listed twice"),
        ("meta", 0, "a,abc,anterior torso,,female", r"Metadata\.csv:2: column age_approx .*'abc'"),
        ("meta", 1, "b,-5,head/neck,,male", r"Metadata\.csv:3: column age_approx"),
        ("meta", 2, "c,40,scalp,,male", r"Metadata\.csv:4: column anatom_site_general .*'scalp'"),
        ("meta", 3, "d,40,,,other", r"Metadata\.csv:5: column sex has value 'other'"),
    ],
)
def test_malformed_csv_values_name_file_line_and_column(tmp_path, file, row, replacement, pattern):
  write_layout(tmp_path)
  path = tmp_path / (isic.GROUND_TRUTH_FILE if file == "truth" else isic.METADATA_FILE)
  lines = path.read_text().splitlines()
  lines[row + 1] = replacement  # After the header: file line row + 2.
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(UserError, match=pattern):
    isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)


def test_stray_quote_bom_and_encoding_are_errors_with_the_line(tmp_path):
  """An unclosed quote must not swallow rows and shift values into other columns silently."""
  write_layout(tmp_path)
  metadata = tmp_path / isic.METADATA_FILE
  lines = metadata.read_text().splitlines()
  lines[1] = 'a,15,anterior torso,"l0,female'  # The quote closes rows later.
  lines[3] = 'c,85.0,,l2",'
  metadata.write_text("\n".join(lines) + "\n")
  with pytest.raises(
      UserError, match=r"Metadata\.csv:2: a quoted field runs from line 2 to line 4"
  ):
    isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)
  # A byte-order mark before the header is not part of the first column's name.
  write_layout(tmp_path)
  truth = tmp_path / isic.GROUND_TRUTH_FILE
  truth.write_bytes(b"\xef\xbb\xbf" + truth.read_bytes())
  isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)
  # Not UTF-8: the line, not a byte offset.
  truth.write_bytes(truth.read_bytes().replace(b"\nc,", b"\nc\xff,"))
  with pytest.raises(UserError, match=r"GroundTruth\.csv:4: not UTF-8"):
    isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)


@pytest.mark.parametrize(
    "rows, message",
    [
        # A blank line before the stray quote: the rows before it were miscounted (line 2).
        (["", 'b,20,"head/neck,l1,male', "c,85.0,,l2,"], "a quoted field runs from line 3 to"),
        (["", 'b,20,"head/neck,l1,male'], "a quoted field runs from line 3 to the end of the file"),
        # A quote inside a value or after a closing quote was read as part of the value.
        (["a,15,anterior torso,,female", 'b",20,head/neck,l1,male'], "column image has value 'b\""),
        (["a,15,anterior torso,,female", 'b,20,head/neck,l"1,male'], "column lesion_id has value"),
        (["a,15,anterior torso,,female", 'b,"20"x,head/neck,l1,male'], "',' expected after"),
    ],
)
def test_a_stray_quote_on_line_3_names_line_3(tmp_path, rows, message):
  """A stray quote on line 3 names line 3 (a blank line before it once shifted the count to line
  2), and a quote inside a value is an error, not part of an image name or lesion id."""
  write_layout(tmp_path)
  metadata = tmp_path / isic.METADATA_FILE
  header = metadata.read_text().splitlines()[0]
  metadata.write_text("\n".join([header, *rows]) + "\n")
  with pytest.raises(UserError, match=rf"Metadata\.csv:3: {re.escape(message)}"):
    isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)


def test_blank_lines_are_skipped_and_do_not_shift_line_numbers(tmp_path):
  write_layout(tmp_path)
  metadata = tmp_path / isic.METADATA_FILE
  lines = metadata.read_text().splitlines()
  metadata.write_text("\n".join([lines[0], "", lines[1], "", "", lines[2], *lines[3:]]) + "\n")
  isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)  # Was a quote error.
  lines[2] = lines[2].replace("20", "twenty")
  metadata.write_text("\n".join([lines[0], "", lines[1], "", "", *lines[2:]]) + "\n")
  with pytest.raises(UserError, match=r"Metadata\.csv:6: column age_approx has value 'twenty'"):
    isic.load_isic2019(root=str(tmp_path), image_size=8, preload=False)


def test_missing_columns_files_and_bad_arguments(tmp_path):
  write_layout(tmp_path)
  kwargs = dict(root=str(tmp_path), image_size=8, preload=False)
  with pytest.raises(UserError, match="missing=.*expected one of unknown, exclude"):
    isic.load_isic2019(missing="drop", **kwargs)
  with pytest.raises(UserError, match="data.sensitive=.*'skin'"):
    isic.load_isic2019(sensitive=("sex", "skin"), **kwargs)
  metadata = tmp_path / isic.METADATA_FILE
  metadata.write_text(metadata.read_text().replace("sex", "gender", 1))
  with pytest.raises(UserError, match=r"Metadata\.csv:1: missing column\(s\) sex"):
    isic.load_isic2019(**kwargs)
  metadata.unlink()
  with pytest.raises(UserError, match=r"Metadata\.csv does not exist"):
    isic.load_isic2019(**kwargs)


def test_rows_without_metadata_are_kept_with_unknown_groups(tmp_path):
  write_layout(tmp_path, meta=["a,15,anterior torso,,female", "zz,30,,,male"])
  info, splits = isic.load_isic2019(
      root=str(tmp_path), image_size=8, preload=False, test_fraction=0.0, val_fraction=0.0
  )
  assert info.load_stats["rows_without_metadata"] == 4
  assert info.load_stats["metadata_rows_without_label"] == 1
  assert len(splits["train"]["label"]) == 4
  np.testing.assert_array_equal(splits["train"]["attributes"][1:], [[2, 5, 8]] * 3)
