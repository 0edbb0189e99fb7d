"""The run's working directory: created, checked for writing, and given the run's config."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from flax import traverse_util
from ml_collections import ConfigDict

from trainkit import storage
from trainkit.distributed import DEFAULT_STARTUP_TIMEOUT_S
from trainkit.errors import Unwritable, UserError
from trainkit.storage import write_atomically

_log = logging.getLogger(__name__)


def prepare_workdir(workdir: str | None) -> str:
  """Creates `workdir` if needed and checks it is writable; returns its absolute path or URI."""
  if not workdir:
    raise UserError("--workdir is required")
  workdir = storage.resolve(workdir)
  try:
    if not storage.is_remote(workdir):  # An object store has no directories to create.
      os.makedirs(workdir, exist_ok=True)
    probe = storage.path(storage.join(workdir, f".write_test_{os.getpid()}"))
    probe.write_text("")
    probe.unlink()
  except FileNotFoundError as e:  # Writing an object: its bucket does not exist (gcsfs's words).
    raise UserError(
        f"workdir '{workdir}' is not writable: its bucket does not exist ({e}); create it, or "
        "correct the bucket's name"
    ) from None
  except OSError as e:
    raise UserError(
        f"workdir '{workdir}' is not writable: {storage.failure_reason(e) or e.strerror or e}"
    ) from None
  return workdir


def workdir_exists(workdir: str) -> bool:
  """Whether `workdir` exists; a UserError when its object store refuses or cannot be reached."""
  try:
    return storage.path(workdir).exists()
  except OSError as e:
    raise UserError(
        f"cannot read workdir '{workdir}': {storage.failure_reason(e) or e.strerror or e}"
    ) from None


def stopped_by_workdir(workdir: str, error: BaseException) -> UserError | None:
  """The one-line error for a run stopped by its workdir failing under it (a local one gone, an
  object store unreachable or refusing), whatever failed first; None for another `error`."""
  if not storage.is_remote(workdir):
    if os.path.isdir(workdir):
      return None
    return UserError(
        f"the workdir {workdir} vanished while the run was using it (deleted, moved or "
        "unmounted); the run stopped, as nothing more can be saved there"
    )
  reason = storage.failure_reason(error)
  if reason is None:
    return None
  # Unwritable: exits at once, without the failing background uploads' tracebacks.
  return Unwritable(
      f"the run stopped, as nothing more can be saved in its workdir {workdir}: {reason}; once "
      "the store answers, rerun the same command: it resumes from the latest checkpoint "
      "committed there (a step is committed whole or not at all)"
  )


def output_folder(workdir: str, name: str, *, create: bool = True) -> str:
  """`<workdir>/<name>`, created unless `create` is False; a UserError when it leads out of the
  workdir (a symbolic link)."""
  folder = storage.join(workdir, name)
  if not storage.is_remote(folder) and os.path.lexists(folder):
    inside = os.path.realpath(workdir)
    resolved = os.path.realpath(folder)
    if os.path.commonpath([inside, resolved]) != inside:
      shown = (
          f"a symbolic link to {os.readlink(folder)}"
          if os.path.islink(folder)
          else (f"reached through a symbolic link, at {resolved}")
      )
      raise UserError(
          f"'{folder}' is {shown}, outside the workdir: a run writes only inside its workdir; "
          "remove the link (move what it points to into the workdir if you want it kept there) "
          "and rerun"
      )
  if create:
    storage.makedirs(folder)
  return folder


LOCK_NAME = ".run.lock"


def has_checkpoint(workdir: str) -> bool:
  """Whether `<workdir>/checkpoints` holds at least one step directory."""
  try:
    return any(
        p.name.isdigit() for p in storage.path(storage.join(workdir, "checkpoints")).iterdir()
    )
  except OSError:
    return False


def require_checkpoint(workdir: str) -> None:
  """Raises UserError unless `has_checkpoint(workdir)`."""
  if not has_checkpoint(workdir):
    directory = storage.join(storage.resolve(workdir), "checkpoints")
    raise UserError(f"no checkpoint in '{directory}': train first (--mode=train)")


def remove_if_empty(workdir: str) -> None:
  """Removes `workdir` if nothing but directories without files was left in it."""
  if storage.is_remote(workdir) or not os.path.isdir(workdir):
    return  # An object store keeps no empty directories; a vanished workdir has nothing.
  for root, _, files in os.walk(workdir):
    if files:
      return
  for root, dirs, _ in os.walk(workdir, topdown=False):
    for d in dirs:
      os.rmdir(os.path.join(root, d))
  os.rmdir(workdir)


def _gone(owner: Mapping[str, Any]) -> bool:
  """Whether a lock's `owner` is a process of this host that no longer runs."""
  pid = owner.get("pid")
  if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # Alive, owned by someone else.
    pass
  return False


def _read_lock(path: str) -> dict[str, Any]:
  try:
    return json.loads(storage.read_text(path))
  except (OSError, json.JSONDecodeError):
    return {}  # Being written, or truncated by a crash: treated as unknown owner.


