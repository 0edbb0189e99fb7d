"""Training batches put on the device ahead of the step that reads them, in a background thread,
so the copy of batch n + 1 overlaps step n; `get_state()` is the host iterator's after the last
batch handed out, so resuming is exact.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

# One in flight while the step runs and one ready: a transfer as slow as a step never waits.
DEFAULT_PREFETCH = 2
_POLL_SECONDS = 0.1


def resident_batches(size: int = DEFAULT_PREFETCH) -> int:
  """Training batches on the devices during a step of a loop reading `DevicePrefetch(..., size)`:
  the step's own and `size` ahead of it."""
  if size < 0:
    raise ValueError(f"size must be >= 0, got {size}.")
  return size + 1


class DevicePrefetch:
  """An iterator of device batches, at most `size` waiting (0: none, no thread), with the
  checkpointable state of the host iterator it reads; the thread starts at the first `next`, so
  `set_state` comes before."""

  def __init__(
      self, iterator: Any, put: Callable[[Mapping[str, Any]], Any], size: int = DEFAULT_PREFETCH
  ):
    if size < 0:
      raise ValueError(f"size must be >= 0, got {size}.")
    self._size = size
    self._iterator = iterator
    self._put = put
    # A free slot per batch the thread may still place; the queue never holds more than `size`.
    self._slots = threading.Semaphore(size)
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._state: dict | None = None

  def _fill(self) -> None:
    while not self._stop.is_set():
      # The slot comes first: a batch is placed on the devices only where it may wait there.
      if not self._slots.acquire(timeout=_POLL_SECONDS):
        continue
      try:
        item = (self._put(next(self._iterator)), self._iterator.get_state(), None)
      except BaseException as e:  # pylint: disable=broad-except
        item = (None, None, e)  # Raised by `next` in the training thread.
      self._queue.put(item)
      if item[2] is not None:
        return

  def __iter__(self) -> DevicePrefetch:
    return self

  def __next__(self) -> Any:
    if self._size == 0:
      return self._put(next(self._iterator))
    if self._thread is None:
      self._state = self._iterator.get_state()
      self._thread = threading.Thread(target=self._fill, name="device_prefetch", daemon=True)
      self._thread.start()
    batch, state, error = self._queue.get()
    self._slots.release()  # The caller holds this batch now: the thread may place the next.
    if error is not None:
      self.close()
      raise error
    self._state = state
    return batch

  def get_state(self) -> dict:
    """The host iterator's state after the last batch `next` returned."""
    return self._iterator.get_state() if self._state is None else self._state

  def set_state(self, state: dict) -> None:
    if self._thread is not None:
      raise RuntimeError("DevicePrefetch.set_state after batches were read ahead.")
    self._iterator.set_state(state)

  def close(self) -> None:
    """Stops the background thread and drops the batches read ahead."""
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
