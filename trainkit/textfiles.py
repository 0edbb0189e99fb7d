"""Reading a user's text file into a str, with one clear error naming the file and line.

Every reader of real data (CelebA, ISIC 2019, MNLI/SNLI/QQP/PAWS/HANS, WMT text) goes through
`read_text`, so that a missing file, an unreadable one or a byte that is not UTF-8 is reported
the same way: `path:line: not UTF-8 text (byte 0xff)`, never as a byte offset into the file.
"""

from __future__ import annotations

import os
import pathlib

from trainkit.errors import UserError

_BOM = b"\xef\xbb\xbf"


def read_text(path: str | os.PathLike, what: str) -> str:
  """The file's text, decoded as UTF-8 (a leading byte-order mark dropped), newlines kept as is.

  Raises:
    UserError: `what` names the kind of file in the message ("CelebA", "ISIC", ...).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise UserError(f"{what} file {path} does not exist.")
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
  """Yields (1-based line number, line) streaming, split on "\\n" only ("\\r\\n" accepted).

  For files too large to hold twice in memory; errors as `read_text`'s.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise UserError(f"{what} file {path} does not exist.")
  try:
    with open(path, "rb") as f:
      for number, raw in enumerate(f, start=1):
        if number == 1:
          raw = raw.removeprefix(_BOM)
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise UserError(
              f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x})."
          ) from None
        yield number, line.rstrip("\n").rstrip("\r")
  except OSError as e:
    raise UserError(f"{what} file {path} cannot be read: {e.strerror or e}") from None
