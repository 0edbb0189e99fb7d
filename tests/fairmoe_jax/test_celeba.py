"""Tests of the CelebA readers (fairmoe_jax/data/celeba.py) on the real sample and tiny layouts."""

import os
import pathlib

import numpy as np
import pytest
from PIL import Image

from conftest import SHARED_DATA
from fairmoe_jax.data import celeba, images, pipeline
from trainkit.errors import UserError

CELEBA = SHARED_DATA / "celeba"
needs_celeba = pytest.mark.skipif(
    not (CELEBA / "list_attr_celeba.txt").is_file(),
    reason=f"real CelebA sample not found at {CELEBA} (shared data is not checked out)",
)


def simple_table(path: pathlib.Path) -> tuple[list[str], dict[str, list[str]]]:
  """An independent reading of an attribute or partition file: names and {image: fields}."""
  lines = path.read_text().split("\n")
  names = lines[1].split() if path.name.startswith("list_attr") else []
  body = lines[2:] if names else lines
  return names, {f[0]: f[1:] for f in (line.split() for line in body) if f}


def by_image(split) -> dict[str, int]:
  return {os.path.basename(p): i for i, p in enumerate(split["path"])}


@needs_celeba
def test_official_sample_counts_and_values():
  info, splits = celeba.load_celeba(
      root=str(CELEBA), sensitive=("Male",), image_size=32, preload=False
  )
  assert info.class_names == ("not_Attractive", "Attractive")
  assert info.attribute_names == ("Male",) and info.group_names == (("not_Male", "Male"),)
  assert {k: len(v["label"]) for k, v in splits.items()} == {"train": 2328, "val": 480, "test": 390}
  assert info.load_stats == {
      "attribute_rows": 3198,
      "image_files": 3198,
      "rows_without_image": 0,
      "images_without_attributes": 0,
      "rows_without_partition": 0,
      "partition_rows_unknown_image": 0,
      "train_examples": 2328,
      "val_examples": 480,
      "test_examples": 390,
  }
  names, rows = simple_table(CELEBA / "list_attr_celeba.txt")
  _, partition = simple_table(CELEBA / "list_eval_partition.txt")
  for split_id, (name, split) in enumerate(splits.items()):
    assert split["label"].dtype == np.int32 and split["attributes"].dtype == np.int32
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in split["path"][:20])
    index = by_image(split)
    assert all(partition[image] == [str(split_id)] for image in index)
    for image in sorted(index)[:: max(1, len(index) // 25)]:
      row = dict(zip(names, rows[image]))
      assert split["label"][index[image]] == (row["Attractive"] == "1")
      assert split["attributes"][index[image], 0] == (row["Male"] == "1")


@needs_celeba
def test_forty_attribute_file_and_truncation():
  info, splits = celeba.load_celeba(
      root=str(CELEBA), attr_file="list_attr_celeba_40.txt", image_size=32, preload=False
  )
  assert info.attribute_names == ("Male", "Chubby", "Goatee")
  assert info.load_stats["attribute_rows"] == 279
  assert info.load_stats["images_without_attributes"] == 3198 - 279
  # Images with id <= 020000 are all in the official train partition.
  assert [len(v["label"]) for v in splits.values()] == [279, 0, 0]
  assert splits["val"]["attributes"].shape == (0, 3)
  names, rows = simple_table(CELEBA / "list_attr_celeba_40.txt")
  assert len(names) == 40 and len(rows) == 279
  index = by_image(splits["train"])
  for image, values in rows.items():
    row = dict(zip(names, values))
    expected = [row[a] == "1" for a in ("Male", "Chubby", "Goatee")]
    np.testing.assert_array_equal(splits["train"]["attributes"][index[image]], expected)
  _, small = celeba.load_celeba(
      root=str(CELEBA),
      attr_file="list_attr_celeba_40.txt",
      image_size=32,
      preload=False,
      max_examples_per_split=10,
  )
  for key in ("path", "label", "attributes"):
    np.testing.assert_array_equal(small["train"][key], splits["train"][key][:10])


@needs_celeba
def test_preload_and_pipelines_on_a_real_split():
  kwargs = dict(root=str(CELEBA), sensitive=("Male",), image_size=24, max_examples_per_split=16)
  _, lazy = celeba.load_celeba(preload=False, **kwargs)
  info, eager = celeba.load_celeba(preload=True, **kwargs)
  assert eager["train"]["image"].shape == (16, 24, 24, 3) and "path" not in eager["train"]
  np.testing.assert_array_equal(
      eager["val"]["image"][3], images.load_image(lazy["val"]["path"][3], 24)
  )
  it = pipeline.train_iterator(lazy["train"], global_batch_size=8, image_size=24, seed=0)
  batch = next(it)
  assert batch["image"].shape == (8, 24, 24, 3) and batch["attributes"].shape == (8, 1)
  # uint8 on the host (normalised on the device); a real photo spans most of the range.
  assert batch["image"].dtype == np.uint8 and batch["image"].max() - batch["image"].min() > 128
  lazy_eval = list(pipeline.eval_batches(lazy["test"], batch_size=5, image_size=24))
  eager_eval = list(pipeline.eval_batches(eager["test"], batch_size=5, image_size=24))
  assert len(lazy_eval) == 4 and lazy_eval[-1]["mask"].sum() == 1
  for a, b in zip(lazy_eval, eager_eval):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


# Tiny layouts with known defects.
ATTRS = ("Attractive", "Male", "Young")


def write_layout(root: pathlib.Path, rows, partition, images_present, count_line="999"):
  """Writes an official-format CelebA layout; rows are (image, values) with -1/1 values."""
  (root / "img_align_celeba").mkdir(parents=True)
  for name in images_present:
    Image.new("RGB", (18, 22), (10, 200, 30)).save(root / "img_align_celeba" / name)
  lines = [count_line, " ".join(ATTRS) + " "]
  lines += [f"{image} " + " ".join(f"{v:2d}" for v in values) for image, values in rows]
  (root / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
  text = "".join(f"{image} {split}\n" for image, split in partition)
  (root / "list_eval_partition.txt").write_text(text)


def good_layout(root: pathlib.Path):
  rows = [
      ("000001.jpg", (1, -1, 1)),
      ("000002.jpg", (-1, 1, 1)),
      ("000003.jpg", (1, 1, -1)),
      ("000004.jpg", (-1, -1, -1)),
      ("000005.jpg", (1, -1, -1)),
  ]
  partition = [("000001.jpg", 0), ("000002.jpg", 0), ("000003.jpg", 1), ("000004.jpg", 2)]
  present = ["000001.jpg", "000002.jpg", "000003.jpg", "000005.jpg", "000009.jpg"]
  write_layout(root, rows, partition, present)


def test_tiny_layout_counts_unmatched_rows(tmp_path, capsys):
  good_layout(tmp_path)
  with open(tmp_path / "list_eval_partition.txt", "a") as f:
    f.write("777777.jpg 0\n")  # A partition entry for an image no attribute row names.
  info, splits = celeba.load_celeba(
      root=str(tmp_path), sensitive=("Male", "Young"), image_size=8, preload=True
  )
  printed = capsys.readouterr().out
  assert "rows_without_image: 000004.jpg" in printed
  assert "images_without_attributes: 000009.jpg" in printed
  assert "partition_rows_unknown_image: 777777.jpg" in printed
  # 000004 has no image, 000005 no partition entry, 000009 no attribute row;
  # the header's row count (999) is ignored.
  assert info.load_stats == {
      "attribute_rows": 5,
      "image_files": 5,
      "rows_without_image": 1,
      "images_without_attributes": 1,
      "rows_without_partition": 1,
      "partition_rows_unknown_image": 1,
      "train_examples": 2,
      "val_examples": 1,
      "test_examples": 0,
  }
  np.testing.assert_array_equal(splits["train"]["label"], [1, 0])
  np.testing.assert_array_equal(splits["train"]["attributes"], [[0, 1], [1, 1]])
  np.testing.assert_array_equal(splits["val"]["attributes"], [[1, 0]])
  assert splits["train"]["image"].shape == (2, 8, 8, 3)
  assert splits["test"]["image"].shape == (0, 8, 8, 3)
  assert info.group_names == (("not_Male", "Male"), ("not_Young", "Young"))


def test_unknown_attribute_lists_the_available_ones(tmp_path):
  # The default sensitive attributes (Male, Chubby, Goatee) against a layout that has only
  # Attractive, Male and Young: one error naming the header line, the missing and the present.
  good_layout(tmp_path)
  with pytest.raises(UserError) as e:
    celeba.load_celeba(root=str(tmp_path), image_size=8, preload=False)
  message = str(e.value)
  assert "list_attr_celeba.txt:2" in message and "Chubby, Goatee not in the file" in message
  assert "available: Attractive Male Young" in message


def test_a_data_file_pointed_at_another_kind_of_file_is_named_without_echoing_its_content(tmp_path):
  # A config.json edited to point data.attr_file at a system file: the error printed that
  # file's first line ("available: root:x:0:0:root:/root:/bin/bash").
  good_layout(tmp_path)
  secret = tmp_path / "passwd"
  secret.write_text("root:x:0:0:s3cret-hash:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/sh\n")
  with pytest.raises(UserError) as e:
    celeba.load_celeba(root=str(tmp_path), attr_file=str(secret), image_size=8, preload=False)
  message = str(e.value)
  assert message.startswith(f"{secret}:1: expected the attribute names"), message
  assert "check data.attr_file" in message
  for content in ("root", "s3cret", "bash", "daemon"):
    assert content not in message.replace(str(tmp_path), ""), message
  # The same for the partition and identity readers, which repeated the offending line.
  for reader in (celeba.read_partition, celeba.read_identities):
    with pytest.raises(UserError) as e:
      reader(secret)
    assert "s3cret" not in str(e.value) and str(e.value).startswith(f"{secret}:1: expected")


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.replace("000002.jpg -1  1  1", "000002.jpg -1  1"), r":4: expected 4 fields"),
        (lambda t: t.replace("000003.jpg  1  1 -1", "000003.jpg  1  0 -1"), r":5: column Male"),
        (lambda t: t.replace("000003.jpg  1  1 -1", "000003.jpg  1  yes -1"), r":5: column Male"),
        (lambda t: t + "000001.jpg  1 -1  1\n", r":8: image 000001.jpg already listed on line 3"),
    ],
)
def test_malformed_attribute_rows_name_file_and_line(tmp_path, edit, pattern):
  good_layout(tmp_path)
  path = tmp_path / "list_attr_celeba.txt"
  path.write_text(edit(path.read_text()))
  with pytest.raises(UserError, match=r"list_attr_celeba\.txt" + pattern):
    celeba.load_celeba(root=str(tmp_path), sensitive=("Male",), image_size=8)