def live_lock_owner(workdir: str) -> dict[str, Any]:
  """The owner (pid, host, start time) named in `<workdir>/.run.lock` while it holds it, as
  `workdir_lock` judges: {} when there is no lock, or it names a process gone from this host."""
  owner = _read_lock(storage.join(workdir, LOCK_NAME))
  return {} if _gone(owner) else owner


# A lock still empty this long after its creation never will be named.
_UNWRITTEN_LOCK_SECONDS = 5.0


def _age_seconds(path: str) -> float:
  try:
    return time.time() - storage.mtime(path)
  except OSError:
    return 0.0


def _create_lock(path: str, owner: dict[str, Any]) -> bool:
  """Creates the lock file naming `owner`; False when it exists already (O_EXCL locally; an
  object store's is checked, then written)."""
  if storage.is_remote(path):
    lock = storage.path(path)
    if lock.exists():
      return False
    lock.write_text(json.dumps(owner))
    return True
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    json.dump(owner, f)
  return True


@contextlib.contextmanager
def workdir_lock(workdir: str) -> Iterator[None]:
  """Holds `<workdir>/.run.lock` (pid, host, start time) on process 0 for the life of a run; a
  lock whose process is gone from this host is taken over with a warning."""
  if jax.process_index() != 0:
    yield
    return
  path = storage.join(workdir, LOCK_NAME)
  me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
  for _ in range(2):
    try:
      created = _create_lock(path, me)
    except OSError as e:
      raise UserError(f"cannot create the run lock {path}: {e.strerror or e}") from None
    if not created:
      owner = _read_lock(path)
      pid, host = owner.get("pid"), owner.get("host")
      if _gone(owner):
        _log.warning("removing the stale run lock %s of pid %d, which no longer runs", path, pid)
        storage.path(path).unlink(missing_ok=True)
        continue
      if not owner and _age_seconds(path) > _UNWRITTEN_LOCK_SECONDS:
        # Still empty: its writer died between creating and naming itself. Nobody holds it.
        _log.warning("removing the run lock %s, which names no owner (a torn write)", path)
        storage.path(path).unlink(missing_ok=True)
        continue
      if not owner:
        raise UserError(
            f"workdir '{workdir}' is being claimed by another run that has not named itself in "
            f"{path} yet; use another --workdir, or retry in a few seconds"
        ) from None
      since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
      raise UserError(
          f"workdir '{workdir}' is in use by another run (pid {pid} on {host}, since {since}); "
          f"use another --workdir, or if that run is gone, remove {path}"
      ) from None
    break
  try:
    yield
  finally:
    held = release_lock(workdir)
  if not held and storage.is_remote(workdir):
    # Its objects deleted under the run, which uploads do not notice: as a local workdir gone.
    raise UserError(
        f"the workdir {workdir} vanished while the run was using it (its objects deleted, the "
        f"run's {LOCK_NAME} with them), so its {CONFIG_FILE} and {RUN_INFO_FILE} may be gone: "
        "rerun the same command, which resumes from the checkpoints left and writes them again"
    )


def release_lock(workdir: str) -> bool:
  """Removes `<workdir>/.run.lock` if this process holds it (`workdir_lock`); whether it did."""
  path = storage.join(workdir, LOCK_NAME)
  if _read_lock(path).get("pid") != os.getpid():
    return False
  storage.path(path).unlink(missing_ok=True)
  return True


CONFIG_FILE = "config.json"
# Written into config.json by `save_config`; `read_saved_config` is the one reader.
FORMAT_VERSION = 5
FORMAT_VERSION_KEY = "format_version"
# An older version is migrated, not refused (every run trained so far is one): each version's
# runs lack the keys added after it (version 1's earliest runs these), which get the values those
# runs were trained with, where the package has the key.
_ADDED_AFTER_VERSION = {
    1: {
        "model.remat": "none",
        "data.attribute_cues": False,
        "distributed.startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S,
    },
    2: {"moe.capacity_multiple_of": 1, "moe.group_size": 1},
    3: {"optimizer.accumulation_steps": 1},
    4: {"optimizer.ema_decay": 0.0},
}
# What inference needs besides the config and checkpoint (`trainkit.run_info`).
RUN_INFO_FILE = "run_info.json"


def save_config(config: ConfigDict, workdir: str) -> None:
  """Writes `config.json` (process 0), a differing earlier one kept in `config_history/`; called
  once the checkpoint restore accepted the config."""
  if jax.process_index() != 0:
    return
  path = storage.join(workdir, CONFIG_FILE)
  saved = {FORMAT_VERSION_KEY: FORMAT_VERSION, **json.loads(config.to_json_best_effort())}
  text = json.dumps(saved, indent=2, sort_keys=True) + "\n"
  if storage.path(path).exists():
    previous = storage.read_text(path)
    try:
      before = dict(json.loads(previous))
    except (TypeError, ValueError):  # Not JSON, or not an object.
      before = {}
    if previous != text:
      kept = _keep_in_history(workdir, previous)
      _log.warning(
          "config differs from the previous run in this workdir (%s, kept as %s): %s",
          path,
          kept,
          ", ".join(config_differences(before, saved)) or "unreadable before",
      )
  write_atomically(path, text)


