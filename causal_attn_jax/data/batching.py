"""Pure-numpy batching for token sequences, with few distinct shapes so jit rarely recompiles.

Sequences are right-padded with ``pad_id`` to ``max_len``. Training batches are length-bucketed
and shuffled from ``(seed, epoch)`` only, so a resumed run sees the same batches. Eval batches
keep one shape, the last padded with ``mask`` False.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

MASK_KEY = "mask"


def sequence_lengths(ids: np.ndarray, pad_id: int = 0) -> np.ndarray:
  """int32 [N]: tokens up to and including the last non-pad token of each row."""
  mask = np.asarray(ids) != pad_id
  last = mask.shape[-1] - np.argmax(mask[..., ::-1], axis=-1)
  return np.where(mask.any(-1), last, 0).astype(np.int32)


def bucketed_batches(
    lengths: Sequence[int] | np.ndarray,
    batch_size: int,
    *,
    seed: int,
    epoch: int = 0,
    pool_batches: int = 100,
) -> list[np.ndarray]:
  """Shuffled index batches whose examples have similar lengths.

  The examples are shuffled, cut into pools of ``pool_batches * batch_size`` (1 = no
  bucketing), each pool sorted by length and cut into batches (a short last one dropped), and
  the batch order shuffled. Returns int64 index arrays, one per batch.
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
  if batches and len(batches[-1]) < batch_size:
    batches.pop()
  return [batches[i] for i in rng.permutation(len(batches))]


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
  sizes = {key: len(value) for key, value in arrays.items()}
  if len(set(sizes.values())) > 1:
    raise ValueError(f"arrays have different lengths: {sizes}.")
  if not sizes:
    raise ValueError("no arrays to batch.")
  n = next(iter(sizes.values()))
  for start in range(0, n, batch_size):
    batch = {}
    for key, value in arrays.items():
      part = value[start : start + batch_size]
      batch[key] = np.pad(part, [(0, batch_size - len(part))] + [(0, 0)] * (part.ndim - 1))
    batch[MASK_KEY] = np.arange(batch_size) < n - start
    yield batch