def test_malformed_value_in_an_unused_column_is_not_an_error(tmp_path):
  good_layout(tmp_path)
  path = tmp_path / "list_attr_celeba.txt"
  path.write_text(path.read_text().replace("000003.jpg  1  1 -1", "000003.jpg  1  1  0"))
  celeba.load_celeba(root=str(tmp_path), sensitive=("Male",), image_size=8, preload=False)


def test_malformed_partition_and_missing_files(tmp_path):
  good_layout(tmp_path)
  kwargs = dict(root=str(tmp_path), sensitive=("Male",), image_size=8)
  partition = tmp_path / "list_eval_partition.txt"
  partition.write_text(partition.read_text().replace("000003.jpg 1", "000003.jpg 3"))
  with pytest.raises(UserError, match=r"list_eval_partition\.txt:3: expected 'image split'"):
    celeba.load_celeba(**kwargs)
  partition.unlink()
  with pytest.raises(UserError, match=r"list_eval_partition\.txt does not exist"):
    celeba.load_celeba(**kwargs)
  with pytest.raises(UserError, match=r"nope\.txt does not exist"):
    celeba.load_celeba(attr_file="nope.txt", **kwargs)
  with pytest.raises(UserError, match="img_align_celeba does not exist"):
    celeba.load_celeba(**{**kwargs, "root": str(tmp_path / "img_align_celeba")})
  with pytest.raises(UserError, match="also a sensitive attribute"):
    celeba.load_celeba(**{**kwargs, "sensitive": ("Attractive",)})


