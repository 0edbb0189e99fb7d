"""Command-line plumbing shared by the packages' `main` modules."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

import jax
import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from trainkit.distributed import exit_together, initialize_from_env
from trainkit.errors import UserError, exit_on_user_error, fail
from trainkit.workdir import prepare_workdir, remove_if_empty, require_checkpoint, workdir_lock


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing where a bad `--config...` flag is one line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))
  except UserError as e:  # Raised by a config file's get_config(arg).
    fail(str(e))
  except (KeyError, AttributeError) as e:  # An override names a key the config lacks.
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    fail(f"unknown config key {str(e).strip(chr(34))} in {' '.join(overrides) or 'the overrides'}")
  except Exception as e:  # A config file that fails to load.
    fail(f"cannot load the config: {type(e).__name__}: {e}")


def loaded_config(flag: flags.FlagHolder) -> ml_collections.ConfigDict:
  """The config flag's value; a file that failed to load becomes one clear error.

  ml_collections defers a load failure (missing file, error inside get_config) until
  the config is first touched, so it is touched here, before anything else runs.
  """
  config = flag.value
  if not isinstance(config, ml_collections.ConfigDict):
    try:
      config.to_dict()
    except Exception as e:
      fail(
          f"cannot load --config={flags.FLAGS[flag.name].config_filename}: {type(e).__name__}: {e}"
      )
  return config


def quiet_logging() -> None:
  """JAX and Orbax log at INFO (backends tried, every checkpoint step); users see warnings."""
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger().setLevel(logging.WARNING)


def run(main: Callable[[list[str]], None]) -> None:
  app.run(main, flags_parser=parse_flags)


def train_eval_command(
    *,
    validate: Callable[..., None],
    train_and_evaluate: Callable[[ml_collections.ConfigDict, str], Any],
    evaluate_checkpoint: Callable[[ml_collections.ConfigDict, str], Any],
    workdir_help: str = "Directory for checkpoints, metrics and report.json.",
) -> Callable[[], None]:
  """Defines the --config / --workdir / --mode flags and returns the `main` of a package.

  `validate(config, num_devices=, num_processes=)` runs before anything is compiled; every
  UserError (a bad config key, a missing file, ...) becomes one line and exit code 2.
  """
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Config file, optionally `file.py:key=value,...`."
  )
  workdir_flag = flags.DEFINE_string("workdir", None, workdir_help)
  mode_flag = flags.DEFINE_enum(
      "mode",
      "train",
      ["train", "eval"],
      "train: train (resuming if possible) then evaluate; eval: evaluate the latest checkpoint.",
  )
  flags.mark_flags_as_required(["config", "workdir"])

  @exit_on_user_error
  def execute(config: ml_collections.ConfigDict, workdir: str, mode: str) -> None:
    # Multi-process runs (TPU pod, SLURM, launch/local_multiprocess.sh) join JAX's
    # multi-controller runtime before any device is touched; single runs do nothing here.
    initialize_from_env()
    if jax.process_index() != 0:
      # Reports, progress and summaries come from process 0; the others keep stderr only.
      sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
    with exit_together(workdir):
      validate(config, num_devices=jax.device_count(), num_processes=jax.process_count())
      if mode == "eval":
        require_checkpoint(workdir)  # Before seconds of data loading and model building.
      created = not os.path.exists(workdir)
      workdir = prepare_workdir(workdir)
      try:
        with workdir_lock(workdir):
          (train_and_evaluate if mode == "train" else evaluate_checkpoint)(config, workdir)
      except BaseException:
        if created and jax.process_index() == 0:
          remove_if_empty(workdir)  # An early error leaves no empty workdir behind.
        raise

  def main(argv: list[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    quiet_logging()
    execute(loaded_config(config_flag), workdir_flag.value, mode_flag.value)

  return lambda: run(main)
