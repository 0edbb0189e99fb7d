"""Orbax checkpoints of the train state and the data-iterator position.

Each step carries a manifest (sha256 and size of its files) from the moment it is published.
Restoring walks back from the newest step, skipping corrupt or unmanifested ones with a warning;
only when none is usable does the run stop with a UserError naming the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainkit import errors, storage
from trainkit.errors import OutOfSpace, Unwritable, UserError, is_out_of_space, unwritable_reason
from trainkit.optim import evaluation_state
from trainkit.storage import write_atomically

_log = logging.getLogger(__name__)

STATE = "state"
DATA_ITERATOR = "data_iterator"
_TMP_MARKER = ".orbax-checkpoint-tmp"
# A failed synchronisation of the processes at the manager's creation.
_COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|collective|DEADLINE_EXCEEDED|barrier", re.I)
# Each shape Orbax splits a replicated array into (to write it in parallel) costs a compilation
# at the first save (6 s for a small model on 8 devices); below this size one replica writes it.
MIN_REPLICA_PARALLEL_SLICE_BYTES = 8 << 20
# Room kept free beyond a step's arrays: metadata, the manifest, the data-iterator state.
_SAVE_MARGIN_BYTES = 4 << 20


def _megabytes(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """`StandardCheckpointHandler`'s handler with our `ArrayHandler`, in a registry of its own."""
  types = ocp.type_handlers
  registry = types.create_type_handler_registry(
      *((t, types.get_type_handler(t)) for t in types.supported_types()),
      (
          jax.Array,
          types.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_PARALLEL_SLICE_BYTES),
      ),
  )
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _remove_failed_save(directory: str, *, quiet_for: float = 0.2, at_most: float = 5.0) -> None:
  """Removes the temporary directory of a failed save until nothing reappears for `quiet_for`
  seconds: TensorStore's writes still in flight may recreate files for a moment."""
  if jax.process_index() != 0 or not storage.path(directory).is_dir():
    return
  start = quiet = time.monotonic()
  while time.monotonic() - start < at_most:
    if any(_TMP_MARKER in p.name for p in storage.path(directory).iterdir()):
      _remove_interrupted_saves(directory, say=False)
      quiet = time.monotonic()
    elif time.monotonic() - quiet >= quiet_for:
      return
    time.sleep(0.01)


def _remove_interrupted_saves(directory: str, *, say: bool = True) -> None:
  """Deletes the temporary directories of saves cut short (e.g. by SIGKILL), synchronously:
  Orbax's own clean-up runs in a thread that can race with a short run's exit."""
  if jax.process_index() != 0 or not storage.path(directory).is_dir():
    return
  for child in storage.path(directory).iterdir():
    if _TMP_MARKER in child.name:
      if say:
        _log.warning("removing an interrupted checkpoint save: %s", child.name)
      with contextlib.suppress(OSError):
        child.rmtree()


# Where entries of a checkpoint directory that the checkpointer did not write are moved.
SET_ASIDE = "set-aside"


def _set_aside_links(directory: str) -> None:
  """Moves symbolic links among the steps to `<directory>/set-aside/`, with a warning.

  A planted link would be restored as a step and fail every save (Orbax will not rmtree it);
  deleting it could reach outside the workdir. Moving it never touches what it points to.
  """
  if jax.process_index() != 0 or storage.is_remote(directory) or not os.path.isdir(directory):
    return  # An object store has no symbolic links.
  for name in sorted(os.listdir(directory)):
    entry = os.path.join(directory, name)
    if not os.path.islink(entry):
      continue
    aside = os.path.join(directory, SET_ASIDE)
    os.makedirs(aside, exist_ok=True)
    target, n = os.path.join(aside, name), 1
    while os.path.lexists(target):
      target, n = os.path.join(aside, f"{name}.{n}"), n + 1
    pointed_to = os.readlink(entry)
    os.rename(entry, target)
    message = (
        f"'{entry}' is a symbolic link (to {pointed_to}), not a checkpoint this run wrote: "
        f"moved aside to '{target}'; what it points to is untouched"
    )
    _log.warning(message)
    print(f"warning: {message}", flush=True)


