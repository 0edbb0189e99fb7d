"""Where a run's files live: the local disk or an object store (`gs://bucket/run`).

Paths stay plain strings; `path(p)` gives the `etils.epath.Path`. docs/design.md, "Remote
workdirs", says what an object store without rename or exclusive create changes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from etils import epath

from trainkit.errors import UserError, causes

# Workdir schemes and their packages: Orbax's TensorStore knows gs:// only, so no others.
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
  """Raises UserError unless `location` is local or its file system can be used here (before
  anything is loaded, rather than at the first write)."""
  name = scheme(location)
  if name is None:
    _refuse_mistyped_uri(location)
    try:
      location.encode()  # TensorStore (Orbax's arrays) takes UTF-8 paths only.
    except UnicodeEncodeError:
      shown = os.fsencode(location).decode(errors="backslashreplace")
      raise UserError(
          f"'{shown}': the workdir's name is not UTF-8 (its other bytes shown as \\xNN), and "
          "Orbax's checkpoints need a UTF-8 path: choose a workdir whose name is UTF-8"
      ) from None
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
  configure_gcs(location)  # gs://, the one remote scheme.


# A GCS API emulator: gcsfs reads the first, TensorStore (Orbax's arrays) the second.
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
TENSORSTORE_URL_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"
TENSORSTORE_TOKEN_VARIABLE = "GOOGLE_AUTH_TOKEN_FOR_TESTING"  # TensorStore's fixed bearer token.
_gcs_lock = threading.Lock()
_gcs_configured: str | None = None  # The emulator's URL ("" for GCS itself) once configured.


def emulator_url() -> str:
  """The GCS API server that `STORAGE_EMULATOR_HOST` names (`http://host:port`), or ""."""
  host = os.environ.get(EMULATOR_VARIABLE, "")
  if host in ("", "default"):  # gcsfs's own reading: "default" is GCS itself.
    return ""
  return host if host.startswith(("http://", "https://")) else f"http://{host}"


def configure_gcs(location: str = "gs://") -> None:
  """Sets gcsfs up for this process's gs:// paths, once (again if the emulator changed).

  With an emulator: gcsfs's plain GCSFileSystem (the default asks a gRPC API an emulator lacks)
  and TensorStore pointed at the same server. Without one: missing credentials are a UserError.
  """
  global _gcs_configured, _gcsfs_default
  import fsspec.config
  from etils.epath import backend

  emulator = emulator_url()
  with _gcs_lock:
    if _gcs_configured == emulator:
      return
    registered = fsspec.get_filesystem_class("gcs")
    if not registered.__module__.startswith("gcsfs"):
      _gcs_configured = emulator
      return
    _gcsfs_default = _gcsfs_default or registered
    implementation = _plain_gcsfs(_gcsfs_default) if emulator else _gcsfs_default
    for protocol in ("gs", "gcs"):
      # A class, not an import path: fsspec keeps a class it imported over an import path.
      fsspec.register_implementation(protocol, implementation, clobber=True)
      options = fsspec.config.conf.setdefault(protocol, {})
      if emulator:
        options["token"] = "anon"
      else:
        options.pop("token", None)
    backend.fsspec_backend._get_filesystem.cache_clear()  # Any instance made before this.
    if emulator:
      os.environ.setdefault(TENSORSTORE_URL_VARIABLE, emulator)
      if os.environ[TENSORSTORE_URL_VARIABLE].rstrip("/") == emulator.rstrip("/"):
        # TensorStore has no anonymous mode; the emulator ignores this placeholder token.
        os.environ.setdefault(TENSORSTORE_TOKEN_VARIABLE, "emulator")
    else:
      _check_credentials(location)
    gcsfs_logger = logging.getLogger("gcsfs")
    if not any(isinstance(f, _GcsfsLog) for f in gcsfs_logger.filters):
      gcsfs_logger.addFilter(_GcsfsLog())
    _gcs_configured = emulator


_gcsfs_default: type | None = None  # The class gcsfs registers for gs://, kept before any change.


def _plain_gcsfs(cls: type) -> type:
  """gcsfs's plain GCSFileSystem (newer gcsfs registers a subclass with bucket-layout lookups)."""
  for base in cls.__mro__:
    if base.__name__ == "GCSFileSystem" and base.__module__ == "gcsfs.core":
      return base
  return cls


def _check_credentials(location: str) -> None:
  """Raises UserError when gcsfs finds no application default credentials for `location`."""
  import fsspec

  try:
    # skip_instance_cache: this instance is for the check only; runs use gcsfs's default.
    fsspec.filesystem("gcs", token="google_default", skip_instance_cache=True)
  except Exception as e:  # google.auth's DefaultCredentialsError: not imported here (gcsfs's).
    if not any(c.__name__ == "GoogleAuthError" for c in type(e).__mro__):
      raise
    reason = " ".join(str(e).split()) or type(e).__name__
    raise UserError(
        f"'{location}' is on gs://, and no Google Cloud credentials were found for it ({reason}); "
        "on a workstation run `gcloud auth application-default login` or set "
        "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (a Cloud TPU VM uses its "
        "service account)"
    ) from None


