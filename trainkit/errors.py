"""User-facing errors: one clear message and a non-zero exit, never a traceback from inside JAX."""

from __future__ import annotations

import functools
import sys
from typing import Callable, NoReturn, TypeVar

T = TypeVar("T")

# Exit status for a user's mistake (bad config, unwritable workdir, no usable checkpoint).
USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
  """A problem with the user's input: config key, file, workdir or checkpoint.

  The message must name the offending key, file, row or field; `main` prints it
  and exits with USER_ERROR_EXIT_CODE.
  """


class ConfigError(UserError):
  """A config key has an unknown name, a wrong type or an impossible value."""

  def __init__(self, key: str, message: str):
    self.key = key
    super().__init__(f"config key '{key}': {message}")


def fail(message: str) -> NoReturn:
  """Prints `error: message` to stderr and exits with USER_ERROR_EXIT_CODE."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(USER_ERROR_EXIT_CODE)


def exit_on_user_error(fn: Callable[..., T]) -> Callable[..., T]:
  """Decorates an entry point so a UserError prints one line and exits non-zero."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except UserError as e:
      fail(str(e))

  return wrapper
