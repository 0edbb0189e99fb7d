"""A run's length given on the command line is never overridden without a word.

`configs/celeba.py` sets num_epochs (8 at size=small), which sets num_train_steps from the
training set's size: `--config.num_train_steps=30` was ignored silently and the run trained 238
steps. The command line's key now wins and the run says what it ignored; both keys on the command
line are refused in one line naming both.
"""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from trainkit.config import resolve_train_steps, settle_run_length
from trainkit.errors import UserError


def _config(num_epochs) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(num_train_steps=350, num_epochs=num_epochs, batch_size=64))


# fairmoe_jax counts whole epochs, causal_attn_jax fractions of one.
@pytest.mark.parametrize("epochs", [8, 8.0])
def test_the_steps_given_win_over_the_files_epochs_and_say_so(epochs):
  config = _config(epochs)
  config.num_train_steps = 30  # What --config.num_train_steps=30 did to the loaded file.
  line = settle_run_length(config, {"num_train_steps": 30})
  assert line == (
      "--config.num_train_steps=30 was given: the run trains 30 steps, and num_epochs=8 from the "
      "config file is ignored"
  )
  assert config.num_epochs == 0 and type(config.num_epochs) is type(epochs)
  resolve_train_steps(config, 1900, training=True)  # What training does once the data is loaded.
  assert config.num_train_steps == 30


def test_both_lengths_on_the_command_line_are_refused_naming_both():
  config = _config(8)
  with pytest.raises(UserError) as raised:
    settle_run_length(config, {"num_train_steps": 30, "num_epochs": 2})
  message = str(raised.value)
  assert "--config.num_train_steps=30" in message and "--config.num_epochs=2" in message
  assert "\n" not in message


@pytest.mark.parametrize(
    "num_epochs, overrides",
    [
        (8, {}),  # The file's epochs, nothing given: epochs decide, as documented.
        (8, {"num_epochs": 3}),  # Only epochs given: they decide.
        (0, {"num_train_steps": 30}),  # A config that counts steps.
        (8, {"num_train_steps": 30, "num_epochs": 0}),  # Consistent: 0 = the steps decide.
    ],
)
def test_nothing_to_settle(num_epochs, overrides):
  config = _config(num_epochs)
  assert settle_run_length(config, overrides) is None
  assert config.num_epochs == num_epochs  # Left as it was.


# A config file that sets num_epochs as configs/celeba.py does, on the quickstart's synthetic data
# cut to seconds (64 training images, 16 a batch: 3 epochs are 12 steps).
EPOCHS_CONFIG = """
from configs.quickstart import get_config as quickstart

def get_config(arg=None):
  config = quickstart(arg)
  config.num_epochs = 3
  config.data.update(train_size=64, val_size=32, test_size=32)
  config.model.update(dim=16, depth=1, num_heads=2, mlp_dim=16)
  config.update(batch_size=16, eval_batch_size=32, eval_every_steps=0)
  config.fair.review_every_steps = 0
  return config
"""


def _main(tmp_path, repo_root, *overrides):
  (tmp_path / "epochs.py").write_text(EPOCHS_CONFIG)
  return subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.main",
          f"--config={tmp_path / 'epochs.py'}",
          f"--workdir={tmp_path / 'run'}",
          *overrides,
      ],
      cwd=repo_root,
      capture_output=True,
      text=True,
      timeout=600,
      env={**os.environ, "PYTHONPATH": str(repo_root)},
  )


@pytest.mark.slow
def test_a_run_trains_the_steps_given_on_a_config_that_sets_epochs(tmp_path, repo_root):
  result = _main(tmp_path, repo_root, "--config.num_train_steps=2")
  assert result.returncode == 0, result.stdout + result.stderr
  assert (
      "--config.num_train_steps=2 was given: the run trains 2 steps, and num_epochs=3 from the "
      "config file is ignored"
  ) in result.stdout
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["num_train_steps"] == 2 and saved["num_epochs"] == 0


@pytest.mark.slow
def test_both_lengths_given_stop_the_run_in_one_line(tmp_path, repo_root):
  result = _main(tmp_path, repo_root, "--config.num_train_steps=2", "--config.num_epochs=1")
  assert result.returncode == 2, result.stdout + result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "--config.num_train_steps=2" in lines[0], result.stderr
  assert "--config.num_epochs=1" in lines[0]
  assert not (tmp_path / "run").exists()
