"""Lazy public names for a package's `__init__`: `import package` stays cheap (no JAX) until a
name that needs it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_attributes(
    package: str, names: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The module-level `__getattr__` and `__dir__` of `package` for its lazy `names` (name ->
  defining module), each cached in `namespace` (the package's `globals()`) once imported."""

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in names:
      value = getattr(importlib.import_module(names[name]), name)
      namespace[name] = value
      return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(namespace) | set(names))

  return __getattr__, __dir__
