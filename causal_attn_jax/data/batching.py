"""Pure-numpy batching for token sequences, with few distinct shapes so jit rarely recompiles.

Sequences are right-padded with ``pad_id`` to ``max_len``. Training batches are length-bucketed
and shuffled from ``(seed, epoch)`` only, so a resumed run sees the same batches; with
``boundaries`` each is trimmed to the smallest boundary that fits (one compiled shape per
boundary). Eval batches keep one shape, the last padded with ``mask`` False.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

MASK_KEY = "mask"


def pad_to_length(
    sequences: Sequence[Sequence[int]] | np.ndarray, length: int, pad_id: int = 0
) -> np.ndarray:
  """int32 [N, length]: each sequence truncated at the end or right-padded with ``pad_id``."""
  out = np.full((len(sequences), length), pad_id, np.int32)
  for i, seq in enumerate(sequences):
    seq = np.asarray(seq, np.int32)[:length]
    out[i, : len(seq)] = seq
  return out


def padding_mask(ids: np.ndarray, pad_id: int = 0) -> np.ndarray:
  """bool mask, True where ``ids`` is a real token (not ``pad_id``)."""
  return np.asarray(ids) != pad_id


def sequence_lengths(ids: np.ndarray, pad_id: int = 0) -> np.ndarray:
  """int32 [N]: tokens up to and including the last non-pad token of each row."""
  mask = padding_mask(ids, pad_id)
  last = mask.shape[-1] - np.argmax(mask[..., ::-1], axis=-1)
  return np.where(mask.any(-1), last, 0).astype(np.int32)


def bucket_length(longest: int, boundaries: Sequence[int]) -> int:
  """The smallest boundary >= ``longest`` (the largest boundary if none is)."""
  fits = [b for b in sorted(boundaries) if b >= longest]
  return fits[0] if fits else max(boundaries)


def bucketed_batches(
    lengths: Sequence[int] | np.ndarray,
    batch_size: int,
    *,
    seed: int,
    epoch: int = 0,
    pool_batches: int = 100,
    drop_remainder: bool = True,
) -> list[np.ndarray]:
  """Shuffled index batches whose examples have similar lengths.

  The examples are shuffled, cut into pools of ``pool_batches * batch_size`` (1 = no
  bucketing), each pool sorted by length and cut into batches, and the batch order shuffled.
  Returns int64 index arrays, one per batch.
  """
  if batch_size <= 0 or pool_batches <= 0:
    raise ValueError(f"batch_size {batch_size} and pool_batches {pool_batches} must be > 0.")
  lengths = np.asarray(lengths)
  rng = np.random.default_rng([seed, epoch])
  order = rng.permutation(len(lengths))
  pool_size = pool_batches * batch_size
  batches: list[np.ndarray] = []
  for start in range(0, len(order), pool_size):
    pool = order[start : start + pool_size]
    pool = pool[np.argsort(lengths[pool], kind="stable")]
    batches.extend(pool[i : i + batch_size] for i in range(0, len(pool), batch_size))
  if drop_remainder and batches and len(batches[-1]) < batch_size:
    batches.pop()
  return [batches[i] for i in rng.permutation(len(batches))]


def train_batches(
    arrays: Mapping[str, np.ndarray],
    batch_size: int,
    *,
    seed: int,
    epoch: int = 0,
    seq_keys: Sequence[str] = (),
    lengths: Sequence[int] | np.ndarray | None = None,
    boundaries: Sequence[int] | None = None,
    pool_batches: int = 100,
    pad_id: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
  """Yields one epoch of full, length-bucketed batches of ``arrays``.

  Args:
    seq_keys: Keys of [N, max_len] right-padded sequences; their longest length is the
      bucketing length unless ``lengths`` is given, and they are trimmed to ``boundaries``.
    boundaries: Allowed sequence lengths, e.g. (32, 64, 128); None keeps ``max_len``.
  """
  n = _common_length(arrays)
  if lengths is None:
    if not seq_keys:
      raise ValueError("train_batches needs seq_keys or lengths to bucket by.")
    lengths = np.max([sequence_lengths(arrays[key], pad_id) for key in seq_keys], axis=0)
  if len(lengths) != n:
    raise ValueError(f"{len(lengths)} lengths for {n} examples.")
  for indices in bucketed_batches(
      lengths, batch_size, seed=seed, epoch=epoch, pool_batches=pool_batches
  ):
    batch = {key: value[indices] for key, value in arrays.items()}
    for key in seq_keys if boundaries else ():
      longest = int(sequence_lengths(batch[key], pad_id).max(initial=0))
      batch[key] = batch[key][:, : bucket_length(longest, boundaries)]
    yield batch


def num_eval_batches(num_examples: int, batch_size: int) -> int:
  """Batches ``eval_batches`` yields: ceil(num_examples / batch_size)."""
  return -(-num_examples // batch_size)


def eval_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int
) -> Iterator[dict[str, np.ndarray]]:
  """Yields fixed-shape batches in order, the last padded with zeros and ``mask`` False.

  One compiled eval step serves all batches; metrics must weight by ``mask``.
  """
  if batch_size <= 0:
    raise ValueError(f"batch_size {batch_size} must be > 0.")
  if MASK_KEY in arrays:
    raise ValueError(f"arrays already have a {MASK_KEY!r} key.")
  n = _common_length(arrays)
  for start in range(0, n, batch_size):
    stop = min(start + batch_size, n)
    batch = {}
    for key, value in arrays.items():
      part = value[start:stop]
      if len(part) < batch_size:
        pad = np.zeros((batch_size - len(part),) + part.shape[1:], part.dtype)
        part = np.concatenate([part, pad])
      batch[key] = part
    mask = np.zeros(batch_size, bool)
    mask[: stop - start] = True
    batch[MASK_KEY] = mask
    yield batch


def _common_length(arrays: Mapping[str, np.ndarray]) -> int:
  sizes = {key: len(value) for key, value in arrays.items()}
  if len(set(sizes.values())) > 1:
    raise ValueError(f"arrays have different lengths: {sizes}.")
  if not sizes:
    raise ValueError("no arrays to batch.")
  return next(iter(sizes.values()))
