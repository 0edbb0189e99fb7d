"""Training batches put on the device ahead of the step that reads them.

`DevicePrefetch` reads the host iterator and transfers its batches (`shard_batch`) in a
background thread, `size` batches ahead, so that the host-to-device copy of batch n + 1
overlaps step n instead of preceding it. Its `get_state()` is the host iterator's state after
the last batch handed out, not after the last one read ahead: a checkpoint saved after step n
resumes at batch n + 1 exactly as without prefetching.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

# Batches transferred ahead of the step: one in flight while the step runs, one ready.
DEFAULT_PREFETCH = 2
_POLL_SECONDS = 0.1


class DevicePrefetch:
  """An iterator of device batches with the checkpointable state of the host iterator it reads.

  The background thread starts at the first `next`, so `set_state` (a resumed run) must come
  before it; the thread stops at `close()` (and at the end or an error of the host iterator,
  which `next` then raises in the caller's thread).
  """

  def __init__(
      self,
      iterator: Any,
      put: Callable[[Mapping[str, Any]], Any],
      size: int = DEFAULT_PREFETCH,
  ):
    if size < 1:
      raise ValueError(f"size must be >= 1, got {size}.")
    self._iterator = iterator
    self._put = put
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._state: dict | None = None

  def _fill(self) -> None:
    while not self._stop.is_set():
      try:
        item = (self._put(next(self._iterator)), self._iterator.get_state(), None)
      except BaseException as e:  # pylint: disable=broad-except
        item = (None, None, e)  # Raised by `next` in the training thread.
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=_POLL_SECONDS)
          break
        except queue.Full:
          continue
      if item[2] is not None:
        return

  def __iter__(self) -> DevicePrefetch:
    return self

  def __next__(self) -> Any:
    if self._thread is None:
      self._state = self._iterator.get_state()
      self._thread = threading.Thread(target=self._fill, name="device_prefetch", daemon=True)
      self._thread.start()
    batch, state, error = self._queue.get()
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
    """Stops the background thread (batches read ahead are dropped)."""
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()
