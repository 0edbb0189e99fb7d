"""A gs:// workdir whose object store fails under the run, against the GCS API server
(tests/gcs_server.py): unreachable, refusing every request (HTTP 403), emptied, without its
bucket. Each is one line naming the workdir and the cause."""

import asyncio
import contextlib
import http.server
import logging
import threading
import urllib.parse
import urllib.request

import aiohttp
import pytest

from gcs_server import Bucket, GCSServer, emulated, gcs, gcs_server, new_bucket  # noqa: F401
from trainkit import storage
from trainkit.errors import Unwritable, UserError
from trainkit.workdir import prepare_workdir, stopped_by_workdir, workdir_exists, workdir_lock


def test_a_store_unreachable_mid_run_is_one_line_naming_the_workdir_and_the_rerun(
    monkeypatch, caplog
):
  server = GCSServer()  # Its own server, to stop under the run.
  server.start()
  try:
    with emulated(new_bucket(server), monkeypatch) as bucket:
      workdir = prepare_workdir(f"{bucket.uri}/run")
  finally:
    server.stop()
  # What gcsfs raises for each upload once the server is gone, after about 31 s of retries: the
  # error of its HTTP client, aiohttp, asked here once.
  unreachable = asyncio.run(_get(server.url))
  assert isinstance(unreachable, aiohttp.ClientConnectorError), unreachable
  failed = RuntimeError("a background save failed")
  assert stopped_by_workdir(workdir, failed) is None  # Not the store's fault: re-raised as is.
  failed.__cause__ = unreachable
  stopped = stopped_by_workdir(workdir, failed)
  assert isinstance(stopped, Unwritable)  # Exits at once, as a full disk does.
  message = str(stopped)
  assert "\n" not in message and workdir in message and str(server.port) in message
  assert "cannot be reached" in message and "resumes from the latest checkpoint" in message
  # gcsfs logs each request out of retries with its traceback (two chained ones) before raising
  # it: not printed, as the error's line says it.
  with caplog.at_level(logging.DEBUG):
    try:
      raise unreachable
    except aiohttp.ClientError as e:
      logging.getLogger("gcsfs").exception(f"_request out of retries on exception: {e}")
      logging.getLogger("gcsfs").error("another error")
  assert [r.getMessage() for r in caplog.records] == ["another error"]


async def _get(url: str) -> Exception | None:
  async with aiohttp.ClientSession() as session:
    try:
      async with session.get(url):
        return None
    except aiohttp.ClientError as e:
      return e


class _Forbidden(http.server.BaseHTTPRequestHandler):
  """GCS's answer to a service account without storage rights, to every request."""

  def _refuse(self) -> None:
    body = b'{"error": {"code": 403, "message": "caller does not have storage.objects.get access"}}'
    self.send_response(403)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _refuse

  def log_message(self, *args) -> None:
    pass


def test_http_403_on_every_request_is_one_line_before_anything_is_written(monkeypatch):
  forbidden = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
  threading.Thread(target=forbidden.serve_forever, daemon=True).start()
  store = GCSServer()
  store.url = f"http://127.0.0.1:{forbidden.server_address[1]}"
  try:
    with emulated(Bucket(store, "bucket"), monkeypatch):
      for check in (workdir_exists, prepare_workdir):
        with pytest.raises(UserError) as raised:
          check("gs://bucket/run")
        message = str(raised.value)
        assert raised.value.__cause__ is None and "\n" not in message, message
        assert "gs://bucket/run" in message and "HTTP 403" in message
        assert "storage.objects.get" in message
  finally:
    forbidden.shutdown()
    forbidden.server_close()


def test_every_object_of_a_gs_workdir_deleted_mid_run_is_noticed(gcs):  # noqa: F811
  workdir = f"{gcs.uri}/run"
  with pytest.raises(UserError, match=f"the workdir {workdir} vanished while the run") as raised:
    with workdir_lock(workdir):
      storage.path(f"{workdir}/config.json").write_text("{}")
      for name in gcs.objects("run/"):  # Deleted over the server's API, as `gsutil rm` would.
        quoted = urllib.parse.quote(name, safe="")
        request = urllib.request.Request(
            f"{gcs.server.url}/storage/v1/b/{gcs.name}/o/{quoted}", method="DELETE"
        )
        with contextlib.closing(urllib.request.urlopen(request, timeout=30)):
          pass
      assert gcs.objects("run/") == {}
  assert "config.json" in str(raised.value) and "rerun the same command" in str(raised.value)
  # A run that ends with its workdir whole releases its lock without a word.
  with workdir_lock(workdir):
    pass
  assert gcs.objects("run/") == {}


def test_a_missing_bucket_keeps_gcsfs_s_words(gcs):  # noqa: F811
  with pytest.raises(UserError) as raised:
    prepare_workdir("gs://no-such-bucket-63/run")
  message = str(raised.value)
  assert "\n" not in message and "gs://no-such-bucket-63/run" in message
  assert "bucket does not exist" in message and "no-such-bucket-63" in message
