"""Config helpers: big_vision-style `file.py:key=value` arguments and checks before compilation."""

from __future__ import annotations

import ast
from typing import Any, Iterable

import ml_collections

from trainkit.errors import ConfigError


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses the `key=value,...` part of `--config=file.py:key=value,...`.

  Each key must be one of `defaults`; its value is converted to the type of the
  default (bools accept true/false/1/0, a bare `key` means `key=True`).
  """
  parsed = dict(defaults)
  for item in filter(None, _split_top_level(arg or "")):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ConfigError(key, f"unknown config argument; known: {', '.join(sorted(defaults))}")
    parsed[key] = _convert(key, raw.strip() if sep else "true", defaults[key])
  return ml_collections.ConfigDict(parsed)


def _split_top_level(arg: str) -> list[str]:
  """Splits on commas outside brackets, so `blocks=(1, 2),steps=3` has two items."""
  items, depth, current = [], 0, []
  for char in arg:
    depth += char in "([{"
    depth -= char in ")]}"
    if char == "," and depth == 0:
      items.append("".join(current))
      current = []
    else:
      current.append(char)
  items.append("".join(current))
  return [item.strip() for item in items]


def _convert(key: str, raw: str, default: Any) -> Any:
  if isinstance(default, bool):
    if raw.lower() in ("1", "true", "yes"):
      return True
    if raw.lower() in ("0", "false", "no"):
      return False
    raise ConfigError(key, f"expected a boolean, got {raw!r}")
  if isinstance(default, (int, float)):
    try:
      return type(default)(raw)
    except ValueError:
      raise ConfigError(key, f"expected {type(default).__name__}, got {raw!r}") from None
  if isinstance(default, (tuple, list)):
    try:
      return type(default)(ast.literal_eval(raw))
    except (ValueError, SyntaxError):
      raise ConfigError(key, f"expected a sequence literal, got {raw!r}") from None
  return raw


def get(config: ml_collections.ConfigDict, key: str) -> Any:
  """Reads a dotted key, raising ConfigError naming it when it is absent."""
  node = config
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(key, "missing from the config")
    node = node[part]
  return node


def require_int(config: ml_collections.ConfigDict, key: str, *, minimum: int | None = None) -> int:
  value = get(config, key)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(key, f"expected an integer, got {value!r}")
  if minimum is not None and value < minimum:
    raise ConfigError(key, f"must be >= {minimum}, got {value}")
  return value


def require_float(
    config: ml_collections.ConfigDict,
    key: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
  value = get(config, key)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(key, f"expected a number, got {value!r}")
  if minimum is not None and value < minimum:
    raise ConfigError(key, f"must be >= {minimum}, got {value}")
  if maximum is not None and value > maximum:
    raise ConfigError(key, f"must be <= {maximum}, got {value}")
  return float(value)


def require_choice(config: ml_collections.ConfigDict, key: str, choices: Iterable[Any]) -> Any:
  value = get(config, key)
  choices = tuple(choices)
  if value not in choices:
    raise ConfigError(key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
  return value