def _structure_mismatch(abstract: Any, metadata: Any, limit: int = 3) -> str | None:
  """Describes how a checkpoint's stored tree differs from the template, or None."""
  expected = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=True))
  stored = ocp.tree.to_flat_dict(metadata)
  name = lambda key: "/".join(key)
  # Parameters first: they are what a user recognises (optimiser moments mirror them).
  expected = dict(sorted(expected.items(), key=lambda item: item[0][0] != "params"))
  problems = [f"missing {name(k)}" for k in expected if k not in stored]
  problems += [f"unexpected {name(k)}" for k in stored if k not in expected]
  problems += [
      f"{name(k)} has shape {tuple(stored[k].shape)}, expected {tuple(expected[k].shape)}"
      for k in expected
      if k in stored
      and hasattr(expected[k], "shape")
      and tuple(stored[k].shape) != tuple(expected[k].shape)
  ]
  if not problems:
    return None
  more = f" and {len(problems) - limit} more" if len(problems) > limit else ""
  return "; ".join(problems[:limit]) + more


MANIFEST = "trainkit_manifest.json"  # sha256 and size of every file of a finished step.
# Files Orbax's commit writes after the manifest; `complete_manifest` adds their checksums.
_WRITTEN_AT_COMMIT = ("_CHECKPOINT_METADATA", "commit_success.txt")
# How to vouch for a step that has no manifest (`main` below).
TRUST_COMMAND = "python -m trainkit.checkpoint --trust"


def _sha256(path: str) -> str:
  with storage.path(path).open("rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _step_files(step_dir: str) -> list[str]:
  return sorted(path for path in storage.walk_files(step_dir) if path != MANIFEST)


def _file_entry(path: str) -> dict[str, Any]:
  return {"sha256": _sha256(path), "size": storage.size(path)}


def _save_manifest(step_dir: str, entries: dict[str, Any]) -> None:
  write_atomically(storage.join(step_dir, MANIFEST), json.dumps({"files": entries}, indent=1))


def write_manifest(step_dir: str, *, at_commit: tuple[str, ...] = ()) -> None:
  """Records every file of a finalised step (sha256, size), atomically; `at_commit` files are
  listed without a checksum until `complete_manifest` adds it."""
  entries = {
      path: {"at_commit": True} if path in at_commit else _file_entry(storage.join(step_dir, path))
      for path in _step_files(step_dir)
  }
  entries.update({name: {"at_commit": True} for name in at_commit})
  _save_manifest(step_dir, entries)


def _read_manifest(step_dir: str) -> dict[str, Any]:
  entries = json.loads(storage.read_text(storage.join(step_dir, MANIFEST)))["files"]
  if not isinstance(entries, dict):
    raise TypeError("files is not a mapping")
  return entries


def complete_manifest(step_dir: str) -> None:
  """Adds the checksums of the files written at the commit to a committed step's manifest."""
  entries = _read_manifest(step_dir)
  pending = [name for name, entry in entries.items() if entry.get("at_commit")]
  if not pending:
    return
  for name in pending:
    path = storage.join(step_dir, name)
    if storage.path(path).is_file():
      entries[name] = _file_entry(path)
    else:
      del entries[name]  # Not written by this Orbax version's commit.
  _save_manifest(step_dir, entries)


def verify_manifest(step_dir: str) -> str:
  """What does not match the step's manifest ("" when all does); a missing manifest is named."""
  path = storage.join(step_dir, MANIFEST)
  if not storage.path(path).exists():
    return (
        f"it has no {MANIFEST}, so its files cannot be verified (the manifest was deleted, or "
        "the step was saved by a version of trainkit without checksums)"
    )
  try:
    entries = _read_manifest(step_dir)
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST} is unreadable ({type(e).__name__})"
  for name, entry in sorted(entries.items()):
    file = storage.join(step_dir, name)
    if not isinstance(entry, dict):
      return f"{MANIFEST} is unreadable (the entry of {name})"
    if entry.get("at_commit"):
      continue  # Written by Orbax after the manifest; checked once complete_manifest ran.
    if not storage.path(file).is_file():
      return f"{name} is missing"
    if storage.size(file) != entry.get("size") or _sha256(file) != entry.get("sha256"):
      return f"{name} does not match its checksum in {MANIFEST} (changed since it was saved)"
  extra = sorted(set(_step_files(step_dir)) - set(entries))
  return f"{extra[0]} was not part of the saved checkpoint" if extra else ""


class _Unusable(ValueError):
  """A reason of ours, already one readable line."""


def _describe(error: Exception, step_dir: str) -> str:
  """One line on what is wrong with a checkpoint: the file if known, and the error's first
  informative line (TensorStore errors start with a pybind11 repr)."""
  if isinstance(error, _Unusable):
    return str(error)
  if isinstance(error, json.JSONDecodeError):
    for relative in sorted(storage.walk_files(step_dir)):
      name = relative.rsplit("/", 1)[-1]
      if name.endswith(".json") or "METADATA" in name:
        try:
          json.loads(storage.read_text(storage.join(step_dir, relative)))
        except (OSError, ValueError):
          return f"{relative} is not valid JSON ({error.msg})"
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  informative = [line for line in lines if not line.startswith("<bound method")]
  with_path = [line for line in informative if step_dir in line]
  text = (with_path or informative or [""])[0]
  return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


