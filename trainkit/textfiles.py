"""Reading a user's text file, with one error naming the file and line (`path:line: not UTF-8
text (byte 0xff)`)."""

from __future__ import annotations

import logging
import os
import pathlib
import stat
from collections.abc import Mapping, Sequence

from trainkit.errors import UserError

_BOM = b"\xef\xbb\xbf"


def special_file_kind(path: str | os.PathLike) -> str | None:
  """ "a folder", "a named pipe (FIFO)", ... for a `path` that exists and is not a regular file
  (opening a FIFO without a writer blocks forever); else None."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return None
  for test, kind in (
      (stat.S_ISREG, None),
      (stat.S_ISDIR, "a folder"),
      (stat.S_ISFIFO, "a named pipe (FIFO)"),
      (stat.S_ISSOCK, "a socket"),
      (stat.S_ISCHR, "a character device"),
      (stat.S_ISBLK, "a block device"),
  ):
    if test(mode):
      return kind
  return "not a regular file"


def is_stream(path: str | os.PathLike) -> bool:
  """Whether `path` is a pipe or a terminal (e.g. /dev/stdin): text read once, front to back."""
  return special_file_kind(path) in ("a named pipe (FIFO)", "a character device")


def _require_readable_file(path: pathlib.Path, what: str) -> None:
  """A regular file, or a stream (`is_stream`: `--config.predict.input=/dev/stdin`)."""
  kind = special_file_kind(path)
  if kind is None and not path.is_file():
    raise UserError(f"{what} file {path} does not exist.")
  if kind is not None and not is_stream(path):
    raise UserError(f"{what} file {path} is {kind}, not a file.")


def read_text(path: str | os.PathLike, what: str) -> str:
  """The file's UTF-8 text (a byte-order mark dropped); a UserError names it as `what` ("ISIC")."""
  path = pathlib.Path(path)
  _require_readable_file(path, what)
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise UserError(f"{what} file {path} cannot be read: {e.strerror or e}") from None
  raw = raw.removeprefix(_BOM)
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[: e.start].count(b"\n") + 1
    raise UserError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}).") from None


def iter_lines(path: str | os.PathLike, what: str):
  """Yields (1-based line number, line) streaming, split on "\\n" only; errors as `read_text`'s."""
  path = pathlib.Path(path)
  _require_readable_file(path, what)
  try:
    with open(path, "rb") as f:
      for number, raw in enumerate(f, start=1):
        if number == 1:
          raw = raw.removeprefix(_BOM)
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise UserError(f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x}).") from None
        yield number, line.rstrip("\n").rstrip("\r")
  except OSError as e:
    raise UserError(f"{what} file {path} cannot be read: {e.strerror or e}") from None


def report_counts(
    source: str, stats: Mapping[str, int], examples: Mapping[str, Sequence[str]] | None = None
) -> None:
  """Logs and prints (visible without logging set up) what a reader of `source` counted;
  `examples` names the first few items behind a non-zero count."""
  message = f"{source}: " + ", ".join(f"{k}={v}" for k, v in stats.items())
  for key, names in (examples or {}).items():
    if names:
      more = ", ..." if stats.get(key, 0) > len(names) else ""
      message += f"\n  {key}: {', '.join(names)}{more}"
  logging.info(message)
  print(message, flush=True)
