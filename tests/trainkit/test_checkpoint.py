"""Checkpoints (`trainkit.checkpoint`): round trips, verified restores, corrupt, partial and
unwritable steps, and full disks."""

import contextlib
import errno
import gc
import json
import logging
import os
import re
import subprocess
import threading
import time
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_disk
from toy_training import WaitingIterator, toy_loop, toy_train_state
from trainkit import checkpoint as checkpoint_module
from trainkit.checkpoint import Checkpointer
from trainkit.errors import OutOfSpace, UserError
from trainkit.mesh import make_mesh


@flax.struct.dataclass
class _State:
  step: jax.Array
  w: jax.Array


def _corrupt(step_dir):
  for root, _, files in os.walk(step_dir):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")


def _wait_until(condition, what: str, timeout: float = 60.0) -> None:
  deadline = time.time() + timeout
  while not condition():
    if time.time() > deadline:
      raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
    time.sleep(0.01)


def _flip_a_byte(step_dir) -> None:
  """Flips one byte in the middle of the largest file (array data: the structure still parses)."""
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "trainkit_manifest.json"]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x01
  largest.write_bytes(bytes(data))


def _fail_data_iterator_saves_of(step: int, monkeypatch) -> None:
  """Orbax's background write of step `step`'s data-iterator state meets a full disk."""
  original = ocp.JsonCheckpointHandler._save_fn

  async def save_fn(self, x, directory):
    if f"/{step}.orbax-checkpoint-tmp" in str(directory):
      raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))
    return await original(self, x, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)


@contextlib.contextmanager
def _a_folder_that_becomes_unwritable(tmp_path):
  """(folder, make_unwritable): a permission change, or for root (whom permissions do not stop)
  a small tmpfs remounted read-only (skipped where mounting is not allowed)."""
  if os.geteuid() != 0:
    folder = tmp_path / "disk"
    folder.mkdir()
    try:
      yield folder, lambda: os.chmod(folder / "ckpt", 0o555)
    finally:
      if (folder / "ckpt").exists():
        os.chmod(folder / "ckpt", 0o755)
    return
  with small_disk(tmp_path, 8) as disk:
    yield disk, lambda: subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def _orbax_threads():
  return [t for t in threading.enumerate() if "orbax" in type(t).__module__ and t.is_alive()]


def test_checkpoint_round_trip_keeps_n_and_restores_sharding(tmp_path):
  mesh = make_mesh({"data": 2, "expert": 4})
  sharding = jax.sharding.NamedSharding(mesh, P("expert"))
  state = _State(step=jnp.array(0), w=jax.device_put(jnp.arange(8.0), sharding))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.save(
        step, state.replace(step=jnp.array(step), w=state.w * step), {"pos": step}, force=True
    )
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3]
  restored, data_state, step = ckpt.restore(state)
  assert step == 3 and data_state == {"pos": 3} and int(restored.step) == 3
  np.testing.assert_array_equal(restored.w, np.arange(8.0) * 3)
  assert restored.w.sharding == sharding
  ckpt.close()


def test_corrupt_latest_checkpoint_falls_back_with_warning(tmp_path, caplog):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=3, async_save=False)
  for step in (1, 2):
    ckpt.save(step, state.replace(step=jnp.array(step)), {"pos": step}, force=True)
  ckpt.close()
  _corrupt(tmp_path / "ckpt" / "2")
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    restored, data_state, step = ckpt.restore(state)
  assert step == 1 and data_state == {"pos": 1}
  assert any("step 2" in r.getMessage() for r in caplog.records)
  # Our one line per skipped step; the manifest is checked before Orbax restores a step, so
  # Orbax and TensorStore log at most one line of it (its metadata that does not parse), not
  # their pages of spec dumps and parse errors.
  library_lines = [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
  assert len(library_lines) <= 1, [r.getMessage()[:200] for r in library_lines]
  assert ckpt.skipped and ckpt.skipped[0].startswith("step 2:")
  # The corrupt step is kept aside, not left to block a new save of step 2.
  assert (tmp_path / "ckpt" / "corrupt" / "2").is_dir()
  assert ckpt.all_steps() == [1]
  assert ckpt.save(2, state.replace(step=jnp.array(2)), {"pos": 2}, force=True)
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  _, data_state, step = ckpt.restore(state)
  assert (step, data_state, ckpt.skipped) == (2, {"pos": 2}, [])


def test_all_checkpoints_corrupt_is_a_user_error(tmp_path):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {}, force=True)
  ckpt.close()
  _corrupt(tmp_path / "ckpt" / "1")
  # Each step says what is wrong with it (a file that does not parse), not a pybind11 repr.
  with pytest.raises(
      UserError, match=r"no readable checkpoint.*\n  step 1: \S+ is (not valid JSON|unreadable)"
  ):
    Checkpointer(str(tmp_path / "ckpt")).restore(state)