class Checkpointer:
  """Saves and restores (train state, data-iterator state) pairs under `directory`."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = storage.resolve(directory)
    self.skipped: list[str] = []  # What the last restore skipped ("step N: why").
    # Steps saved here whose manifest is not complete yet; a step found without one is never
    # vouched for.
    self._unmanifested: set[int] = set()
    self._saving: tuple[int, int] | None = None  # (step, bytes) of the save in flight.
    self._async = async_save
    location = storage.path(self.directory)
    if location.exists() and not location.is_dir():
      raise UserError(f"checkpoint directory '{self.directory}' exists and is not a directory")
    _remove_interrupted_saves(self.directory)
    _set_aside_links(self.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        enable_async_checkpointing=async_save,
        # The manifest is written in the step's temporary directory: the commit publishes both.
        async_options=ocp.AsyncOptions(post_finalization_callback=self._manifest_before_commit)
        if async_save
        else None,
    )
    try:
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=options,
          item_handlers={STATE: _state_handler(), DATA_ITERATOR: ocp.JsonCheckpointHandler()},
      )
    except Exception as e:  # Orbax reports unreadable directories in many ways.
      if jax.process_count() > 1 and _COLLECTIVE_FAILURE.search(str(e)):
        raise  # Not the directory: `exit_together` describes it.
      raise UserError(f"cannot open checkpoint directory '{self.directory}': {e}") from e

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
      self, step: int, state: Any, data_iterator_state: dict | None = None, *, force: bool = False
  ) -> bool:
    """Saves if `step` is due (or `force`); returns whether a save started."""
    if step in self._manager.all_steps():
      return False
    self.wait()
    # Checked first: a save that fills the disk fails half-written in Orbax's threads.
    needed = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state)) + _SAVE_MARGIN_BYTES
    # An object store has no free space to measure (a full quota fails the upload itself).
    free = None if storage.is_remote(self.directory) else shutil.disk_usage(self.directory).free
    if free is not None and free < needed:
      raise self._out_of_space(step, needed, free)
    with self._save_errors((step, needed)):
      if jax.process_index() == 0 and not storage.is_remote(self.directory):
        # A folder that cannot take a new file raises here: a save Orbax started there would
        # hang its threads up to its coordination timeout.
        tempfile.TemporaryFile(dir=self.directory).close()
      args = ocp.args.Composite(
          **{
              STATE: ocp.args.PyTreeSave(state),
              DATA_ITERATOR: ocp.args.JsonSave(data_iterator_state or {}),
          }
      )
      self._saving = (step, needed)
      started = self._manager.save(step, args=args, force=force)
    if started:
      self._unmanifested.add(step)
      if not self._async:  # Finalised already: its manifest at once.
        self.wait()
    return started

  @contextlib.contextmanager
  def _save_errors(self, saving: tuple[int, int] | None) -> Iterator[None]:
    """A full disk or an unwritable folder during the save of `saving` (step, bytes) becomes one
    error naming the step a rerun resumes from."""
    try:
      yield
    except Exception as e:
      if saving is not None and is_out_of_space(e):
        raise self._out_of_space(*saving) from e
      if saving is not None and unwritable_reason(e):
        raise self._unwritable(saving[0], e) from e
      raise

  def _manifest_before_commit(self) -> None:
    """Orbax's callback before the commit of the step in flight: writes its manifest, so that no
    finished step is ever without one."""
    if self._saving is None or jax.process_index() != 0:
      return
    # On gs:// Orbax writes the step in place (`<step>`) and commits it with commit_success.txt;
    # locally in `<step>.orbax-checkpoint-tmp...`, renamed at the commit.
    step = str(self._saving[0])
    pending = [
        p
        for p in storage.path(self.directory).iterdir()
        if p.name == step or p.name.startswith(step + _TMP_MARKER)
    ]
    if len(pending) == 1 and pending[0].is_dir():
      write_manifest(storage.join(self.directory, pending[0].name), at_commit=_WRITTEN_AT_COMMIT)
    # Otherwise (another atomicity mode) the manifest is written once the step is finalised.

  def poll(self) -> None:
    """Non-blocking: once the save in flight has finished, completes its manifest or raises."""
    if self._saving is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def out_of_space(self, what: str) -> OutOfSpace:
    """The error for another write (e.g. `metrics.jsonl`) that found the disk full, naming the
    step the run resumes from once the save in flight is finished or removed."""
    try:
      self.wait()
    except Exception as e:  # The disk is full: the save in flight most likely failed too.
      _log.debug("the save in flight failed: %r", e)
    _remove_failed_save(self.directory)
    resume = self._resume_without(None, ", so a rerun starts afresh")
    where = f" {what}" if what else ""
    return OutOfSpace(f"no space left on the device{where}: {resume}; free space and rerun")

  def _unwritable(
      self, step: int, error: BaseException, *, manifest_kept: bool | None = None
  ) -> Unwritable:
    """The error for a checkpoint folder that became unwritable at the save of `step`, or (with
    `manifest_kept`) at the writing of its manifest."""
    at_manifest = manifest_kept is not None
    if not at_manifest:
      _remove_failed_save(self.directory, at_most=1.0)  # May not be removable any more.
    resume = self._resume_without(None if manifest_kept else step, ", so a rerun starts afresh")
    what = f"the manifest of step {step}" if at_manifest else f"the checkpoint of step {step}"
    return Unwritable(
        f"cannot write {what} in '{self.directory}': {unwritable_reason(error)} (the folder is "
        f"not writable); {resume}; make the folder writable and rerun"
    )

  def _resume_without(self, step: int | None, afresh: str = "") -> str:
    """Where a rerun resumes once the failed save of `step` is gone."""
    latest = [s for s in self._manager.all_steps() if s != step]
    return (
        f"the run can resume from step {max(latest)}"
        if latest
        else f"no earlier checkpoint exists{afresh}"
    )

  def _out_of_space(self, step: int, needed: int, free: int | None = None) -> OutOfSpace:
    """The error for a save that cannot fit; the half-written step is removed first."""
    _remove_failed_save(self.directory)  # The error says so.
    if free is None and not storage.is_remote(self.directory):
      free = shutil.disk_usage(self.directory).free
    available = f"{_megabytes(free)} is free" if free is not None else "the store refused it"
    resume = self._resume_without(step)
    return OutOfSpace(
        f"no space left to save the checkpoint of step {step} in '{self.directory}': it needs "
        f"about {_megabytes(needed)} and {available}. Nothing of step {step} was "
        f"kept and {resume}; free space and rerun"
    )

  def restore(
      self, template_state: Any, *, check_iterator_state: Callable[[dict], Any] | None = None
  ) -> tuple[Any, dict, int] | None:
    """(state, data_iterator_state, step) of the newest readable checkpoint, restored onto
    `template_state`'s shapes and shardings, or None when there is none. A step whose iterator
    state `check_iterator_state` rejects is skipped, so a resume never restarts the data stream.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    self.skipped = []
    if not steps:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template_state)
    failures: dict[int, str] = {}  # Step skipped: why.

    def skip(step: int, error: Exception) -> None:
      failures[step] = f"step {step}: {_describe(error, storage.join(self.directory, str(step)))}"
      _log.warning(
          "checkpoint at step %d in %s cannot be used (%s); trying an older one",
          step,
          self.directory,
          failures[step],
      )

    for step in steps:
      tampered = verify_manifest(storage.join(self.directory, str(step)))
      if tampered:
        skip(step, _Unusable(tampered))
        continue
      try:
        metadata = self._manager.item_metadata(step)[STATE]
        if metadata is None:
          raise ValueError("no metadata for the train state")
      except Exception as e:  # Unreadable metadata: a corrupt or partial checkpoint.
        skip(step, e)
        continue
      mismatch = _structure_mismatch(abstract, metadata)
      if mismatch:
        raise UserError(
            f"the checkpoint at step {step} in '{self.directory}' holds a different model or "
            f"optimiser than this config builds ({mismatch}); use the config the run was trained "
            "with (saved as config.json in the workdir) or a new workdir"
        )
      try:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE: ocp.args.PyTreeRestore(
                        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                    ),
                    DATA_ITERATOR: ocp.args.JsonRestore(),
                }
            ),
        )
      except Exception as e:  # A corrupt step falls back to the previous one.
        skip(step, e)
        continue
      iterator_state = dict(restored[DATA_ITERATOR] or {})
      if check_iterator_state is not None:
        try:
          check_iterator_state(iterator_state)
        except Exception as e:  # Any failure to resume the stream from it.
          skip(step, _Unusable(f"unusable data-iterator state {iterator_state!r}: {e!r}"))
          continue
      restored = restored[STATE], iterator_state, step
      break
    else:
      unverified = [step for step, why in failures.items() if f"no {MANIFEST}" in why]
      hint = (
          f"\nA step without a manifest is not restored unverified. If you know its files are as "
          f"saved (e.g. a workdir from before checksums), vouch for it with\n  {TRUST_COMMAND} "
          + " ".join(storage.join(self.directory, str(step)) for step in unverified)
          if unverified
          else ""
      )
      raise UserError(
          f"no readable checkpoint in '{self.directory}':\n  "
          + "\n  ".join(failures.values())
          + hint
      )
    if failures:
      self.skipped = list(failures.values())
      _log.warning(
          "restored step %d after skipping checkpoints that cannot be used (moved to %s): %s",
          restored[2],
          self._move_aside(list(failures)),
          "; ".join(self.skipped),
      )
    return restored

  def _move_aside(self, steps: list[int]) -> str:
    """Moves unreadable step directories to `<directory>/corrupt/`: left in place, `save` would
    skip that step as already saved. Every process tries the rename; one succeeds."""
    corrupt = storage.join(self.directory, "corrupt")
    storage.makedirs(corrupt)
    for step in steps:
      target, n = storage.join(corrupt, str(step)), 1
      while storage.path(target).exists():
        target, n = storage.join(corrupt, f"{step}.{n}"), n + 1
      try:
        # On an object store a rename is a copy of each object, then a delete.
        storage.path(storage.join(self.directory, str(step))).rename(target)
      except (FileNotFoundError, FileExistsError):
        pass  # Another process moved it (to the same target: epath checks it first).
    self._manager.reload()
    return corrupt

  def wait(self) -> None:
    """Waits for the save in flight, then completes the manifest of each step saved here."""
    with self._save_errors(self._saving):
      self._manager.wait_until_finished()
    self._saving = None
    if jax.process_index() != 0:
      self._unmanifested.clear()
      return
    for step in sorted(self._unmanifested):
      step_dir = storage.join(self.directory, str(step))
      try:
        if storage.path(step_dir).is_dir():
          if storage.path(storage.join(step_dir, MANIFEST)).exists():
            complete_manifest(step_dir)
          else:
            write_manifest(step_dir)
      except OSError as e:
        if unwritable_reason(e):
          # A manifest written before the commit still verifies the step.
          kept = storage.path(storage.join(step_dir, MANIFEST)).exists()
          raise self._unwritable(step, e, manifest_kept=kept) from e
        raise
      self._unmanifested.discard(step)

  def close(self) -> None:
    self.wait()
    self._manager.close()


