"""Orbax checkpoints of the train state and the data-iterator position.

Periodic saves keep the newest `max_to_keep`; the final step is always saved.
Restoring walks back from the newest step: a corrupt checkpoint is skipped with a
warning, and only when every checkpoint is unreadable does the run stop with a
UserError naming the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainkit.errors import OutOfSpace, UserError, is_out_of_space

_log = logging.getLogger(__name__)

STATE = "state"
DATA_ITERATOR = "data_iterator"
_TMP_MARKER = ".orbax-checkpoint-tmp"
# Orbax splits a replicated array across its replicas so that they write it in parallel, and
# each split shape costs a compilation (of a slice) at the first save: 6 s for a small model
# on 8 devices. Below this size per replica the parallel write gains nothing, so one replica
# writes the array whole.
MIN_REPLICA_PARALLEL_SLICE_BYTES = 8 << 20
# Room kept free beyond a step's arrays: metadata, the manifest, the data-iterator state.
_SAVE_MARGIN_BYTES = 4 << 20


def _nbytes(tree: Any) -> int:
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def _megabytes(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


def _register_array_handler() -> None:
  # Orbax logs a warning when a registered handler is replaced; this replacement is deliberate.
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=MIN_REPLICA_PARALLEL_SLICE_BYTES
        ),
        override=True,
    )
  finally:
    absl_logger.setLevel(level)


_register_array_handler()


def _abstract(tree: Any) -> Any:
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array)
      else x,
      tree,
  )


def _remove_interrupted_saves(directory: str) -> None:
  """Deletes the temporary directories of saves cut short (e.g. by SIGKILL).

  Done here, synchronously, rather than by Orbax's option of the same purpose, which
  cleans up in a background thread that can race with a short run's exit.
  """
  if jax.process_index() != 0 or not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if _TMP_MARKER in name:
      _log.warning("removing an interrupted checkpoint save: %s", name)
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


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


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
  files = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.relpath(os.path.join(root, name), step_dir)
      if path != MANIFEST:
        files.append(path)
  return sorted(files)


def write_manifest(step_dir: str) -> None:
  """Records every file of a finalised step (sha256, size), written atomically."""
  entries = {
      path: {"sha256": _sha256(os.path.join(step_dir, path)),
             "size": os.path.getsize(os.path.join(step_dir, path))}
      for path in _step_files(step_dir)
  }
  tmp = os.path.join(step_dir, f".{MANIFEST}.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump({"files": entries}, f, indent=1)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify_manifest(step_dir: str) -> str:
  """What does not match the step's manifest ("" when all does, or when there is none)."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(path):
    return ""  # Saved before manifests existed, or cut off before it was written.
  try:
    with open(path) as f:
      entries = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST} is unreadable ({type(e).__name__})"
  for name, entry in sorted(entries.items()):
    file = os.path.join(step_dir, name)
    if not os.path.isfile(file):
      return f"{name} is missing"
    if os.path.getsize(file) != entry.get("size") or _sha256(file) != entry.get("sha256"):
      return f"{name} does not match its checksum in {MANIFEST} (changed since it was saved)"
  extra = sorted(set(_step_files(step_dir)) - set(entries))
  if extra:
    return f"{extra[0]} was not part of the saved checkpoint"
  return ""


@contextlib.contextmanager
def _quiet_library_loggers():
  """Silences Orbax's and TensorStore's own error logging while restores are attempted.

  A corrupt step makes them log thousands of lines (spec dumps, parse errors) through absl;
  the restore reports each skipped step itself, in one warning line.
  """
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


class _Unusable(ValueError):
  """A reason of ours, already one readable line."""