class _GcsfsLog(logging.Filter):
  """gcsfs's "Could not determine bucket type" warning once per bucket, not at every open; none
  of its tracebacks of a request that failed, as the error is raised to the caller, which words
  it (`failure_reason`)."""

  _MESSAGE = "Could not determine bucket type for bucket name "

  def __init__(self) -> None:
    super().__init__()
    self._seen: set[str] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if record.exc_info and " out of retries on exception: " in message:
      return False
    if not message.startswith(self._MESSAGE):
      return True
    bucket = message[len(self._MESSAGE) :].partition(":")[0]
    if bucket in self._seen:
      return False
    self._seen.add(bucket)
    return True


# Schemes whose one-slash typo (`gs:/bucket/run`) is refused, not taken for a local `gs:` folder.
_URI_SCHEMES = frozenset({*REMOTE_SCHEMES, "gcs", "s3", "az", "abfs", "hdfs", "http", "https"})


def _refuse_mistyped_uri(location: str | os.PathLike) -> None:
  """Raises UserError for `gs:/bucket/run` or `gs:bucket/run` (the system's local paths)."""
  text = os.fspath(location)
  head, colon, rest = text.partition(":")
  if colon and head.lower() in _URI_SCHEMES and not rest.startswith("//"):
    raise UserError(
        f"'{text}' is not a {head}:// URI (a URI has two slashes after '{head}:') and would be a "
        f"local folder named '{head}:'; did you mean {head}://{rest.lstrip('/')}?"
    )


def resolve(location: str | os.PathLike) -> str:
  """An absolute local path (`~` expanded), or a URI without its trailing slash."""
  text = os.fspath(location)
  check_filesystem(text)
  if is_remote(text):
    return text.rstrip("/")
  text = os.path.expanduser(text)
  if ".." in text.split(os.sep):
    # `link/../run` is the parent of what `link` points to, not what abspath makes of it.
    return os.path.realpath(text)
  return os.path.abspath(text)


def path(location: str | os.PathLike) -> epath.Path:
  """The `epath.Path` of a local path or a URI, to read or write with."""
  text = os.fspath(location)
  if _gcs_configured is None and text.startswith("gs://"):
    # A gs:// path reached without `resolve` (a sweep's runs, a test): gcsfs set up first.
    check_filesystem(text)
  return epath.Path(text)


def join(location: str, *names: str) -> str:
  """`location/names...` for a local path or a URI (a URI is always joined with `/`)."""
  return posixpath.join(location, *names) if is_remote(location) else os.path.join(location, *names)


def relpath(location: str, start: str) -> str:
  """`location` relative to `start` (both local, or both under one URI)."""
  if is_remote(location):
    return posixpath.relpath(location.partition("://")[2], start.partition("://")[2])
  return os.path.relpath(location, start)


def makedirs(location: str) -> None:
  """Creates `location` and its parents; UserError when one of them is a file."""
  try:
    path(location).mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise UserError(
        f"'{location}' (or a folder above it) is a file where a folder is written; move the "
        "file aside"
    ) from None


def walk_files(directory: str) -> Iterator[str]:
  """The files under `directory` as `/`-separated relative paths (`epath.Path.walk` drops an
  fsspec root's scheme)."""
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


def failure_reason(error: BaseException) -> str | None:
  """Why a request to an object store failed, in one line, when `error` or its cause says the
  store cannot be reached (gcsfs's aiohttp, after its retries) or refused it (HTTP 403); else
  None."""
  for e in causes(error):
    text = " ".join(str(e).split()) or type(e).__name__
    if type(e).__module__.startswith("aiohttp") or isinstance(e, (ConnectionError, TimeoutError)):
      return f"the object store cannot be reached ({text})"
    if isinstance(e, OSError) and text.startswith("Forbidden"):  # gcsfs's words for HTTP 403.
      return (
          f"the object store refused the request, HTTP 403 ({text}): the credentials lack "
          "storage rights on the bucket"
      )
  return None


def read_text(location: str) -> str:
  return path(location).read_text()


def write_atomically(location: str, text: str | bytes) -> None:
  """Replaces `location` with `text` via a temporary file and a rename; an object store's upload
  is atomic itself."""
  if is_remote(location):
    target = path(location)
    target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)
    return
  fd, temporary = tempfile.mkstemp(dir=os.path.dirname(location) or ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      f.write(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, location)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    if isinstance(e, OSError):
      e.filename = e.filename or location  # A write's error names no file.
    raise


def save_figure(figure: Any, location: str, *, dpi: int) -> None:
  """Writes a matplotlib `figure` to `location` (its suffix names the format), atomically."""
  image_format = os.path.splitext(location)[1].lstrip(".").lower() or "png"
  buffer = io.BytesIO()
  figure.savefig(buffer, format=image_format, dpi=dpi)
  parent = posixpath.dirname(location) if is_remote(location) else os.path.dirname(location)
  makedirs(parent or ".")
  write_atomically(location, buffer.getvalue())


def size(location: str) -> int:
  # os.stat for local files: epath's stat looks up the owner's name, which fails in containers.
  return path(location).stat().length if is_remote(location) else os.path.getsize(location)


def mtime(location: str) -> float:
  return path(location).stat().mtime if is_remote(location) else os.path.getmtime(location)
