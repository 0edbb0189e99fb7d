"""The workdir (`trainkit.workdir`): its config on resume, the run lock, an unwritable folder."""

import json
import os
import socket
import subprocess
import sys
import time

import ml_collections
import pytest

from trainkit import storage
from trainkit.errors import UserError
from trainkit.workdir import prepare_workdir, save_config, workdir_lock


def test_changed_config_on_resume_is_reported(tmp_path, caplog):
  config = ml_collections.ConfigDict({"batch_size": 8, "mesh": {"data": 1}})
  save_config(config, str(tmp_path))
  config.mesh.data = 2
  with caplog.at_level("WARNING"):
    save_config(config, str(tmp_path))
  assert "mesh.data: 1 -> 2" in caplog.text and "batch_size" not in caplog.text
  assert json.loads((tmp_path / "config.json").read_text())["mesh"]["data"] == 2
  # The earlier config is kept, numbered, not overwritten; an unchanged config adds nothing.
  assert (
      json.loads((tmp_path / "config_history" / "config.1.json").read_text())["mesh"]["data"] == 1
  )
  save_config(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "config_history")) == ["config.1.json"]
  config.batch_size = 16
  save_config(config, str(tmp_path))
  kept = json.loads((tmp_path / "config_history" / "config.2.json").read_text())
  assert kept["batch_size"] == 8 and kept["mesh"]["data"] == 2


def test_unwritable_workdir_is_a_user_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(UserError, match="not writable"):
    prepare_workdir(str(blocker / "sub"))


