"""Metrics to `metrics.jsonl` and TensorBoard event files (tensorboardX: no TensorFlow needed)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import tempfile
from typing import Any, Mapping

import numpy as np

from trainkit import storage
from trainkit.errors import UserError

_log = logging.getLogger(__name__)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The records of an append-only JSON-lines log, tolerating a torn last line.

  A process killed (or a disk filled) mid-append leaves a partial last line: it is dropped with
  one warning, since the run it belongs to rewrites it on resume. A bad line anywhere else is a
  UserError naming the file and line: the log was edited or corrupted, not torn.
  """
  lines = storage.read_text(path).split("\n")
  records = []
  numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
  for position, (number, line) in enumerate(numbered):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if position == len(numbered) - 1:
        _log.warning("%s: line %d is a torn write (%s); it is dropped", path, number, e.msg)
        break
      raise UserError(f"{path}: line {number} is not a JSON record ({e.msg})") from None
  return records


def write_atomically(path: str, text: str | bytes) -> None:
  """Replaces `path` with `text` through a temporary file and a rename: never half-written (a
  write that fails, e.g. on a full disk, leaves `path` as it was and no temporary file).

  On an object store (`gs://`) the object is uploaded whole, which publishes it atomically
  (`trainkit.storage`)."""
  if storage.is_remote(path):
    target = storage.path(path)
    target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)
    return
  fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      f.write(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    if isinstance(e, OSError):
      e.filename = e.filename or path  # A write's error names no file.
    raise


def append_line(path: str, line: str) -> None:
  """Appends `line` (and a newline) to an append-only log, all or nothing: a write that fails
  (a full disk) is cut back, so the log never keeps a partial line of a run still alive.

  On an object store, which has no append, the object is rewritten whole with the line added."""
  if storage.is_remote(path):
    target = storage.path(path)
    earlier = target.read_text() if target.exists() else ""
    target.write_text(earlier + line + "\n")
    return
  data = (line + "\n").encode()
  with open(path, "ab", buffering=0) as f:
    start = f.seek(0, os.SEEK_END)
    try:
      written = 0
      while written < len(data):
        written += f.write(data[written:])
    except OSError as e:
      os.ftruncate(f.fileno(), start)  # Frees what the failed write took; needs no space.
      e.filename = e.filename or path  # A write's error names no file.
      raise


class _RemoteEventFile:
  """A TensorBoard event file on an object store, written through etils.epath: the events are
  kept in memory and the object is uploaded whole at each flush (an object cannot be appended
  to), as tensorboardX's own gs:// writer does through google-cloud-storage."""

  def __init__(self, location: str):
    self._path = storage.path(location)
    self._buffer = io.BytesIO()

  def write(self, data: bytes) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    self._path.write_bytes(self._buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _RemoteEventFiles:
  """tensorboardX's writer factory (`register_writer_factory`) for a URI scheme."""

  def open(self, location: str) -> _RemoteEventFile:
    return _RemoteEventFile(location)

  def directory_check(self, location: str) -> None:
    storage.makedirs(location)


def _register_remote_event_files(scheme: str) -> None:
  """Has tensorboardX write `scheme://` event files through etils.epath, the file system every
  other file of the run goes through (its own gs:// writer needs google-cloud-storage and
  bypasses it)."""
  from tensorboardX import record_writer

  record_writer.register_writer_factory(scheme, _RemoteEventFiles())


def _to_python(value: Any) -> Any:
  value = np.asarray(value)
  if value.ndim == 0:
    item = value.item()
    return None if isinstance(item, float) and not math.isfinite(item) else item
  return value.tolist()


class MetricWriter:
  """Writes one JSON object per step to `<workdir>/metrics.jsonl` and scalars to TensorBoard.

  Scalars written for the same step (training, then evaluation) are merged into one
  line, flushed when a later step arrives or on `flush()`. Only process 0 writes.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self.path = storage.join(workdir, "metrics.jsonl")
    self._pending_step: int | None = None
    self._pending: dict[str, Any] = {}
    self._last_flushed: dict[str, Any] | None = None
    self._tb = None
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter  # Imported lazily: only process 0 needs it.

      logdir = storage.join(workdir, "tensorboard")
      if storage.is_remote(logdir):
        _register_remote_event_files(storage.scheme(logdir))
      self._tb = SummaryWriter(logdir=logdir)

  def truncate_after(self, step: int) -> None:
    """Drops lines logged after `step` (and a torn last line): a resumed run rewrites them, so
    none are duplicated."""
    if not self.enabled or not storage.path(self.path).exists():
      return
    kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
    write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    if self._pending_step is not None and step != self._pending_step:
      self.flush()
    self._pending_step = step
    for name, value in scalars.items():
      value = _to_python(value)
      self._pending[name] = value
      if self._tb is not None and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, step)

  def flush(self) -> None:
    if not self.enabled or self._pending_step is None:
      return
    record = {"step": self._pending_step, **self._pending}
    if self._last_flushed is not None and self._last_flushed["step"] == record["step"]:
      # More scalars for a step already on disk (e.g. the final test evaluation after
      # the final checkpoint): rewrite its line, so each step keeps exactly one line.
      record = {**self._last_flushed, **self._pending}
      lines = storage.read_text(self.path).splitlines(keepends=True)[:-1]
      write_atomically(self.path, "".join(lines) + json.dumps(record) + "\n")
    else:
      append_line(self.path, json.dumps(record))
    self._last_flushed = record
    self._pending_step, self._pending = None, {}
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """Reads `metrics.jsonl` back (a torn last line is dropped, `read_jsonl`)."""
  return read_jsonl(storage.join(workdir, "metrics.jsonl"))
