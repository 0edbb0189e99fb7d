"""Finds the config files named on the command line: a `configs/...` path that does not exist
as given is looked up in `trainkit/bundled_configs/` (a wheel's copy), else the checkout's."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Sequence

CONFIGS_DIR = "configs"
BUNDLED_CONFIGS = "bundled_configs"
# Flags whose value is a config file, optionally followed by `:arguments`.
CONFIG_FLAGS = ("config", "sweep")


def config_roots() -> list[pathlib.Path]:
  """The directories holding the shipped configs, in the order they are searched."""
  package = pathlib.Path(__file__).resolve().parent
  roots = [package / BUNDLED_CONFIGS]
  checkout = package.parent
  # Only a checkout: in site-packages, a `configs` beside trainkit belongs to someone else.
  if (checkout / "setup.py").is_file():
    roots.append(checkout / CONFIGS_DIR)
  return [root for root in roots if root.is_dir()]


def resolve_config_path(path: str) -> str:
  """`path` (`configs/x.py:ARGS`) if it exists or is not under `configs/`, else the shipped copy
  with the same `:ARGS`, else `path` unchanged (so the error names what the user typed)."""
  file, colon, arguments = path.partition(":")  # The split ml_collections makes.
  if not file or pathlib.Path(file).expanduser().exists():
    return path
  parts = pathlib.PurePath(file).parts  # `./configs/x.py` is ("configs", "x.py").
  if len(parts) < 2 or parts[0] != CONFIGS_DIR:
    return path
  for root in config_roots():
    candidate = root.joinpath(*parts[1:])
    if candidate.is_file():
      return str(candidate) + colon + arguments
  return path


def resolve_config_args(argv: Sequence[str], flag_names: Sequence[str] = CONFIG_FLAGS) -> list[str]:
  """`argv` with every `--config`/`--sweep` value (`=PATH` or ` PATH`) through
  `resolve_config_path`; `--config.KEY=V` overrides are left alone."""
  names = {f"{dashes}{name}" for name in flag_names for dashes in ("-", "--")}
  out, rest = list(argv[:1]), iter(argv[1:])
  for arg in rest:
    flag, eq, value = arg.partition("=")
    if eq and flag in names:
      out.append(f"{flag}={resolve_config_path(value)}")
    elif arg in names:  # Its value is the next argument, if any.
      out.extend([arg, *map(resolve_config_path, itertools.islice(rest, 1))])
    else:
      out.append(arg)
      if arg == "--":  # Everything after `--` is a positional argument.
        out.extend(rest)
  return out