def test_checksum_manifest_catches_a_flipped_byte_that_orbax_would_restore(tmp_path, caplog):
  state = _State(step=jnp.array(0), w=jnp.arange(256.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=True)
  for step in (1, 2):
    ckpt.save(step, state.replace(step=jnp.array(step)), {"pos": step}, force=True)
  ckpt.close()
  for step in (1, 2):
    assert (tmp_path / "ckpt" / str(step) / "trainkit_manifest.json").is_file()
  # Flip one byte in the largest file of step 2 (array data): the structure still parses.
  files = [
      p
      for p in (tmp_path / "ckpt" / "2").rglob("*")
      if p.is_file() and p.name != "trainkit_manifest.json"
  ]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x01
  largest.write_bytes(bytes(data))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    _, iterator_state, step = ckpt.restore(state)
  assert step == 1 and iterator_state == {"pos": 1}
  assert "does not match its checksum" in ckpt.skipped[0]


def test_unusable_iterator_state_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
  """An iterator state of {} must not restart the data stream silently (nor be a traceback)."""
  from causal_attn_jax.data.iterator import TrainIterator

  data = {"ids": np.arange(40).reshape(20, 2)}
  iterator = TrainIterator(data, 4, seed=0, seq_keys=("ids",))
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {"epoch": 0, "index": 8}, force=True)
  ckpt.save(2, state, {}, force=True)
  ckpt.close()
  with caplog.at_level("WARNING"):
    _, iterator_state, step = Checkpointer(str(tmp_path / "ckpt")).restore(
        state, check_iterator_state=iterator.set_state
    )
  assert step == 1 and iterator_state == {"epoch": 0, "index": 8}
  assert "step 2" in caplog.text and "lacks ['epoch', 'index']" in caplog.text
  assert (iterator.epoch, iterator.index) == (0, 8)
  with pytest.raises(ValueError, match="lacks"):
    iterator.set_state({})


def test_checkpoint_of_a_different_model_is_a_user_error_naming_the_array(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, _State(step=jnp.array(0), w=jnp.arange(4.0)), {}, force=True)
  ckpt.close()
  with pytest.raises(UserError, match=r"different model .*w has shape \(4,\), expected \(5,\)"):
    Checkpointer(str(tmp_path / "ckpt")).restore(_State(step=jnp.array(0), w=jnp.arange(5.0)))


def test_checkpoint_path_that_is_a_file_is_a_user_error(tmp_path):
  (tmp_path / "ckpt").write_text("not a directory")
  with pytest.raises(UserError, match="not a directory"):
    Checkpointer(str(tmp_path / "ckpt"))


def test_a_symlinked_step_is_set_aside_and_what_it_points_to_is_untouched(tmp_path, capsys):
  # `ln -s /outside/dir W/checkpoints/5`: Orbax's clean-up of old steps refused to rmtree the
  # link, so every save failed ("Cannot call rmtree on a symbolic link").
  outside = tmp_path / "outside"
  (outside / "state").mkdir(parents=True)
  (outside / "state" / "precious.txt").write_text("keep me")
  directory = tmp_path / "ckpt"
  directory.mkdir()
  (directory / "5").symlink_to(outside, target_is_directory=True)
  ckpt = Checkpointer(str(directory), max_to_keep=1, async_save=False)
  assert "is a symbolic link (to " in capsys.readouterr().out
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  for step in (10, 20):
    ckpt.save(step, state, {}, force=True)
  ckpt.close()
  assert ckpt.all_steps() == [20]
  assert (outside / "state" / "precious.txt").read_text() == "keep me"
  assert os.path.islink(directory / "set-aside" / "5")
  assert sorted(os.listdir(directory)) == ["20", "set-aside"]


def test_leftover_temporary_checkpoint_is_removed_on_start(tmp_path):
  state = _State(step=jnp.array(0), w=jnp.arange(4.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state, {}, force=True)
  ckpt.close()
  # What a save cut short by SIGKILL leaves behind (Orbax's temporary-directory name).
  leftover = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234567890"
  (leftover / "state").mkdir(parents=True)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert not leftover.exists()
  assert ckpt.all_steps() == [1] and ckpt.restore(state)[2] == 1


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path):
  small = _State(step=jnp.array(0), w=jnp.zeros(1000))
  big = _State(step=jnp.array(0), w=jnp.zeros(1 << 20))  # 4 MiB: cannot fit beside the margin.
  with small_disk(tmp_path, 6) as disk:
    ckpt = Checkpointer(str(disk / "ckpt"), async_save=False)
    ckpt.save(1, small, {}, force=True)
    with pytest.raises(OutOfSpace, match=r"step 2 in '.*ckpt'.*resume from step 1"):
      ckpt.save(2, big, {}, force=True)
    assert sorted(os.listdir(disk / "ckpt")) == ["1"]
    ckpt.close()


