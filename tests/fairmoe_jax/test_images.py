"""Tests of image-file decoding and of the pipeline on splits of image paths (data/images.py)."""

import numpy as np
import pytest
from PIL import Image

from fairmoe_jax.data import augment, images, pipeline
from trainkit.errors import UserError

NO_AUGMENT = {"random_resized_crop": False, "horizontal_flip": False}


def write_image(path, array: np.ndarray, **kwargs) -> str:
  Image.fromarray(array).save(path, **kwargs)
  return str(path)


def random_image(rng, height: int, width: int) -> np.ndarray:
  return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def make_path_split(tmp_path, n: int, height: int = 40, width: int = 30):
  """A split of ``n`` PNG files (lossless, so decoding is exact) traced by attribute 0."""
  rng = np.random.default_rng(0)
  paths = [
      write_image(tmp_path / f"{i:03d}.png", random_image(rng, height, width)) for i in range(n)
  ]
  ids = np.arange(n, dtype=np.int32)
  return {
      "path": np.array(paths),
      "label": ids % 2,
      "attributes": np.stack([ids, np.full(n, -1, np.int32)], axis=1),
  }


def test_load_image_crops_the_centre_square_without_resampling_at_the_same_size(tmp_path):
  array = random_image(np.random.default_rng(0), 20, 30)
  out = images.load_image(write_image(tmp_path / "a.png", array), 20)
  np.testing.assert_array_equal(out, array[:, 5:25])
  tall = random_image(np.random.default_rng(1), 30, 20)
  out = images.load_image(write_image(tmp_path / "b.png", tall), 20)
  np.testing.assert_array_equal(out, tall[5:25])


def test_load_image_matches_resize_short_side_then_centre_crop(tmp_path):
  # A smooth image, so one-pass crop+resize and resize-then-crop agree closely.
  y, x = np.mgrid[0:60, 0:90].astype(np.float32)
  array = np.stack([x * 2.5, y * 4, (x + y) * 1.5], axis=-1).clip(0, 255).astype(np.uint8)
  out = images.load_image(write_image(tmp_path / "a.png", array), 24)
  assert out.shape == (24, 24, 3) and out.dtype == np.uint8
  reference = np.asarray(Image.fromarray(array).resize((36, 24), Image.BICUBIC))[:, 6:30]
  assert np.abs(out.astype(int) - reference.astype(int)).mean() < 2


def test_load_image_converts_grey_and_rgba_to_rgb(tmp_path):
  grey = np.full((10, 12), 77, np.uint8)
  rgba = np.zeros((10, 12, 4), np.uint8)
  rgba[..., 0] = 200
  rgba[..., 3] = 255
  out = images.load_image(write_image(tmp_path / "g.png", grey), 10)
  assert out.shape == (10, 10, 3) and np.all(out == 77)
  out = images.load_image(write_image(tmp_path / "c.png", rgba), 8)
  assert out.shape == (8, 8, 3) and np.all(out[..., 0] == 200) and np.all(out[..., 1:] == 0)


def test_a_16_bit_image_reads_as_its_8_bit_copy(tmp_path):
  # convert("RGB") clips 16-bit grey at 255: such a file used to read as (nearly) white.
  grey8 = np.random.RandomState(0).randint(0, 256, (40, 48)).astype(np.uint8)
  Image.fromarray(grey8).save(tmp_path / "grey8.png")
  Image.fromarray(grey8.astype(np.uint16) * 257).save(tmp_path / "grey16.png")
  assert Image.open(tmp_path / "grey16.png").mode.startswith("I;16")
  for size in (40, 24):
    np.testing.assert_array_equal(
        images.load_image(tmp_path / "grey16.png", size),
        images.load_image(tmp_path / "grey8.png", size),
    )
  # Values between the 8-bit levels round to the nearest one.
  Image.fromarray(np.full((8, 8), 257 * 100 + 120, np.uint16)).save(tmp_path / "between.png")
  assert (images.load_image(tmp_path / "between.png", 8) == 100).all()


def test_an_image_of_32_bit_or_float_pixels_is_refused_naming_the_file(tmp_path):
  path = tmp_path / "depth.tiff"
  Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)).save(path)
  with pytest.raises(
      UserError, match=r"depth\.tiff is not a readable image: its pixels are 32-bit floats"
  ):
    images.load_image(path, 8)


def test_load_image_of_a_jpeg_decodes_at_reduced_scale_close_to_full_decode(tmp_path):
  y, x = np.mgrid[0:218, 0:178].astype(np.float32)
  array = np.stack([x, y, 255 - y], axis=-1).clip(0, 255).astype(np.uint8)
  path = write_image(tmp_path / "a.jpg", array, quality=95)
  out = images.load_image(path, 32)
  full = Image.open(path).convert("RGB")
  reference = images.square_resize(full, 32)
  assert out.shape == (32, 32, 3)
  assert np.abs(out.astype(int) - reference.astype(int)).mean() < 3


