"""Where a run's files live: the local disk or an object store (`gs://bucket/run`).

Every file the project reads or writes in a workdir goes through `etils.epath` (the path library
Orbax uses), so that a `gs://` workdir is written to the bucket, never to a local directory named
`gs:` (what `os.path.abspath` makes of it). Paths stay plain strings in the code (a local
absolute path, or a URI); `path(p)` gives the `epath.Path` to read or write with.

Local and remote workdirs differ in two guarantees, because an object store has neither a rename
nor an exclusive create:

- `write_atomically` writes a local file through a temporary file and a rename; a remote object
  is uploaded whole, which an object store publishes atomically too (a reader sees the old object
  or the new one, never a part), but a failed upload is not retried here.
- `append_line` appends to a local file in place; a remote object is rewritten whole (read, then
  uploaded with the line added), which costs one download and one upload per call.

The run lock (`trainkit.workdir.workdir_lock`) is created exclusively on a local disk; on an
object store it is checked, then written, so two runs started at the same moment on one remote
workdir are not told apart (docs/design.md, "Remote workdirs").
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Iterator
from typing import Any

from etils import epath

from trainkit.errors import UserError

# The URI schemes a workdir may have: the fsspec protocol that etils.epath reads and writes them
# with, and the package that provides it. Orbax writes checkpoint arrays through TensorStore,
# which it points at object stores for gs:// only (any other URI it treats as a local path), so
# s3:// and the other schemes of epath are refused rather than half-supported.
REMOTE_SCHEMES = {"gs": ("gcs", "gcsfs")}


def scheme(location: str | os.PathLike) -> str | None:
  """The URI scheme of `location` (`"gs"` for `gs://bucket/run`), or None for a local path."""
  text = os.fspath(location)
  head, separator, _ = text.partition("://")
  return head if separator and head and "/" not in head else None


def is_remote(location: str | os.PathLike) -> bool:
  """Whether `location` is a URI (an object store), not a path on the local disk."""
  return scheme(location) is not None


def check_filesystem(location: str) -> None:
  """Raises UserError unless `location` is local or its file system can be used here.

  Checked before anything is written: a missing package would otherwise surface at the first
  write (after data loading and compilation), and a scheme the path library does not know
  would be written as a local directory.
  """
  name = scheme(location)
  if name is None:
    return
  if name not in REMOTE_SCHEMES:
    supported = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
    raise UserError(
        f"'{location}': {name}:// is not supported for a run's files (supported: a local path, "
        f"{supported}); Orbax writes checkpoints to local disks and gs:// only"
    )
  protocol, package = REMOTE_SCHEMES[name]
  import fsspec  # An etils[epath] dependency; imported here, as only remote paths need it.

  try:
    fsspec.get_filesystem_class(protocol)
  except (ImportError, ValueError):
    raise UserError(
        f"'{location}' is on {name}://, whose file system needs the {package} package, which is "
        f"not installed: pip install {package}"
    ) from None


def resolve(location: str | os.PathLike) -> str:
  """`location` as the run uses it: an absolute local path (`~` expanded), or a URI as given
  (without a trailing slash) once `check_filesystem` accepted it."""
  text = os.fspath(location)
  if not is_remote(text):
    return os.path.abspath(os.path.expanduser(text))
  check_filesystem(text)
  return text.rstrip("/")


def path(location: str | os.PathLike) -> epath.Path:
  """The `epath.Path` of a local path or a URI, to read or write with."""
  return epath.Path(os.fspath(location))


def join(location: str, *names: str) -> str:
  """`location/names...` for a local path or a URI (a URI is always joined with `/`)."""
  return posixpath.join(location, *names) if is_remote(location) else os.path.join(location, *names)


def relpath(location: str, start: str) -> str:
  """`location` relative to `start` (both local, or both under one URI)."""
  if is_remote(location):
    return posixpath.relpath(location.partition("://")[2], start.partition("://")[2])
  return os.path.relpath(location, start)


def makedirs(location: str) -> None:
  """Creates the directory `location` and its parents (an object store needs none: a no-op
  there beyond what the path library does).

  Raises:
    UserError: `location`, or a directory above it, exists as a file.
  """
  try:
    path(location).mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise UserError(
        f"'{location}' (or a folder above it) is a file where a folder is written; move the "
        "file aside"
    ) from None


def walk_files(directory: str) -> Iterator[str]:
  """The files under `directory` as `/`-separated paths relative to it, at any depth.

  Written with `iterdir` rather than `epath.Path.walk`, which gives the roots of an fsspec file
  system without their scheme (a local path in place of the remote one).
  """
  pending = [(path(directory), "")]
  while pending:
    folder, prefix = pending.pop()
    try:
      children = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
      continue  # As os.walk: a directory that is not there holds no files.
    for child in children:
      relative = f"{prefix}{child.name}"
      if child.is_dir():
        pending.append((child, relative + "/"))
      else:
        yield relative


def read_text(location: str) -> str:
  return path(location).read_text()



def save_figure(figure: Any, location: str, *, dpi: int) -> None:
  """Writes a matplotlib `figure` to `location` (local or a URI), in the format its suffix
  names (`.png`), creating the parent directory; replaced whole (`write_atomically`)."""
  from trainkit.metric_writers import write_atomically  # It uses this module.

  image_format = os.path.splitext(location)[1].lstrip(".").lower() or "png"
  buffer = io.BytesIO()
  figure.savefig(buffer, format=image_format, dpi=dpi)
  parent = posixpath.dirname(location) if is_remote(location) else os.path.dirname(location)
  makedirs(parent or ".")
  write_atomically(location, buffer.getvalue())


def size(location: str) -> int:
  """The file's size in bytes."""
  # os.stat for local files: epath's stat also looks up the owner's name, which fails for a uid
  # that has none (containers).
  return path(location).stat().length if is_remote(location) else os.path.getsize(location)


def mtime(location: str) -> float:
  """The file's modification time (seconds since the epoch)."""
  return path(location).stat().mtime if is_remote(location) else os.path.getmtime(location)
