"""A config file that loads a trained run's `config.json`: what `--config` is without the flag
(`trainkit.cli`), so that `--config.KEY=VALUE` overrides apply as on a config file."""

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
  """`<this file>:<config_module>:<workdir>`, the `--config` that loads the run's config.json."""
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
  """A trained run from its workdir alone: (absolute workdir, config, `restore(config, workdir)`).

  The saved config, with `overrides`, is validated without data checks; `restore` runs holding
  the workdir's lock, so it never races a training run's in-flight save.
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
