"""User errors (`trainkit.errors`): a full disk or a step that does not fit is one line."""

import errno

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_disk
from trainkit.errors import exit_on_user_error, is_out_of_space


def test_a_full_disk_while_writing_metrics_is_a_user_error():
  @exit_on_user_error
  def write():
    raise OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")

  with pytest.raises(SystemExit) as exit_info:
    write()
  assert exit_info.value.code == 2
  assert is_out_of_space(
      ValueError("RESOURCE_EXHAUSTED: ...: No space left on device [os_error_code='28']")
  )
  assert not is_out_of_space(OSError(errno.ENOENT, "No such file"))


def test_a_step_that_does_not_fit_in_memory_is_one_line_naming_the_keys(capsys):
  # A real allocation XLA refuses at once (4 TiB), as a too-large batch or model gets.
  @exit_on_user_error
  def run():
    jax.jit(lambda: jnp.ones((1 << 40,), jnp.float32))().block_until_ready()

  with pytest.raises(SystemExit) as exit_info:
    run()
  assert exit_info.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("error: the run does not fit in memory (RESOURCE_EXHAUSTED")
  assert "batch_size" in line and "moe.num_experts" in line and "--mode=compile" in line


def test_a_full_disk_in_a_library_s_own_error_is_a_user_error(tmp_path, capsys):
  # safetensors reports a full disk as its own SafetensorError, not an OSError.
  from safetensors.numpy import save_file

  with small_disk(tmp_path, 1) as disk:

    @exit_on_user_error
    def export():
      save_file({"w": np.zeros(1 << 20, np.float32)}, str(disk / "model.safetensors"))

    with pytest.raises(SystemExit) as exit_info:
      export()
  assert exit_info.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("error: no space left on the device"), line
