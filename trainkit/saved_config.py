"""A config file that loads a trained run's `config.json`: what `--config` is without the flag.

`trainkit.cli` passes `--config=<this file>:<config module>:<workdir>` when `--mode=eval`,
`predict` or `export` is run with `--workdir` alone, so that the saved config goes through the
same flag machinery as a config file: `--config.KEY=VALUE` overrides apply on top of it, with
the same type checks and messages.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Mapping

import jax
import ml_collections

from trainkit import config as cfg
from trainkit import storage
from trainkit.workdir import load_saved_config, workdir_lock


def config_argument(config_module: str, workdir: str) -> str:
  """The `--config` value that loads `<workdir>/config.json` (this file, then its argument).

  Args:
    config_module: The package's config module (its `base_config()` gives the key types).
    workdir: The trained run's working directory.

  Returns:
    `<path of this file>:<config_module>:<workdir>`.
  """
  return f"{__file__}:{config_module}:{workdir}"


def get_config(arg: str) -> ml_collections.ConfigDict:
  """The config saved in a workdir; `arg` is `<config module>:<workdir>` (`config_argument`)."""
  config_module, _, workdir = arg.partition(":")
  return load_saved_config(workdir, importlib.import_module(config_module).base_config())


def restore_saved_run(
    workdir: str | os.PathLike,
    base_config: ml_collections.ConfigDict,
    validate: Callable[..., None],
    restore: Callable[[ml_collections.ConfigDict, str], Any],
    overrides: Mapping[str, Any] | None = None,
) -> tuple[str, ml_collections.ConfigDict, Any]:
  """A trained run from its workdir alone, for a package's `load_run`.

  Loads `<workdir>/config.json` (typed by `base_config`), applies `overrides`, validates it
  without the data checks (`validate(config, num_devices=, num_processes=, check_data=False)`)
  and calls `restore(config, workdir)` while holding the workdir's lock, so that it never races
  a training run's in-flight save. Returns (absolute workdir, config, what `restore` returned).
  """
  workdir = storage.resolve(workdir)
  config = load_saved_config(workdir, base_config)
  cfg.apply_overrides(config, overrides or {})
  validate(
      config, num_devices=jax.device_count(), num_processes=jax.process_count(), check_data=False
  )
  with workdir_lock(workdir):
    restored = restore(config, workdir)
  return workdir, config, restored