def test_a_save_that_fills_the_disk_is_one_error_and_leaves_no_partial_step(tmp_path, monkeypatch):
  # The check before writing is disabled to reach the failure inside Orbax's writer threads.
  monkeypatch.setattr(checkpoint_module, "_SAVE_MARGIN_BYTES", -(1 << 30))
  big = _State(step=jnp.array(0), w=jax.random.normal(jax.random.key(0), (1 << 20,)))
  with small_disk(tmp_path, 2) as disk:
    ckpt = Checkpointer(str(disk / "ckpt"))
    with pytest.raises(OutOfSpace, match="no space left to save the checkpoint of step 1"):
      ckpt.save(1, big, {}, force=True)
      ckpt.wait()
    assert os.listdir(disk / "ckpt") == []


def test_a_step_has_its_manifest_as_soon_as_it_is_finalised_so_a_kill_leaves_none_unverified(
    tmp_path,
):
  # SIGKILL at step 15 of a run that checkpoints every 10 steps. Step 10 was
  # finalised long before; its manifest must not wait for the save of step 20.
  steps = tmp_path / "ckpt"
  ckpt = Checkpointer(str(steps))

  def crash(position):
    _wait_until(lambda: (steps / "10").is_dir(), "the commit of step 10")
    raise KeyboardInterrupt("killed at step 15")  # Nothing of the loop runs after it.

  with pytest.raises(KeyboardInterrupt):
    toy_loop(tmp_path, ckpt, WaitingIterator({16}, crash))
  assert sorted(os.listdir(steps)) == ["10"]
  assert (steps / "10" / "trainkit_manifest.json").is_file()
  assert checkpoint_module.verify_manifest(str(steps / "10")) == ""
  # The rerun (a new process) verifies it: a flipped byte is caught, never restored.
  _flip_a_byte(steps / "10")
  with pytest.raises(UserError, match=r"step 10: \S+ does not match its checksum"):
    Checkpointer(str(steps)).restore(toy_train_state(0.0))

  # The manifest is written before Orbax's commit, so the commit's own two files are named
  # without a checksum; the first check after the commit adds theirs (`poll`, between steps).
  state = _State(step=jnp.array(0), w=jnp.arange(64.0))
  ckpt = Checkpointer(str(tmp_path / "polled"))
  ckpt.save(1, state, {"pos": 1}, force=True)
  _wait_until(lambda: (tmp_path / "polled" / "1").is_dir(), "the commit of step 1")
  manifest = json.loads((tmp_path / "polled" / "1" / "trainkit_manifest.json").read_text())
  assert manifest["files"]["_CHECKPOINT_METADATA"] == {"at_commit": True}
  assert checkpoint_module.verify_manifest(str(tmp_path / "polled" / "1")) == ""
  _wait_until(lambda: not ckpt._manager.is_saving_in_progress(), "the end of the save")
  ckpt.poll()
  manifest = json.loads((tmp_path / "polled" / "1" / "trainkit_manifest.json").read_text())
  assert all("sha256" in entry for entry in manifest["files"].values()), manifest
  assert checkpoint_module.verify_manifest(str(tmp_path / "polled" / "1")) == ""
  ckpt.close()


