"""Tests of the input pipelines and augmentation (fairmoe_jax/data/{pipeline,augment}.py)."""

import json

import numpy as np
import pytest

from fairmoe_jax.data import augment, pipeline

NO_AUGMENT = {"random_resized_crop": False, "horizontal_flip": False}


def make_arrays(n: int, size: int = 16) -> dict[str, np.ndarray]:
  """A split whose first attribute is the example id, so batches can be traced."""
  rng = np.random.default_rng(0)
  ids = np.arange(n, dtype=np.int32)
  return {
      "image": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
      "label": ids % 4,
      "attributes": np.stack([ids, ids % 3, np.full(n, -1, np.int32)], axis=1),
  }


def ids_of(batches) -> np.ndarray:
  return np.concatenate([b["attributes"][:, 0] for b in batches])


def take(iterator, n: int) -> list[dict[str, np.ndarray]]:
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


def test_train_batch_shapes_and_dtypes():
  arrays = make_arrays(40)
  it = pipeline.train_iterator(arrays, global_batch_size=8, image_size=12, seed=0)
  batch = next(it)
  assert batch["image"].shape == (8, 12, 12, 3) and batch["image"].dtype == np.uint8
  assert batch["label"].shape == (8,) and batch["label"].dtype == np.int32
  assert batch["attributes"].shape == (8, 3) and batch["attributes"].dtype == np.int32
  assert batch["mask"].dtype == np.float32 and np.all(batch["mask"] == 1)
  # Labels and attributes (including the -1 "missing" values) pass untouched.
  np.testing.assert_array_equal(batch["label"], arrays["label"][ids_of([batch])])
  np.testing.assert_array_equal(batch["attributes"], arrays["attributes"][ids_of([batch])])


def test_processes_split_each_epoch_disjointly():
  arrays = make_arrays(96)
  iterators = [
      pipeline.train_iterator(
          arrays,
          global_batch_size=16,
          image_size=16,
          seed=1,
          process_index=i,
          process_count=2,
          num_threads=0,
      )
      for i in range(2)
  ]
  epochs = [[ids_of(take(it, 6)) for _ in range(2)] for it in iterators]  # 48 / 8
  for epoch in range(2):
    local = [epochs[p][epoch] for p in range(2)]
    assert len(set(local[0]) & set(local[1])) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate(local)), np.arange(96))
  # Each epoch is shuffled differently.
  assert not np.array_equal(epochs[0][0], epochs[0][1])
  assert not np.array_equal(epochs[0][0], np.sort(epochs[0][0]))


@pytest.mark.parametrize("process_count", [2, 4])
def test_global_batches_do_not_depend_on_the_process_count(process_count):
  # 100 examples, global batch 16: 6 global batches per epoch; 14 steps cross two epochs.
  arrays = make_arrays(100)
  kwargs = dict(global_batch_size=16, image_size=12, seed=4, num_threads=0)
  single = take(pipeline.train_iterator(arrays, **kwargs), 14)
  parts = [
      take(
          pipeline.train_iterator(arrays, process_index=i, process_count=process_count, **kwargs),
          14,
      )
      for i in range(process_count)
  ]
  for step, batch in enumerate(single):
    for key in batch:
      # What jax.make_array_from_process_local_data assembles: the processes' parts in order.
      assembled = np.concatenate([part[step][key] for part in parts])
      np.testing.assert_array_equal(assembled, batch[key], err_msg=f"step {step}, {key}")


def test_partial_batches_are_dropped_per_epoch():
  # 50 examples, batch 8: 6 batches per epoch and no batch mixes two epochs.
  it = pipeline.train_iterator(
      make_arrays(50), global_batch_size=8, image_size=16, seed=0, num_threads=0
  )
  for _ in range(3):
    ids = ids_of(take(it, 6))
    assert len(np.unique(ids)) == 48


def test_stream_does_not_depend_on_threads():
  arrays = make_arrays(40)
  streams = [
      take(
          pipeline.train_iterator(
              arrays, global_batch_size=8, image_size=12, seed=5, num_threads=threads
          ),
          7,
      )
      for threads in (0, 3)
  ]
  assert_batches_equal(*streams)


def test_different_seed_gives_different_stream():
  arrays = make_arrays(40)
  a, b = (
      next(pipeline.train_iterator(arrays, global_batch_size=8, image_size=12, seed=s))
      for s in (0, 1)
  )
  assert not np.array_equal(a["image"], b["image"])


@pytest.mark.parametrize("num_threads", [0, 2])
def test_state_restore_reproduces_stream_across_epochs(num_threads):
  arrays = make_arrays(40)  # 5 batches per epoch
  kwargs = dict(global_batch_size=8, image_size=12, seed=3, num_threads=num_threads)
  it = pipeline.train_iterator(arrays, **kwargs)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 6)  # crosses the end of the first epoch
  restored = pipeline.train_iterator(arrays, **kwargs)
  restored.set_state(state)
  assert_batches_equal(take(restored, 6), expected)