@pytest.mark.slow
def test_workdir_lock_refuses_a_second_run_and_takes_over_stale_locks(tmp_path, caplog):
  with workdir_lock(str(tmp_path)):
    owner = json.loads((tmp_path / ".run.lock").read_text())
    assert owner["pid"] == os.getpid()
    with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()}"):
      with workdir_lock(str(tmp_path)):
        pass
  assert not (tmp_path / ".run.lock").exists()  # released on exit
  # A lock left by a dead process on this host (kill -9) is stale.
  dead = subprocess.run(
      [sys.executable, "-c", "import os; print(os.getpid())"],
      capture_output=True,
      text=True,
      check=True,
  )
  (tmp_path / ".run.lock").write_text(
      json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "started": 0})
  )
  with caplog.at_level("WARNING"):
    with workdir_lock(str(tmp_path)):
      assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
  assert "stale run lock" in caplog.text
  # Released also when the run fails.
  with pytest.raises(RuntimeError):
    with workdir_lock(str(tmp_path)):
      raise RuntimeError("boom")
  assert not (tmp_path / ".run.lock").exists()
  # Another host's lock cannot be checked: refused, with the way out.
  (tmp_path / ".run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
  with pytest.raises(UserError, match="remove .*run.lock"):
    with workdir_lock(str(tmp_path)):
      pass


def test_an_empty_run_lock_is_stale_once_old_and_held_while_fresh(tmp_path, caplog):
  lock = tmp_path / ".run.lock"
  lock.write_text("")  # Its writer died between creating the file and naming itself.
  with pytest.raises(UserError, match="has not named itself"):  # Fresh: maybe being written.
    with workdir_lock(str(tmp_path)):
      pass
  old = time.time() - 60
  os.utime(lock, (old, old))
  with caplog.at_level("WARNING"):
    with workdir_lock(str(tmp_path)):
      assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert "names no owner" in caplog.text


def test_keys_that_change_nothing_trained_do_not_make_a_finished_run_stale(tmp_path):
  """A finished run trained before `model.remat` existed (format version 1, migrated), or with
  another preflight setting, trained what the config asks for now; a changed learning rate
  still makes it stale."""
  import json

  import ml_collections

  from trainkit.workdir import trained_config_differences

  saved = {"optimizer": {"learning_rate": 0.1}, "model": {}, "preflight": {"utilization": 0.4}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = ml_collections.ConfigDict(
      {
          "optimizer": {"learning_rate": 0.1},
          "model": {"remat": "none"},
          "preflight": {"utilization": 0.0},
          "distributed": {"startup_timeout_s": 600},
      }
  )
  assert trained_config_differences(str(tmp_path), config) == []
  config.model.remat = "block"
  config.optimizer.learning_rate = 0.2
  assert trained_config_differences(str(tmp_path), config) == [
      "model.remat: 'none' -> 'block'",
      "optimizer.learning_rate: 0.1 -> 0.2",
  ]


def test_the_format_version_is_written_and_older_versions_migrated_in_one_place(tmp_path):
  """config.json carries the format version; an older one gets the keys its runs lacked, with
  the values they trained with, where the package has them (data.attribute_cues and the moe keys
  are fairmoe_jax's alone): version 1 (no version key), 2 (no capacity rounding or groups) and 3
  (no gradient accumulation) and 4 (no parameter EMA)."""
  from causal_attn_jax.config import base_config as causal_base
  from fairmoe_jax.config import base_config as fair_base
  from trainkit.workdir import FORMAT_VERSION, load_saved_config, trained_config_differences

  config = fair_base()
  config.model.remat = "block"
  save_config(config, str(tmp_path))
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["format_version"] == FORMAT_VERSION == 5
  assert load_saved_config(str(tmp_path), fair_base()).to_dict() == config.to_dict()
  assert trained_config_differences(str(tmp_path), config) == []  # The version is no key.

  for base in (fair_base, causal_base):
    old = json.loads(base().to_json_best_effort())
    del old["model"]["remat"], old["distributed"]
    old["data"].pop("attribute_cues", None)
    old.get("moe", {}).pop("capacity_multiple_of", None)
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = load_saved_config(str(tmp_path), base())
    assert loaded.model.remat == "none" and loaded.distributed.startup_timeout_s == 600
    assert loaded.data.get("attribute_cues") is (False if base is fair_base else None)
    assert loaded.get("moe", {}).get("capacity_multiple_of") == (1 if base is fair_base else None)
    assert "format_version" not in loaded
    version_2 = {**json.loads(base().to_json_best_effort()), "format_version": 2}
    if base is fair_base:
      del version_2["moe"]["capacity_multiple_of"], version_2["moe"]["group_size"]
    (tmp_path / "config.json").write_text(json.dumps(version_2))
    loaded = load_saved_config(str(tmp_path), base())
    if base is fair_base:
      assert (loaded.moe.capacity_multiple_of, loaded.moe.group_size) == (1, 1)
    assert "moe" not in loaded or base is fair_base
    version_3 = {**json.loads(base().to_json_best_effort()), "format_version": 3}
    del version_3["optimizer"]["accumulation_steps"]  # Before gradient accumulation.
    (tmp_path / "config.json").write_text(json.dumps(version_3))
    assert load_saved_config(str(tmp_path), base()).optimizer.accumulation_steps == 1
    version_4 = {**json.loads(base().to_json_best_effort()), "format_version": 4}
    del version_4["optimizer"]["ema_decay"]  # Before the parameter EMA.
    (tmp_path / "config.json").write_text(json.dumps(version_4))
    assert load_saved_config(str(tmp_path), base()).optimizer.ema_decay == 0.0


def test_a_newer_format_version_is_refused_in_one_line(tmp_path):
  from fairmoe_jax.config import base_config
  from trainkit.workdir import load_saved_config

  (tmp_path / "config.json").write_text(json.dumps({"format_version": 6, "seed": 0}))
  with pytest.raises(UserError) as e:
    load_saved_config(str(tmp_path), base_config())
  assert str(e.value) == (
      f"{tmp_path / 'config.json'} is of workdir format version 6, and this code reads versions "
      "1 to 5: use the version of the code that trained the run"
  )


def test_a_workdir_whose_name_is_not_utf_8_is_refused_up_front(tmp_path):
  # It trained, then its first checkpoint save was 111 tracebacks (TensorStore takes UTF-8 only).
  workdir = str(tmp_path / os.fsdecode(b"r\xe9sultats"))
  with pytest.raises(UserError, match=r"^'.*/r\\xe9sultats': the workdir's name is not UTF-8"):
    storage.resolve(workdir)
  assert not os.path.exists(workdir)
  assert storage.resolve(str(tmp_path / "r\xe9sultats")) == str(tmp_path / "r\xe9sultats")