def test_a_step_without_a_manifest_is_never_restored_unverified(tmp_path, caplog, capsys):
  # A deleted manifest (or a step saved before checksums) must not turn the check
  # off. Policy: such a step is skipped like a corrupt one (fallback, with the reason); with no
  # verified step left, one error naming the steps and the command that vouches for them.
  from trainkit.checkpoint import restore_trained

  state = _State(step=jnp.array(0), w=jnp.arange(256.0))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  for step in (1, 2):
    ckpt.save(
        step, state.replace(step=jnp.array(step), w=state.w * step), {"pos": step}, force=True
    )
  ckpt.close()
  (tmp_path / "ckpt" / "2" / "trainkit_manifest.json").unlink()
  _flip_a_byte(tmp_path / "ckpt" / "2")
  # What --mode=eval restores (and a resumed training, through the same restore).
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with caplog.at_level("WARNING"):
    restored, step = restore_trained(ckpt, state)
  assert step == 1
  np.testing.assert_array_equal(restored.w, np.arange(256.0))
  assert "no trainkit_manifest.json" in ckpt.skipped[0] and ckpt.skipped[0].startswith("step 2")
  assert "step 2" in caplog.text and "cannot be verified" in caplog.text
  assert (tmp_path / "ckpt" / "corrupt" / "2").is_dir()  # Kept, and retrained past.

  # A workdir whose every step lacks a manifest (e.g. saved before checksums): one error naming
  # the steps and how to vouch for them; nothing is moved.
  (tmp_path / "ckpt" / "1" / "trainkit_manifest.json").unlink()
  with pytest.raises(UserError) as error:
    Checkpointer(str(tmp_path / "ckpt")).restore(state)
  message = str(error.value)
  assert "step 1: it has no trainkit_manifest.json" in message
  assert f"python -m trainkit.checkpoint --trust {tmp_path / 'ckpt' / '1'}" in message
  assert (tmp_path / "ckpt" / "1").is_dir()
  assert checkpoint_module.main(["--trust", str(tmp_path / "ckpt" / "1")]) == 0
  assert "manifest written" in capsys.readouterr().out
  _, iterator_state, step = Checkpointer(str(tmp_path / "ckpt")).restore(state)
  assert (step, iterator_state) == (1, {"pos": 1})
  # Vouching never overrides a manifest that the files do not match.
  _flip_a_byte(tmp_path / "ckpt" / "1")
  with pytest.raises(UserError, match="already has a manifest and .* does not match"):
    checkpoint_module.trust(str(tmp_path / "ckpt" / "1"))


def test_a_disk_that_fills_during_an_async_save_stops_the_run_at_once_with_one_error(
    tmp_path, monkeypatch, caplog
):
  # The disk fills while step 20 is written in Orbax's background threads. The run
  # stops at the next step boundary (not at the next save, after pages of writer tracebacks)
  # with one error naming the space problem and the step to resume from; no tmp step is left.
  _fail_data_iterator_saves_of(20, monkeypatch)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  wait_for_the_save = lambda position: _wait_until(
      lambda: not ckpt._manager.is_saving_in_progress(), "the end of the save of step 20"
  )
  iterator = WaitingIterator({22}, wait_for_the_save)
  with caplog.at_level("WARNING"):
    with pytest.raises(OutOfSpace) as error:
      # Read synchronously, the iterator's position is the step the loop reached.
      toy_loop(tmp_path, ckpt, iterator, device_prefetch=0)
  assert iterator.position <= 22  # Stopped at the first step boundary after the failure.
  assert re.search(
      r"no space left to save the checkpoint of step 20 .*resume from step 10", str(error.value)
  ), error.value
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["10"]


def test_a_checkpoint_folder_made_unwritable_mid_run_is_one_error_at_the_next_save(
    tmp_path, caplog
):
  # The checkpoint folder becomes unwritable after step 10's save. The save of step 20
  # failed in Orbax's threads with pages of PermissionError tracebacks, and its later stages
  # waited forever for the failed one's signal: not daemon threads, so the process never exited
  # (rerunning the same command is what resumes it, so the run must end).
  with _a_folder_that_becomes_unwritable(tmp_path) as (disk, make_unwritable):
    ckpt = Checkpointer(str(disk / "ckpt"))

    def before(position):
      if position == 16:  # Step 10's save finished (its manifest completes at the next step).
        _wait_until(lambda: not ckpt._manager.is_saving_in_progress(), "the save of step 10")
      else:
        make_unwritable()

    with caplog.at_level("WARNING"):
      with pytest.raises(UserError) as error:
        toy_loop(tmp_path, ckpt, WaitingIterator({16, 18}, before), device_prefetch=0)
    assert re.search(
        r"cannot write the checkpoint of step 20 in '.*ckpt': (Permission denied|Read-only file "
        r"system).*the run can resume from step 10; make the folder writable and rerun",
        str(error.value),
    ), error.value
    # Nothing of Orbax's threads is left to hold up the exit, and none of them logged it.
    _wait_until(lambda: not _orbax_threads(), "the end of Orbax's threads", timeout=10)
    assert not [r for r in caplog.records if "orbax" in r.pathname], caplog.text
    assert sorted(os.listdir(disk / "ckpt")) == ["10"]
    assert checkpoint_module.verify_manifest(str(disk / "ckpt" / "10")) == ""
    # The stages that never ran leave their coroutines unawaited: collected here, quietly,
    # rather than warned about during a later test.
    del ckpt, before, error
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      gc.collect()