def test_augment_config_as_mapping_and_no_augmentation():
  arrays = make_arrays(24)
  batch = next(
      pipeline.train_iterator(
          arrays, global_batch_size=8, image_size=16, seed=0, augment=NO_AUGMENT
      )
  )
  np.testing.assert_array_equal(batch["image"], arrays["image"][ids_of([batch])])
  with pytest.raises(TypeError):
    pipeline.train_iterator(
        arrays, global_batch_size=8, image_size=16, seed=0, augment={"colour_jitter": True}
    )


def test_invalid_batch_sizes():
  with pytest.raises(ValueError, match="divisible"):
    pipeline.train_iterator(
        make_arrays(40), global_batch_size=9, image_size=16, seed=0, process_count=2
    )
  with pytest.raises(ValueError, match="fewer"):
    pipeline.train_iterator(make_arrays(10), global_batch_size=16, image_size=16, seed=0)


def test_eval_batches_pad_the_last_batch():
  arrays = make_arrays(77)
  batches = list(pipeline.eval_batches(arrays, batch_size=16, image_size=16))
  assert len(batches) == pipeline.num_eval_batches(77, 16) == 5
  for b in batches:
    assert b["image"].shape == (16, 16, 16, 3) and b["image"].dtype == np.uint8
  last = batches[-1]
  np.testing.assert_array_equal(last["mask"], np.r_[np.ones(13), np.zeros(3)])
  assert np.all(last["image"][13:] == 0) and np.all(last["label"][13:] == 0)
  assert np.all(last["attributes"][13:] == -1)
  # Deterministic order and no augmentation.
  np.testing.assert_array_equal(ids_of(batches)[:77], np.arange(77))
  images = np.concatenate([b["image"] for b in batches])[:77]
  np.testing.assert_array_equal(images, arrays["image"])


def test_eval_batches_shard_evenly_over_processes():
  arrays = make_arrays(77)
  shards = [
      list(
          pipeline.eval_batches(
              arrays, batch_size=8, image_size=16, process_index=i, process_count=3
          )
      )
      for i in range(3)
  ]
  assert [len(s) for s in shards] == [pipeline.num_eval_batches(77, 8, 3)] * 3 == [4, 4, 4]
  real = np.concatenate([ids_of(s)[np.concatenate([b["mask"] for b in s]) > 0] for s in shards])
  np.testing.assert_array_equal(np.sort(real), np.arange(77))


def test_eval_batches_resize_other_image_sizes():
  batch = next(pipeline.eval_batches(make_arrays(5, size=24), batch_size=4, image_size=16))
  assert batch["image"].shape == (4, 16, 16, 3)


def test_random_resized_crop_box_is_valid():
  rng = np.random.default_rng(0)
  for _ in range(200):
    top, left, h, w = augment.random_resized_crop_box(rng, 20, 30, (0.35, 1.0), (3 / 4, 4 / 3))
    assert 0 <= top and top + h <= 20 and 0 <= left and left + w <= 30
    assert 0.3 <= h * w / 600 <= 1.0
  # No crop can satisfy this ratio range: fall back to the largest centred crop.
  assert augment.random_resized_crop_box(rng, 20, 20, (0.5, 1.0), (4.0, 5.0)) == (7, 0, 5, 20)


def test_crop_and_flip_invariants():
  image = np.random.default_rng(1).integers(0, 256, (24, 20, 3), dtype=np.uint8)
  rng = np.random.default_rng(0)
  out = augment.random_resized_crop(image, rng, 16)
  assert out.shape == (16, 16, 3) and out.dtype == np.uint8
  flipped = augment.horizontal_flip(image)
  np.testing.assert_array_equal(flipped[:, ::-1], image)
  np.testing.assert_array_equal(flipped[:, 0], image[:, -1])
  # The full image is the only crop with scale 1 and ratio 1.
  square = image[:20]
  np.testing.assert_array_equal(
      augment.random_resized_crop(square, rng, 16, scale=(1, 1), ratio=(1, 1)),
      augment.resize(square, 16),
  )
  np.testing.assert_array_equal(augment.resize(square, 20), square)


def test_flip_happens_about_half_the_time():
  image = np.random.default_rng(1).integers(0, 256, (8, 8, 3), dtype=np.uint8)
  config = augment.AugmentConfig(random_resized_crop=False, horizontal_flip=True)
  outputs = [augment.augment_image(image, np.random.default_rng(s), 8, config) for s in range(200)]
  flips = [np.array_equal(o, image[:, ::-1]) for o in outputs]
  assert all(f or np.array_equal(o, image) for f, o in zip(flips, outputs))
  assert 70 < sum(flips) < 130


def test_normalize_range():
  out = augment.normalize(np.array([0, 255], np.uint8))
  np.testing.assert_allclose(out, [-1.0, 1.0])
