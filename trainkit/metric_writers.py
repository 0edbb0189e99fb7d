"""Metrics to `metrics.jsonl` and TensorBoard event files (tensorboardX: no TensorFlow needed)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any, Mapping

import numpy as np
from tensorboardX import RecordWriter

from trainkit import storage
from trainkit.errors import UserError
from trainkit.storage import write_atomically

_log = logging.getLogger(__name__)


def parse_jsonl(text: str, path: str) -> list[dict[str, Any]]:
  """The records of the JSON-lines `text` read from `path`: a torn last line (a kill mid-append,
  which the resumed run rewrites) is dropped with a warning; a bad line elsewhere is a UserError."""
  lines = text.split("\n")
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


# An object store has no append (and rewriting the whole log per flush is quadratic): each flush
# is an object `<name>.parts/<n>` (zero-padded), read after `<name>` and folded into it on close.
PARTS_SUFFIX = ".parts"
_PART_DIGITS = 9


def _part_names(path: str) -> list[str]:
  """The parts of the remote log `path`, in order (none when it has no parts folder)."""
  try:
    names = [child.name for child in storage.path(path + PARTS_SUFFIX).iterdir()]
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted((n for n in names if n.isdigit()), key=int)


def _step_of(line: str) -> float | None:
  try:
    step = json.loads(line).get("step")
  except (ValueError, AttributeError):
    return None
  return step if isinstance(step, (int, float)) else None


def _remote_log_lines(path: str) -> tuple[list[str], list[str]]:
  """(the object's lines then its parts', the parts' names); parts whose steps the object holds
  already (a writer stopped between folding and deleting them) are skipped."""
  try:
    lines = storage.read_text(path).splitlines()
  except FileNotFoundError:
    lines = []
  names = _part_names(path)
  last = max((s for s in map(_step_of, lines) if s is not None), default=None)
  for name in names:
    for line in storage.read_text(storage.join(path + PARTS_SUFFIX, name)).splitlines():
      step = _step_of(line)
      if last is not None and step is not None and step <= last:
        continue
      lines.append(line)
      last = step if step is not None else last
  return lines, names


def read_log(path: str) -> str:
  """The text of an append-only log (on an object store, the object and its parts)."""
  if not storage.is_remote(path):
    return storage.read_text(path)
  lines, names = _remote_log_lines(path)
  if not lines and not names and not storage.path(path).exists():
    raise FileNotFoundError(path)
  return "".join(line + "\n" for line in lines)


def log_exists(path: str) -> bool:
  """Whether the append-only log `path` has been written (its file, object or parts)."""
  if storage.path(path).exists():
    return True
  return storage.is_remote(path) and bool(_part_names(path))


class RemoteLog:
  """An append-only log on an object store, one object per appended line (PARTS_SUFFIX), held
  in memory so that folding it costs one upload."""

  def __init__(self, path: str):
    self.path = path
    self._lines: list[str] | None = None
    self._parts: list[str] = []  # Every part in the store, this writer's and earlier ones.
    self._next = 0
    self._last_part: str | None = None  # The part holding the last line, while it does.

  def _load(self) -> list[str]:
    if self._lines is None:
      self._lines, self._parts = _remote_log_lines(self.path)
      self._next = int(self._parts[-1]) + 1 if self._parts else 0
    return self._lines

  def text(self) -> str:
    return "".join(line + "\n" for line in self._load())

  @property
  def has_parts(self) -> bool:
    """Whether parts are in the store (as far as this writer read or wrote them)."""
    return bool(self._parts)

  def append(self, line: str) -> None:
    lines = self._load()
    name = f"{self._next:0{_PART_DIGITS}d}"
    part = storage.join(self.path + PARTS_SUFFIX, name)
    storage.path(part).write_text(line + "\n")
    lines.append(line)
    self._parts.append(name)
    self._next += 1
    self._last_part = part

  def replace_last(self, line: str) -> None:
    """Replaces the log's last line (its part's object, or the log whole if it is folded)."""
    lines = self._load()
    lines[-1] = line
    if self._last_part is not None:
      storage.path(self._last_part).write_text(line + "\n")
    else:
      self.fold()

  def fold(self, lines: list[str] | None = None) -> None:
    """Writes the log (or `lines` in its place) as one object, then deletes its parts."""
    self._load()
    if lines is not None:
      self._lines = list(lines)
    write_atomically(self.path, self.text())
    if self._parts:
      # The folder whole: gcsfs batches the deletes (one by one, thousands take minutes).
      storage.path(self.path + PARTS_SUFFIX).rmtree(missing_ok=True)
    self._parts, self._last_part = [], None


def append_line(path: str, line: str) -> None:
  """Appends `line` and a newline to a local file, all or nothing (a failed write is cut back)."""
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


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # An int64 field's encoding (two's complement).
  out = bytearray()
  while n > 0x7F:
    out.append(n & 0x7F | 0x80)
    n >>= 7
  return bytes(out + bytes([n]))


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  if wire_type == 2:  # Length-delimited: a string or a message.
    payload = _varint(len(payload)) + payload
  return _varint(number << 3 | wire_type) + payload


def _event(step: int, *, file_version: str = "", tag: str = "", value: float = 0.0) -> bytes:
  """A serialised TensorBoard `Event` (event.proto's field numbers): the version record or one
  scalar, encoded here rather than through tensorboardX's private protos."""
  event = _field(1, 1, struct.pack("<d", time.time()))
  event += _field(2, 0, _varint(step)) if step else b""  # proto3 leaves a default value out.
  if file_version:
    return event + _field(3, 2, file_version.encode())
  scalar = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
  return event + _field(5, 2, _field(1, 2, scalar))


class _ScalarEvents:
  """TensorBoard scalars written in the caller's thread (tensorboardX's `RecordWriter`), so a
  failed write (a full disk) is raised to the loop. On an object store each flush uploads the new
  events as `<name>.NNNNNN`; `close` uploads the file whole as `<name>` and deletes the parts."""

  def __init__(self, logdir: str):
    storage.makedirs(logdir)
    # The name TensorBoard looks for, events.out.tfevents.<time>.<host>, as SummaryWriter's.
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self._remote = storage.is_remote(logdir)
    local_dir = tempfile.mkdtemp(prefix="trainkit-events-") if self._remote else logdir
    self._local, self._location = os.path.join(local_dir, name), storage.join(logdir, name)
    self._writer = RecordWriter(self._local)
    self._uploaded, self._parts = 0, []  # Bytes of the local file already in parts; the parts.
    self._writer.write(_event(0, file_version="brain.Event:2"))

  def add_scalar(self, name: str, value: float, step: int) -> None:
    self._writer.write(_event(step, tag=name, value=value))

  def flush(self) -> None:
    self._writer.flush()
    if not self._remote:
      return
    with open(self._local, "rb") as f:
      f.seek(self._uploaded)
      new = f.read()
    if new:
      part = f"{self._location}.{len(self._parts) + 1:06d}"
      storage.path(part).write_bytes(new)
      self._parts.append(part)
      self._uploaded += len(new)

  def close(self) -> None:
    self._writer.close()
    if not self._remote:
      return
    with open(self._local, "rb") as f:
      storage.path(self._location).write_bytes(f.read())
    for part in self._parts:
      storage.path(part).unlink(missing_ok=True)
    self._parts = []
    shutil.rmtree(os.path.dirname(self._local), ignore_errors=True)


def _to_python(value: Any) -> Any:
  value = np.asarray(value)
  if value.ndim == 0:
    item = value.item()
    return None if isinstance(item, float) and not math.isfinite(item) else item
  return value.tolist()


class MetricWriter:
  """One JSON line per step to `<workdir>/metrics.jsonl` (a step's scalars merged) and scalars
  to TensorBoard; only process 0 writes."""

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self.path = storage.join(workdir, "metrics.jsonl")
    # On an object store the log is written as parts (RemoteLog); None on a local disk.
    self._remote = RemoteLog(self.path) if storage.is_remote(self.path) else None
    self._pending_step: int | None = None
    self._pending: dict[str, Any] = {}
    self._last_flushed: dict[str, Any] | None = None
    self._tb: _ScalarEvents | None = None
    if enabled and tensorboard:
      self._tb = _ScalarEvents(storage.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Drops lines logged after `step` (and a torn last line): a resumed run rewrites them, so
    none are duplicated."""
    if not self.enabled or not log_exists(self.path):
      return
    text = self._remote.text() if self._remote is not None else read_log(self.path)
    kept = [json.dumps(r) for r in parse_jsonl(text, self.path) if r.get("step", 0) <= step]
    if self._remote is not None:
      self._remote.fold(kept)  # Its parts folded in: the run goes on with none.
    else:
      write_atomically(self.path, "".join(line + "\n" for line in kept))

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
      # More scalars for a step already written (a final test evaluation): one line per step.
      record = {**self._last_flushed, **self._pending}
      if self._remote is not None:
        self._remote.replace_last(json.dumps(record))
      else:
        lines = storage.read_text(self.path).splitlines(keepends=True)[:-1]
        write_atomically(self.path, "".join(lines) + json.dumps(record) + "\n")
    elif self._remote is not None:
      self._remote.append(json.dumps(record))
    else:
      append_line(self.path, json.dumps(record))
    self._last_flushed = record
    self._pending_step, self._pending = None, {}
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes; on an object store also folds the log's parts into `metrics.jsonl`."""
    self.flush()
    if self.enabled and self._remote is not None and self._remote.has_parts:
      self._remote.fold()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """`metrics.jsonl`'s records (`parse_jsonl`, `read_log`)."""
  path = storage.join(workdir, "metrics.jsonl")
  return parse_jsonl(read_log(path), path)
