"""Feeding the mesh from host numpy splits: the resumable training iterator and the eval pass.

Every process holds the whole tokenised split, orders it the same way and puts only its own
block of each global batch on the mesh (`trainkit.mesh.process_block`), so no process needs to
exchange data with another and a run on n processes sees the batches a run on one would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from causal_attn_jax.data import batching
from trainkit.errors import UserError
from trainkit.mesh import process_block, shard_batch


class TrainIterator:
  """Endless fixed-shape, length-bucketed training batches; its state is {"epoch", "index"}.

  Each epoch's order depends only on (seed, epoch), so two integers restore the exact position.
  """

  def __init__(
      self, arrays: dict[str, np.ndarray], batch_size: int, *, seed: int, seq_keys: Sequence[str]
  ):
    self.arrays = arrays
    self.batch_size = batch_size
    self.seed = seed
    self.lengths = np.max([batching.sequence_lengths(arrays[k]) for k in seq_keys], axis=0)
    self.epoch, self.index = 0, 0
    self._order: list[np.ndarray] | None = None

  def _batches(self) -> list[np.ndarray]:
    if self._order is None:
      self._order = batching.bucketed_batches(
          self.lengths, self.batch_size, seed=self.seed, epoch=self.epoch
      )
      if not self._order:
        raise UserError(f"fewer training examples than one batch (batch_size={self.batch_size})")
    return self._order

  def __next__(self) -> dict[str, np.ndarray]:
    while self.index >= len(self._batches()):
      self.epoch, self.index, self._order = self.epoch + 1, 0, None
    indices = process_block(self._batches()[self.index])
    self.index += 1
    return {k: v[indices] for k, v in self.arrays.items()}

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index}

  def set_state(self, state: dict) -> None:
    """Resumes the stream; a state without its position is an error, never a silent restart."""
    missing = {"epoch", "index"} - set(state)
    if missing:
      raise ValueError(f"data-iterator state lacks {sorted(missing)}")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])
    self._order = None


def device_batches(
    arrays: dict[str, np.ndarray], batch_size: int, mesh: Mesh
) -> Iterator[tuple[dict[str, np.ndarray], dict[str, jax.Array]]]:
  """(global host batch, its device array) pairs of one padded pass (`batching.eval_batches`).

  The host batch is the whole global batch (the caller scores against it); only this process's
  block goes to the devices.
  """
  for batch in batching.eval_batches(arrays, batch_size):
    yield batch, shard_batch(process_block(batch), mesh)
