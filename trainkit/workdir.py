"""The run's working directory: created, checked for writing, and given the run's config."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from trainkit.errors import UserError

_log = logging.getLogger(__name__)


def prepare_workdir(workdir: str | None) -> str:
  """Creates `workdir` if needed and checks it is writable; returns its absolute path."""
  if not workdir:
    raise UserError("--workdir is required")
  workdir = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test_"):
      pass
  except OSError as e:
    raise UserError(f"workdir '{workdir}' is not writable: {e.strerror or e}") from None
  return workdir


LOCK_NAME = ".run.lock"


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Alive, owned by someone else.
    return True
  return True


def _read_lock(path: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}  # Being written, or truncated by a crash: treated as unknown owner.


@contextlib.contextmanager
def workdir_lock(workdir: str) -> Iterator[None]:
  """Holds `<workdir>/.run.lock` for the life of a run, so that two runs never share a workdir.

  The lock file is created atomically (O_EXCL) and names its owner (pid, host, start time); a
  second run is refused with a message that names them. A lock left by a process that no longer
  exists on this host (a kill -9, a crash) is stale and taken over with a warning; a lock from
  another host cannot be checked and is reported with the command to remove it. Released on any
  exit from the block. In multi-process runs only process 0 takes it.
  """
  if jax.process_index() != 0:
    yield
    return
  path = os.path.join(workdir, LOCK_NAME)
  me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
  for _ in range(2):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as e:
      if e.errno != errno.EEXIST:
        raise UserError(f"cannot create the run lock {path}: {e.strerror or e}") from None
      owner = _read_lock(path)
      pid, host = owner.get("pid"), owner.get("host")
      if host == me["host"] and isinstance(pid, int) and not _process_alive(pid):
        _log.warning("removing the stale run lock %s of pid %d, which no longer runs", path, pid)
        os.remove(path)
        continue
      since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
      raise UserError(
          f"workdir '{workdir}' is in use by another run (pid {pid} on {host}, since {since}); "
          f"use another --workdir, or if that run is gone, remove {path}"
      ) from None
    with os.fdopen(fd, "w") as f:
      json.dump(me, f)
    break
  try:
    yield
  finally:
    if _read_lock(path).get("pid") == me["pid"]:
      os.remove(path)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
  return flat


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `config.json`, keeping the previous one if this run's config differs from it.

  Call it only once the run has been accepted (after the checkpoint restore, which rejects a
  config that builds another model), so that a rejected resume leaves `config.json` as the
  config the checkpoints were trained with. A differing earlier config is moved to
  `config_history/config.<n>.json` (n = 1, 2, ...) and the changed keys are logged. Only process
  0 writes (the workdir is shared in a multi-process run).
  """
  if jax.process_index() != 0:
    return
  path = os.path.join(workdir, "config.json")
  text = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
  if os.path.exists(path):
    with open(path) as f:
      previous = f.read()
    try:
      before = _flatten(json.loads(previous))
    except json.JSONDecodeError:
      before = {}
    after = _flatten(json.loads(text))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if previous != text:
      kept = _keep_in_history(workdir, previous)
      _log.warning(
          "config differs from the previous run in this workdir (%s, kept as %s): %s",
          path,
          kept,
          ", ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed)
          or "unreadable before",
      )
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _keep_in_history(workdir: str, text: str) -> str:
  history = os.path.join(workdir, "config_history")
  os.makedirs(history, exist_ok=True)
  n = 1
  while os.path.exists(os.path.join(history, f"config.{n}.json")):
    n += 1
  kept = os.path.join(history, f"config.{n}.json")
  with open(kept, "w") as f:
    f.write(text)
  return kept