def _describe(error: Exception, step_dir: str) -> str:
  """One line saying what is wrong with a checkpoint: the file when it can be told, and the
  first informative line of the error (TensorStore errors start with a pybind11 repr)."""
  if isinstance(error, _Unusable):
    return str(error)
  if isinstance(error, json.JSONDecodeError):
    for root, _, files in os.walk(step_dir):
      for name in sorted(files):
        path = os.path.join(root, name)
        if name.endswith(".json") or "METADATA" in name:
          try:
            with open(path) as f:
              json.load(f)
          except (OSError, ValueError):
            return f"{os.path.relpath(path, step_dir)} is not valid JSON ({error.msg})"
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  informative = [line for line in lines if not line.startswith("<bound method")]
  with_path = [line for line in informative if step_dir in line]
  text = (with_path or informative or [""])[0]
  return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


class Checkpointer:
  """Saves and restores (train state, data-iterator state) pairs under `directory`."""

  def __init__(
      self,
      directory: str,
      *,
      max_to_keep: int = 3,
      save_interval_steps: int = 1,
      async_save: bool = True,
  ):
    self.directory = os.path.abspath(directory)
    # What the last restore skipped ("step N: why"), for the report; empty when nothing was.
    self.skipped: list[str] = []
    self._manifested: set[int] = set()  # Steps whose manifest exists (written or verified).
    self._saving: tuple[int, int] | None = None  # (step, bytes) of the save in flight.
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise UserError(f"checkpoint directory '{self.directory}' exists and is not a directory")
    _remove_interrupted_saves(self.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        create=True,
        enable_async_checkpointing=async_save,
    )
    try:
      with _quiet_library_loggers():  # It reads every step's metadata; we report problems.
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE: ocp.StandardCheckpointHandler(),
                DATA_ITERATOR: ocp.JsonCheckpointHandler(),
            },
        )
    except Exception as e:  # Orbax reports unreadable directories in many ways.
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
    self._write_manifests()
    # Checked before writing anything: a save that fills the disk fails in Orbax's background
    # threads, half-written, with pages of tracebacks.
    needed = _nbytes(state) + _SAVE_MARGIN_BYTES
    free = shutil.disk_usage(self.directory).free
    if free < needed:
      raise self._out_of_space(step, needed, free)
    args = ocp.args.Composite(
        **{
            STATE: ocp.args.StandardSave(state),
            DATA_ITERATOR: ocp.args.JsonSave(data_iterator_state or {}),
        }
    )
    self._saving = (step, needed)
    try:
      return self._manager.save(step, args=args, force=force)
    except Exception as e:
      if is_out_of_space(e):
        raise self._out_of_space(step, needed) from e
      raise

  def _out_of_space(self, step: int, needed: int, free: int | None = None) -> OutOfSpace:
    """The error for a save that cannot fit; the half-written step is removed first."""
    _remove_interrupted_saves(self.directory)
    if free is None:
      free = shutil.disk_usage(self.directory).free
    latest = [s for s in self._manager.all_steps() if s != step]
    resume = (
        f"the run can resume from step {max(latest)}" if latest else "no earlier checkpoint exists"
    )
    return OutOfSpace(
        f"no space left to save the checkpoint of step {step} in '{self.directory}': it needs "
        f"about {_megabytes(needed)} and {_megabytes(free)} is free. Nothing of step {step} was "
        f"kept and {resume}; free space and rerun"
    )

  def restore(
      self,
      template_state: Any,
      *,
      check_iterator_state: Callable[[dict], Any] | None = None,
  ) -> tuple[Any, dict, int] | None:
    """Restores the newest readable checkpoint onto `template_state`'s shapes and shardings.

    `check_iterator_state(state)` (e.g. the train iterator's `set_state`) must raise on a data-
    iterator state it cannot resume from; such a checkpoint is skipped like an unreadable one,
    so a resume never silently restarts the data stream.

    Returns (state, data_iterator_state, step), or None when there is no checkpoint.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    self.skipped = []
    if not steps:
      return None
    abstract = _abstract(template_state)
    failures = []
    skipped_steps = []

    def skip(step: int, error: Exception) -> None:
      skipped_steps.append(step)
      failures.append(f"step {step}: {_describe(error, os.path.join(self.directory, str(step)))}")
      _log.warning(
          "checkpoint at step %d in %s is unreadable (%s); trying an older one",
          step,
          self.directory,
          failures[-1],
      )

    with _quiet_library_loggers():
      restored = self._restore_newest_readable(
          steps, abstract, skip, check_iterator_state
      )
    if restored is None:
      raise UserError(
          f"no readable checkpoint in '{self.directory}':\n  " + "\n  ".join(failures)
      )
    if failures:
      moved = self._move_aside(skipped_steps)
      _log.warning(
          "restored step %d after skipping unreadable checkpoints (moved to %s): %s",
          restored[2],
          moved,
          "; ".join(failures),
      )
      self.skipped = failures
    return restored

  def _restore_newest_readable(
      self,
      steps: list[int],
      abstract: Any,
      skip: Callable[[int, Exception], None],
      check_iterator_state: Callable[[dict], Any] | None,
  ) -> tuple[Any, dict, int] | None:
    """The first of `steps` that restores and passes the checks; `skip` records the others."""
    for step in steps:
      tampered = verify_manifest(os.path.join(self.directory, str(step)))
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
                    STATE: ocp.args.StandardRestore(abstract),
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
      return restored[STATE], iterator_state, step
    return None

  def _move_aside(self, steps: list[int]) -> str:
    """Moves unreadable step directories to `<directory>/corrupt/` (kept for inspection).

    A corrupt step left in place would make `save` skip that step ("already saved") and a later
    --mode=eval score an older one; moved aside, the step is written again when training
    reaches it. Every process tries the rename; one succeeds.
    """
    corrupt = os.path.join(self.directory, "corrupt")
    os.makedirs(corrupt, exist_ok=True)
    for step in steps:
      target = os.path.join(corrupt, str(step))
      n = 1
      while os.path.exists(target):
        target = os.path.join(corrupt, f"{step}.{n}")
        n += 1
      try:
        os.rename(os.path.join(self.directory, str(step)), target)
      except FileNotFoundError:
        pass  # Another process moved it.
    self._manager.reload()
    return corrupt

  def _wait_for_save(self) -> None:
    """Waits for the asynchronous save in flight, turning a full disk into one message."""
    try:
      with _quiet_library_loggers():  # Its threads log each failed write at length.
        self._manager.wait_until_finished()
    except Exception as e:
      if self._saving is not None and is_out_of_space(e):
        step, needed = self._saving
        raise self._out_of_space(step, needed) from e
      raise
    self._saving = None

  def _write_manifests(self) -> None:
    """Writes the manifest of every finished step that lacks one (after Orbax finalised it)."""
    self._wait_for_save()
    if jax.process_index() != 0:
      return
    for step in self._manager.all_steps():
      step_dir = os.path.join(self.directory, str(step))
      if os.path.isdir(step_dir) and step not in self._manifested:
        if not os.path.exists(os.path.join(step_dir, MANIFEST)):
          write_manifest(step_dir)
        self._manifested.add(step)

  def wait(self) -> None:
    self._write_manifests()

  def close(self) -> None:
    self._write_manifests()
    self._manager.close()


def restore_trained(checkpointer: Checkpointer, template_state: Any) -> tuple[Any, int]:
  """(state, step) of the latest readable checkpoint, for a mode that needs a trained run
  (eval, predict, export); closes the checkpointer. No checkpoint is a UserError."""
  restored = checkpointer.restore(template_state)
  checkpointer.close()
  if restored is None:
    raise UserError(f"no checkpoint in '{checkpointer.directory}': train first (--mode=train)")
  state, _, step = restored
  return state, step


def checkpoint_report(checkpointer: Checkpointer) -> dict[str, Any]:
  """report.json's statement of a fallback: the unreadable checkpoints the run skipped, if any.

  A warning among thousands of log lines is easy to miss; the report is what people read.
  """
  if not checkpointer.skipped:
    return {}
  return {"checkpoint_fallback": {"skipped": list(checkpointer.skipped)}}