def test_missing_or_corrupt_image_is_a_user_error_naming_the_file(tmp_path):
  with pytest.raises(UserError, match="nothere.jpg.*does not exist"):
    images.load_image(tmp_path / "nothere.jpg", 8)
  (tmp_path / "bad.jpg").write_bytes(b"this is not a jpeg")
  with pytest.raises(UserError, match="bad.jpg.*not a readable image"):
    images.load_image(tmp_path / "bad.jpg", 8)
  truncated = tmp_path / "truncated.jpg"
  write_image(truncated, random_image(np.random.default_rng(0), 64, 64))
  truncated.write_bytes(truncated.read_bytes()[:200])
  with pytest.raises(UserError, match="truncated.jpg"):
    images.load_image(truncated, 8)


def test_preload_images_replaces_paths_by_decoded_images(tmp_path):
  split = make_path_split(tmp_path, 5)
  loaded = images.preload_images(split, 16, num_threads=2)
  assert "path" not in loaded and "path" in split
  assert loaded["image"].shape == (5, 16, 16, 3) and loaded["image"].dtype == np.uint8
  for i, path in enumerate(split["path"]):
    np.testing.assert_array_equal(loaded["image"][i], images.load_image(path, 16))
  assert loaded["label"] is split["label"]
  # Serial decoding gives the same images; an image split passes through.
  np.testing.assert_array_equal(images.preload_images(split, 16, 1)["image"], loaded["image"])
  assert images.preload_images(loaded, 16)["image"] is loaded["image"]
  empty = {k: v[:0] for k, v in split.items()}
  assert images.preload_images(empty, 16)["image"].shape == (0, 16, 16, 3)


def test_preload_reports_the_bad_file(tmp_path):
  split = make_path_split(tmp_path, 4)
  split["path"] = np.array([*split["path"][:2], str(tmp_path / "gone.png"), split["path"][3]])
  with pytest.raises(UserError, match="gone.png"):
    images.preload_images(split, 8, num_threads=2)


def test_two_pass_training_on_paths_equals_preloaded_images_at_the_decode_size(tmp_path):
  split = make_path_split(tmp_path, 12)
  kwargs = dict(global_batch_size=4, image_size=16, seed=3, num_threads=0)
  lazy = pipeline.train_iterator(split, decode_size=20, resampling="two_pass", **kwargs)
  eager = pipeline.train_iterator(images.preload_images(split, 20), **kwargs)
  for _ in range(4):  # crosses an epoch boundary
    a, b = next(lazy), next(eager)
    assert a["image"].shape == (4, 16, 16, 3) and a["image"].dtype == np.uint8
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_train_iterator_on_paths_defaults_to_a_larger_decode(tmp_path):
  split = make_path_split(tmp_path, 8)
  assert pipeline.train_decode_size(32) == 37
  it = pipeline.train_iterator(
      split,
      global_batch_size=4,
      image_size=10,
      seed=0,
      augment=NO_AUGMENT,
      num_threads=0,
      resampling="two_pass",
  )
  batch = next(it)
  ids = batch["attributes"][:, 0]
  # Without augmentation, an image is the decode at train_decode_size resized to image_size.
  decode = pipeline.train_decode_size(10)
  expected = [augment.resize(images.load_image(split["path"][i], decode), 10) for i in ids]
  np.testing.assert_array_equal(batch["image"], np.stack(expected))


def test_eval_batches_on_paths_equals_preloaded_images(tmp_path):
  split = make_path_split(tmp_path, 7)
  lazy = list(pipeline.eval_batches(split, batch_size=3, image_size=12, num_threads=2))
  eager = list(pipeline.eval_batches(images.preload_images(split, 12), batch_size=3, image_size=12))
  assert len(lazy) == len(eager) == 3
  for a, b in zip(lazy, eager):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  assert lazy[-1]["mask"].tolist() == [1, 0, 0]
  # Two processes together cover every example once.
  ids = []
  for p in range(2):
    for batch in pipeline.eval_batches(
        split, batch_size=2, image_size=12, process_index=p, process_count=2
    ):
      ids += batch["attributes"][batch["mask"] == 1, 0].tolist()
  assert sorted(ids) == list(range(7))


def test_a_missing_file_surfaces_from_the_train_iterator_as_a_user_error(tmp_path):
  split = make_path_split(tmp_path, 8)
  split["path"] = np.array([str(tmp_path / "gone.png")] * 8)
  it = pipeline.train_iterator(split, global_batch_size=4, image_size=8, seed=0, num_threads=2)
  with pytest.raises(UserError, match="gone.png"):
    next(it)


def test_a_16_bit_image_trains_as_its_8_bit_copy(tmp_path):
  # The training decode (one resampling pass from the file) reads 16-bit grey the same way.
  grey8 = np.random.RandomState(1).randint(0, 256, (50, 60)).astype(np.uint8)
  Image.fromarray(grey8).save(tmp_path / "grey8.png")
  Image.fromarray(grey8.astype(np.uint16) * 257).save(tmp_path / "grey16.png")
  config = augment.AugmentConfig(random_resized_crop=True, horizontal_flip=True)
  decoded = [
      images.read_image(
          tmp_path / name,
          40,
          lambda image: augment.augment_decoded(image, np.random.default_rng(0), 32, 40, config),
      )
      for name in ("grey16.png", "grey8.png")
  ]
  np.testing.assert_array_equal(*decoded)
