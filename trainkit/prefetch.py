"""Training batches put on the device ahead of the step that reads them, in a background thread,
so the copy of batch n + 1 overlaps step n; `get_state()` is the host iterator's after the last
batch handed out, so resuming is exact.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any

# One in flight while the step runs and one ready: a transfer as slow as a step never waits.
DEFAULT_PREFETCH = 2


def resident_batches(size: int = DEFAULT_PREFETCH) -> int:
  """Training batches on the devices during a step of a loop reading `DevicePrefetch(..., size)`:
  the step's own and `size` ahead of it."""
  if size < 0:
    raise ValueError(f"size must be >= 0, got {size}.")
  return size + 1


class DevicePrefetch:
  """An iterator of device batches, `size` placed ahead of the one handed out last (0: none, no
  thread), with the checkpointable state of the host iterator it reads; reading ahead starts at
  the first `next`, so `set_state` comes before."""

  def __init__(
      self, iterator: Any, put: Callable[[Mapping[str, Any]], Any], size: int = DEFAULT_PREFETCH
  ):
    self._size = resident_batches(size) - 1  # Checked.
    self._iterator = iterator
    self._put = put
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._ahead: collections.deque[concurrent.futures.Future] = collections.deque()
    self._state: dict | None = None

  def _read(self) -> tuple[Any, dict]:
    return self._put(next(self._iterator)), self._iterator.get_state()

  def __iter__(self) -> DevicePrefetch:
    return self

  def __next__(self) -> Any:
    if self._size == 0:
      return self._put(next(self._iterator))
    if self._pool is None:
      self._state = self._iterator.get_state()
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="device_prefetch")
    # One thread reads the batches in order; the caller's last batch released, one more is placed.
    while len(self._ahead) <= self._size:
      self._ahead.append(self._pool.submit(self._read))
    try:
      batch, self._state = self._ahead.popleft().result()
    except BaseException:  # The host iterator's error (or its end), raised in order.
      self.close()
      raise
    return batch

  def get_state(self) -> dict:
    """The host iterator's state after the last batch `next` returned."""
    return self._iterator.get_state() if self._state is None else self._state

  def set_state(self, state: dict) -> None:
    if self._pool is not None:
      raise RuntimeError("DevicePrefetch.set_state after batches were read ahead.")
    self._iterator.set_state(state)

  def close(self) -> None:
    """Stops reading ahead and drops the batches read ahead."""
    for future in self._ahead:
      future.cancel()
    self._ahead.clear()
    if self._pool is not None:
      self._pool.shutdown(wait=True)
