"""User-facing errors: one clear message and a non-zero exit, never a traceback from inside JAX."""

from __future__ import annotations

import errno
import functools
import importlib
import os
import sys
from typing import Any, Callable, Iterator, NoReturn, TypeVar

T = TypeVar("T")

# Exit status for a user's mistake (bad config, unwritable workdir, no usable checkpoint).
USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
  """A problem with the user's input; the message names the key, file, row or field."""


class OutOfSpace(UserError):
  """A write failed because the disk (or quota) is full; the entry point exits at once."""


class Unwritable(UserError):
  """A write failed because its folder is not writable (any more); exits at once as OutOfSpace."""


_OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How TensorStore (Orbax's writer) words these errors: the errno is only in the text.
_OUT_OF_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")


def causes(error: BaseException | None) -> Iterator[BaseException]:
  """`error` and the errors it was raised from."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def is_out_of_space(error: BaseException) -> bool:
  """Whether `error`, or an error it was raised from, says the disk or quota is full."""
  return any(
      (isinstance(e, OSError) and e.errno in _OUT_OF_SPACE_ERRNOS)
      or any(text in str(e) for text in _OUT_OF_SPACE_TEXT)
      for e in causes(error)
  )


_UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
# How TensorStore words them (the errno is only in the text).
_UNWRITABLE_TEXT = ("Permission denied", "Read-only file system", "Operation not permitted")


def unwritable_reason(error: BaseException) -> str | None:
  """`Permission denied: 'PATH'` (or the like) when `error` or its cause says so; else None."""
  for e in causes(error):
    if isinstance(e, OSError) and e.errno in _UNWRITABLE_ERRNOS:
      where = f": '{e.filename}'" if e.filename else ""
      return f"{e.strerror or os.strerror(e.errno)}{where}"
    text = next((t for t in _UNWRITABLE_TEXT if t in str(e)), None)
    if text:
      return text
  return None


# How XLA (RESOURCE_EXHAUSTED, on every backend) and the host word an allocation that failed.
_OUT_OF_MEMORY_TEXT = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error`, or an error it was raised from, is a failed memory allocation."""
  return any(
      isinstance(e, MemoryError) or any(t in str(e) for t in _OUT_OF_MEMORY_TEXT)
      for e in causes(error)
  )


def out_of_memory_message(error: BaseException) -> str:
  """One line for a run that does not fit: what failed, and the keys that change it."""
  first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
  if len(first_line) > 240:
    first_line = first_line[:240] + "..."
  return (
      f"the run does not fit in memory ({first_line}); lower batch_size or eval_batch_size, or "
      "the model's size (its model.* keys, moe.num_experts); "
      "--mode=compile --config.preflight.target=... estimates a run's memory without running it"
  )


class ConfigError(UserError):
  """A config key has an unknown name, a wrong type or an impossible value."""

  def __init__(self, key: str, message: str):
    self.key = key
    super().__init__(f"config key '{key}': {message}")


def import_extra(module: str, extra: str, needed_for: str) -> Any:
  """`module`, imported; where it is missing, a UserError naming the extra that installs it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise UserError(
        f"{needed_for} needs {module.split('.')[0]}, which the '{extra}' extra installs: "
        f"pip install 'fairmoe-jax[{extra}]' ({e})"
    ) from e


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
    except (OutOfSpace, Unwritable) as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(USER_ERROR_EXIT_CODE)  # Skip the failing background writers' shutdown noise.
    except UserError as e:
      fail(str(e))
    except Exception as e:  # pylint: disable=broad-except  # Re-raised unless recognised.
      # Not only OSError: safetensors, TensorStore and XLA word these in their own errors.
      if is_out_of_space(e):
        filename = getattr(e, "filename", None)
        where = f" writing '{filename}'" if filename else ""
        fail(f"no space left on the device{where}: free space and rerun to resume")
      if is_out_of_memory(e):
        fail(out_of_memory_message(e))
      raise

  return wrapper