def read_json_object(path: str, missing: str, what: str = "") -> dict[str, Any]:
  """The JSON object in `path`; a UserError naming the file otherwise (`missing` says what
  writes it, for a file that does not exist)."""
  try:
    value = json.loads(storage.read_text(path))
  except FileNotFoundError:
    raise UserError(f"{path} does not exist: {missing}") from None
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"cannot read {what}{path}: {e}") from None
  if not isinstance(value, dict):
    raise UserError(f"cannot read {what}{path}: not a JSON object")
  return value


def _as_typed(saved: Any, default: Any) -> Any:
  """`saved` (parsed JSON) with the tuples of `default` back: JSON writes tuples as lists."""
  if isinstance(saved, dict) and isinstance(default, (dict, ConfigDict)):
    return {k: _as_typed(v, default[k]) if k in default else v for k, v in saved.items()}
  return tuple(saved) if isinstance(saved, list) and isinstance(default, tuple) else saved


def read_saved_config(workdir: str, reference: Mapping[str, Any]) -> dict[str, Any]:
  """`<workdir>/config.json` migrated to this format version (an older version's missing keys
  filled in where `reference` has them); a UserError naming the file when it cannot be used."""
  path = storage.join(workdir, CONFIG_FILE)
  saved = read_json_object(
      path,
      f"{workdir} is not the workdir of a trained run (training writes {CONFIG_FILE} there)",
      "the run's config ",
  )
  version = saved.pop(FORMAT_VERSION_KEY, 1)
  if version in _ADDED_AFTER_VERSION:
    for added in range(version, FORMAT_VERSION):
      for key, value in _ADDED_AFTER_VERSION[added].items():
        section, name = key.split(".")
        if name in reference.get(section, {}) and name not in saved.get(section, {}):
          saved.setdefault(section, {})[name] = value
  elif version != FORMAT_VERSION:
    raise UserError(
        f"{path} is of workdir format version {version!r}, and this code reads versions 1 to "
        f"{FORMAT_VERSION}: use the version of the code that trained the run"
    )
  return saved


def load_saved_config(workdir: str, defaults: ConfigDict) -> ConfigDict:
  """`read_saved_config` as a ConfigDict, tuples of `defaults` (JSON lists) read back as tuples."""
  saved = read_saved_config(storage.resolve(workdir), defaults)
  return ConfigDict(_as_typed(saved, defaults))


def save_run_info(run_info: dict[str, Any], workdir: str) -> None:
  """Writes `<workdir>/run_info.json` (process 0), what inference reads instead of the dataset."""
  if jax.process_index() != 0:
    return
  write_atomically(storage.join(workdir, RUN_INFO_FILE), json.dumps(run_info, indent=2) + "\n")


def _keep_in_history(workdir: str, text: str) -> str:
  history = storage.join(workdir, "config_history")
  storage.makedirs(history)
  numbered = (storage.join(history, f"config.{n}.json") for n in itertools.count(1))
  kept = next(p for p in numbered if not storage.path(p).exists())
  storage.path(kept).write_text(text)
  return kept


def config_differences(saved: Any, requested: Any, *, ignore: tuple[str, ...] = ()) -> list[str]:
  """`key: saved -> requested` for every dotted key whose value differs (JSON-like trees)."""
  before, after = (traverse_util.flatten_dict(tree, sep=".") for tree in (saved, requested))
  return [
      f"{k}: {before.get(k)!r} -> {after.get(k)!r}"
      for k in sorted(before.keys() | after.keys())
      if k not in ignore and before.get(k) != after.get(k)
  ]


def trained_config_differences(directory: str, config: ConfigDict) -> list[str]:
  """How `config` differs from a finished run's config.json (an unreadable one is a difference;
  `num_train_steps` is left out when `num_epochs` sets it)."""
  requested = json.loads(config.to_json_best_effort())
  try:
    saved = read_saved_config(directory, requested)
  except UserError as e:
    return [str(e)]
  ignore = ("num_train_steps",) if requested.get("num_epochs", 0) > 0 else ()
  return [
      difference
      for difference in config_differences(saved, requested, ignore=ignore)
      if not difference.startswith(_UNTRAINED_PREFIXES)
  ]


# Keys that do not change what a run trains.
_UNTRAINED_PREFIXES = ("preflight.", "distributed.")


def move_aside(directory: str) -> str:
  """Renames a run directory to `<directory>.stale-<n>` (kept for inspection); returns the name."""
  stale = next(d for n in itertools.count(1) if not os.path.exists(d := f"{directory}.stale-{n}"))
  os.rename(directory, stale)
  return stale


def stale_runs_error(stale: list[tuple[str, list[str]]], flag: str) -> UserError:
  """One message for finished runs whose config is not the requested one."""
  shown = "; ".join(
      f"{d} ({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''})" for d, diff in stale[:3]
  )
  more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
  return UserError(
      f"{len(stale)} finished run(s) were trained with another config, so their results would be "
      f"stale: {shown}{more}. Rerun with {flag} to move them aside (to <run>.stale-<n>) and "
      "train them again, or use a new --workdir"
  )
