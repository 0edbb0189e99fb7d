"""Input pipelines: an infinite, checkpointable grain iterator for training and a padded,
deterministic single pass for evaluation.

Both yield this process's dicts of numpy arrays: ``image`` uint8 [b, S, S, 3] (normalised on
the accelerator by ``augment.normalize_on_device``, so a batch crosses at a quarter of
float32's bytes), ``label`` int32 [b], ``attributes`` int32 [b, m] (-1 missing), ``mask``
float32 [b] (0 for padding) and, in evaluation, ``index`` int32 [b] (the row in its split,
-1 for padding).

A split may hold ``path`` (image files, decoded on read by ``images.py``) instead of
``image``, so datasets larger than memory stream from disk; ``num_workers`` > 0 decodes in
worker processes (grain's ``mp_prefetch``), scaling with cores rather than threads.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import grain
import numpy as np
from absl import flags

from fairmoe_jax.data import augment as augment_lib
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.data.augment import AugmentConfig
from trainkit.errors import UserError

Batch = dict[str, np.ndarray]


class ArraySource:
  """Random-access grain source over parallel in-memory arrays (``image`` or ``path``)."""

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    self._image_key = "image" if "image" in arrays else "path"
    self._arrays = {k: arrays[k] for k in (self._image_key, "label", "attributes")}
    self._len = len(self._arrays["label"])
    if any(len(v) != self._len for v in self._arrays.values()):
      raise ValueError(f"{self._image_key}, label and attributes must have the same length.")

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in self._arrays.items()}


class ProcessBlocks(grain.MapDataset):
  """This process's part of each global batch of a (shuffled, augmented) global stream.

  The parent's first ``num_batches * global_batch_size`` elements are cut into global
  batches; process ``i`` reads the ``i``-th block of ``global_batch_size // process_count``
  consecutive elements of each. Batching this dataset by that size and concatenating the
  processes' batches in process order (``jax.make_array_from_process_local_data``) gives
  exactly the global batch one process would read: the training stream does not depend on
  the number of processes. Indices past one epoch map to the parent's next epoch, as
  grain's slice does, so the parent's shuffle and augmentation change every epoch.
  """

  def __init__(
      self,
      parent: grain.MapDataset,
      *,
      global_batch_size: int,
      process_index: int,
      process_count: int,
  ):
    super().__init__(parent)
    self._parent_length = len(parent)
    self._global = global_batch_size
    self._local = global_batch_size // process_count
    self._offset = process_index * self._local
    self._length = (self._parent_length // global_batch_size) * self._local

  def __len__(self) -> int:
    return self._length

  def _parent_index(self, index: int) -> int:
    epoch, position = divmod(index, self._length)
    batch, within = divmod(position, self._local)
    return epoch * self._parent_length + batch * self._global + self._offset + within

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[self._parent_index(index)]


# How training resamples an image file: "one_pass" crops straight from the file's pixels;
# "two_pass" resizes to the decode square first (bicubic), then crops (bilinear)
# (docs/design.md, "Training images in one resampling pass").
TRAIN_RESAMPLING = ("one_pass", "two_pass")
Resampling = Literal["one_pass", "two_pass"]


def train_decode_size(image_size: int) -> int:
  """Side at which training decodes image files: larger than the output, so the random crop
  resamples from more pixels than it emits, as on pre-decoded images."""
  return round(image_size * 1.15)


# How often a worker process checks that the process that started it is still there.
_PARENT_CHECK_S = 0.25


def _watch_parent(parent: int) -> None:
  while os.getppid() == parent:
    time.sleep(_PARENT_CHECK_S)
  os._exit(0)  # pylint: disable=protected-access  # Nothing of a worker is worth a clean exit.


def _worker_init(parent: int, worker_index: int, num_workers: int) -> None:
  """Runs first in each grain worker process (`mp_prefetch`'s `worker_init_fn`).

  Workers ignore Ctrl-C, so only the main process reacts (closing the iterator stops them).
  Each worker ends once its parent is gone: a SIGKILLed main process runs no clean-up, and
  orphaned workers hold memory and the resource tracker. A polling thread rather than
  PR_SET_PDEATHSIG, which fires when the starting thread (the read-ahead one) ends.
  """
  del worker_index, num_workers
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


class TrainBatches:
  """The training batches of `train_iterator`, with a state independent of `num_workers`.

  The state is ``{"next_index": N}``, the batches read so far (grain's in-process state);
  grain's per-worker state would tie a checkpoint to its worker count. `set_state` also reads
  a per-worker state by summing the positions. Resuming at N reads `dataset[N:]`.
  """

  def __init__(self, dataset: grain.MapDataset, read_options: grain.ReadOptions, num_workers: int):
    self._dataset, self._read_options, self._num_workers = dataset, read_options, num_workers
    self._start = 0  # The batch the underlying iterator starts at.
    self._read = 0  # Batches read from it.
    self._iterator: Iterator[Batch] | None = None  # Made at the first `next`.

  def _open(self) -> Iterator[Batch]:
    dataset = self._dataset[self._start :] if self._start else self._dataset
    batches = dataset.to_iter_dataset(self._read_options)
    if self._num_workers:
      # grain passes its absl flags to the workers; a program that never parsed flags (a
      # notebook, a test, a script without absl.app) takes their defaults rather than failing.
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
      # Worker w prepares batches w, w + num_workers, ... and grain interleaves them back in
      # order, so the stream is the one of num_workers=0.
      batches = batches.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=self._num_workers),
          worker_init_fn=functools.partial(_worker_init, os.getpid()),
      )
    return iter(batches)

  def __iter__(self) -> TrainBatches:
    return self

  def __next__(self) -> Batch:
    if self._iterator is None:
      self._iterator = self._open()
    try:
      batch = next(self._iterator)
    except RuntimeError as e:
      if "Worker process was terminated unexpectedly" not in str(e):
        raise
      code = str(e).split("exit code", 1)[-1].strip().split(".")[0]
      raise UserError(
          f"a data worker process (data.num_workers={self._num_workers}) died with exit code "
          f"{code} (negative: killed by that signal, e.g. 9 by the out-of-memory killer); rerun "
          "the same command to resume from the latest checkpoint, with a lower "
          "data.num_workers if memory is short"
      ) from None
    self._read += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"next_index": self._start + self._read}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes at a state of `get_state` or grain's; ValueError (checkpoint skipped) if not."""
    start = _stream_position(state)
    self.close()
    self._start, self._read = start, 0

  def close(self) -> None:
    """Stops the worker processes, if any (a later `next` starts them again)."""
    if self._iterator is not None:
      close = getattr(self._iterator, "close", None)
      if close is not None:
        close()
      self._iterator = None

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # At interpreter exit, modules may be gone.
      pass


def _stream_position(state: Mapping[str, Any]) -> int:
  """Batches read, from ``{"next_index": N}`` or grain's W-worker state (worker w read batches
  w, w + W, ...: N is their sum, and each n_w follows from N)."""
  if not isinstance(state, Mapping):
    raise ValueError(f"not a data-iterator state: {state!r}")
  if set(state) == {"next_index"}:
    index = state["next_index"]
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
      return index
    raise ValueError(f"next_index must be an integer >= 0, got {index!r}")
  workers = state.get("iterators_in_use_states")
  if (
      isinstance(workers, list)
      and workers
      and all(isinstance(w, Mapping) and set(w) == {"next_index"} for w in workers)
      and all(isinstance(w["next_index"], int) and w["next_index"] >= 0 for w in workers)
      and not state.get("future_states")
  ):
    total = sum(w["next_index"] for w in workers)
    count = len(workers)
    expected = [total // count + (w < total % count) for w in range(count)]
    if [w["next_index"] for w in workers] == expected:
      return total
  raise ValueError(
      f"not a position of the training stream (a state of another data pipeline?): {state!r}"
  )


def train_iterator(
    arrays: Mapping[str, np.ndarray],
    *,
    global_batch_size: int,
    image_size: int,
    seed: int,
    augment: AugmentConfig | Mapping[str, Any] | None = None,
    process_index: int = 0,
    process_count: int = 1,
    num_threads: int = 2,
    prefetch_buffer_size: int = 4,
    decode_size: int | None = None,
    num_workers: int = 0,
    resampling: Resampling = "one_pass",
) -> TrainBatches:
  """Infinite iterator of augmented training batches for this process.

  Every epoch is a fresh seeded shuffle of the whole split, cut into global batches (dropping
  the remainder); process ``i`` reads the ``i``-th block of each (``ProcessBlocks``).
  Augmentation randomness comes from ``seed`` and the position in the global stream, so the
  global batches are the same whatever the number of processes, threads or workers.

  ``num_threads`` (0: prepared on ``next``) and ``prefetch_buffer_size`` are per worker
  process (``num_workers``; 0 prepares batches in this process). ``path`` splits only:
  ``decode_size`` is the square the random crop is drawn in (``None``: ``train_decode_size``),
  ``resampling`` one of ``TRAIN_RESAMPLING``. ``set_state`` on a fresh ``TrainBatches`` (any
  ``num_workers``) resumes the exact stream.
  """
  if not isinstance(augment, AugmentConfig):
    augment = AugmentConfig(**(augment or {}))
  if resampling not in TRAIN_RESAMPLING:
    raise ValueError(f"resampling must be one of {TRAIN_RESAMPLING}, got {resampling!r}.")
  if num_workers < 0:
    raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
  if global_batch_size % process_count:
    raise ValueError(
        f"global_batch_size {global_batch_size} is not divisible by "
        f"process_count {process_count}."
    )
  source = ArraySource(arrays)
  if len(source) < global_batch_size:
    raise ValueError(
        f"{len(source)} examples are fewer than one global batch of {global_batch_size}."
    )
  decode_size = decode_size or train_decode_size(image_size)
  # Independent of the process, so that the stream is too (the `0` keeps existing streams).
  augment_seed = int(np.random.SeedSequence([seed, 0]).generate_state(1)[0])

  def augmented(example: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
    if "image" in example:
      return augment_lib.augment_image(example["image"], rng, image_size, augment)
    if resampling == "one_pass":
      return images_lib.read_image(
          example["path"],
          decode_size,
          lambda image: augment_lib.augment_decoded(image, rng, image_size, decode_size, augment),
      )
    image = images_lib.load_image(example["path"], decode_size)
    return augment_lib.augment_image(image, rng, image_size, augment)

  def transform(example: dict[str, np.ndarray], rng: np.random.Generator) -> Batch:
    return {
        "image": augmented(example, rng),
        "label": np.int32(example["label"]),
        "attributes": example["attributes"].astype(np.int32),
        "mask": np.float32(1.0),
    }

  dataset = (
      grain.MapDataset.source(source)
      .shuffle(seed=seed % 2**32)
      .random_map(transform, seed=augment_seed)
  )
  dataset = (
      ProcessBlocks(
          dataset,
          global_batch_size=global_batch_size,
          process_index=process_index,
          process_count=process_count,
      ).batch(global_batch_size // process_count, drop_remainder=True)
      # Repeating after batching keeps batches within epochs; it re-seeds the
      # shuffle and the augmentation for every epoch.
      .repeat(None)
  )
  read_options = grain.ReadOptions(
      num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size
  )
  return TrainBatches(dataset, read_options, num_workers)


def num_eval_batches(num_examples: int, batch_size: int, process_count: int = 1) -> int:
  """Batches per process for ``eval_batches``; the same on every process."""
  return math.ceil(math.ceil(num_examples / process_count) / batch_size)


def eval_batches(
    arrays: Mapping[str, np.ndarray],
    *,
    batch_size: int,
    image_size: int,
    process_index: int = 0,
    process_count: int = 1,
    num_threads: int = images_lib.DEFAULT_NUM_THREADS,
) -> Iterator[Batch]:
  """One deterministic, unaugmented pass over a split for this process.

  Process ``i`` evaluates examples ``i, i + process_count, ...``; images of another size
  than ``image_size`` are resized. The last batches are padded to ``batch_size`` (zero image,
  label 0, attributes -1, mask 0, index -1) so that all processes yield
  ``num_eval_batches(...)`` full batches and together cover every example exactly once.
  """
  source = ArraySource(arrays)
  indices = np.arange(process_index, len(source), process_count)
  num_attributes = arrays["attributes"].shape[1]
  for b in range(num_eval_batches(len(source), batch_size, process_count)):
    batch_indices = indices[b * batch_size : (b + 1) * batch_size]
    n = len(batch_indices)
    batch = {
        "image": np.zeros((batch_size, image_size, image_size, 3), np.uint8),
        "label": np.zeros((batch_size,), np.int32),
        "attributes": np.full((batch_size, num_attributes), -1, np.int32),
        "mask": np.zeros((batch_size,), np.float32),
        "index": np.full((batch_size,), -1, np.int32),
    }
    if n:
      if "image" in arrays:
        images = arrays["image"][batch_indices]
      else:
        images = images_lib.load_images(arrays["path"][batch_indices], image_size, num_threads)
      if images.shape[1:3] != (image_size, image_size):
        images = np.stack([augment_lib.resize(im, image_size) for im in images])
      batch["image"][:n] = images
      batch["label"][:n] = arrays["label"][batch_indices]
      batch["attributes"][:n] = arrays["attributes"][batch_indices]
      batch["mask"][:n] = 1.0
      batch["index"][:n] = batch_indices
    yield batch