def test_attribute_file_without_a_count_line(tmp_path):
  good_layout(tmp_path)
  path = tmp_path / "list_attr_celeba.txt"
  path.write_text(path.read_text().split("\n", 1)[1])
  info, _ = celeba.load_celeba(root=str(tmp_path), sensitive=("Male",), image_size=8)
  assert info.load_stats["attribute_rows"] == 5


def test_tfds_without_a_prepared_dataset_is_a_user_error(tmp_path):
  pytest.importorskip("tensorflow_datasets", reason="tensorflow_datasets is not installed")
  with pytest.raises(UserError, match="celeb_a is not prepared in .*never downloaded"):
    celeba.load_celeba_tfds(data_dir=str(tmp_path), image_size=8)
  assert not any(tmp_path.rglob("*.tfrecord*")) and not any(tmp_path.rglob("*downloads*"))


def test_tfds_reads_a_mock_prepared_dataset(monkeypatch):
  # No TensorFlow here, so tfds cannot write a real prepared dataset; its mock
  # data source (random examples with the celeb_a features) stands in for one.
  tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow_datasets is not installed")
  monkeypatch.setattr(tfds.builder_cls("celeb_a"), "is_prepared", lambda self: True)
  with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
    info, splits = celeba.load_celeba_tfds(
        data_dir="unused", sensitive=("Male", "Young"), image_size=8, max_examples_per_split=3
    )
    source = tfds.builder("celeb_a").as_data_source(split="validation")
    expected = [source[i] for i in range(3)]
  assert info.class_names == ("not_Attractive", "Attractive")
  assert info.load_stats == {"train_examples": 3, "val_examples": 3, "test_examples": 3}
  val = splits["val"]
  assert val["image"].shape == (3, 8, 8, 3) and val["image"].dtype == np.uint8
  for i, example in enumerate(expected):
    assert val["label"][i] == example["attributes"]["Attractive"]
    assert val["attributes"][i].tolist() == [
        example["attributes"]["Male"],
        example["attributes"]["Young"],
    ]
    reference = images.square_resize(Image.fromarray(example["image"]), 8)
    np.testing.assert_array_equal(val["image"][i], reference)
  with pytest.raises(UserError, match="no attribute.*Smile; available: 5_o_Clock_Shadow"):
    with tfds.testing.mock_data(num_examples=1, policy=tfds.testing.MockPolicy.USE_CODE):
      celeba.load_celeba_tfds(data_dir="unused", sensitive=("Smile",), image_size=8)


def test_an_empty_split_is_an_error_before_training(tmp_path):
  """A partition without test rows used to crash after training, with nothing checkpointed."""
  from fairmoe_jax import config as fairmoe_config
  from fairmoe_jax import train as fairmoe_train

  good_layout(tmp_path)  # Its partition has no test rows.
  config = fairmoe_config.base_config()
  config.data.update(
      name="celeba", root=str(tmp_path), sensitive="Male", image_size=8, preload=False
  )
  with pytest.raises(UserError, match=r"data.name=celeba: the test split\(s\) are empty"):
    fairmoe_train._setup(config, str(tmp_path / "run"))
