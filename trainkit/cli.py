"""Command-line plumbing shared by the packages' `main` modules."""

from __future__ import annotations

import logging
from typing import Callable

import ml_collections
from absl import app, flags
from absl import logging as absl_logging

from trainkit.errors import UserError, fail


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