def restore_trained(checkpointer: Checkpointer, template_state: Any) -> tuple[Any, int]:
  """(state, step) of the latest readable checkpoint, for a mode that needs a trained run
  (eval, predict, export); closes the checkpointer. No checkpoint is a UserError."""
  restored = checkpointer.restore(template_state)
  checkpointer.close()
  if restored is None:
    raise UserError(f"no checkpoint in '{checkpointer.directory}': train first (--mode=train)")
  state, _, step = restored
  return evaluation_state(state), step  # The parameter EMA when the optimizer keeps one.


def trust(step_dir: str) -> str:
  """Writes the manifest of a step that has none (`TRUST_COMMAND`); returns what was done."""
  step_dir = storage.resolve(step_dir)
  name = storage.path(step_dir).name
  if not name.isdigit() or not storage.path(step_dir).is_dir():
    raise UserError(f"'{step_dir}' is not a checkpoint step directory (checkpoints/<step>)")
  if not storage.path(storage.join(step_dir, "_CHECKPOINT_METADATA")).exists():
    raise UserError(f"'{step_dir}' is not a finished Orbax checkpoint (no _CHECKPOINT_METADATA)")
  if storage.path(storage.join(step_dir, MANIFEST)).exists():
    problem = verify_manifest(step_dir)
    if problem:
      raise UserError(
          f"'{step_dir}' already has a manifest and {problem}: it is not replaced; delete "
          f"{MANIFEST} first if you trust the files as they are now"
      )
    return f"{step_dir}: its manifest is already there and matches"
  write_manifest(step_dir)
  return f"{step_dir}: manifest written; the step will be restored as it is now"


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> int:
  import argparse

  parser = argparse.ArgumentParser(
      prog="python -m trainkit.checkpoint",
      description=(
          "Vouch for checkpoint steps that have no checksum manifest (saved before checksums, or "
          "whose manifest was lost), so that a run restores them. Only for files you know are "
          "as they were saved: the manifest records them as they are now."
      ),
  )
  parser.add_argument("--trust", nargs="+", metavar="STEP_DIR", required=True)
  for step_dir in parser.parse_args(argv).trust:
    print(trust(step_dir))
  return 0


if __name__ == "__main__":
  sys.exit(main())
