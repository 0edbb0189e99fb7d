r"""Builds the API reference of fairmoe_jax, causal_attn_jax and trainkit from their docstrings.

  python docs/build_api.py              # -> docs/api/index.html (not committed)
  python docs/build_api.py --output=/tmp/api

Every module is documented, including those a package's `__all__` leaves out (pdoc itself
follows `__all__`, which lists the packages' entry points, not their modules). Docstrings are
read as Google style. Any warning pdoc emits (an annotation it cannot resolve, a module that
does not import, a malformed docstring section) is printed and makes the exit status 1, so a
docstring that breaks the reference fails `tests/project/test_api_docs.py`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import typing
import warnings
from collections.abc import Sequence

PACKAGES = ("fairmoe_jax", "causal_attn_jax", "trainkit")
# Command-line modules define their absl flags (--config, --workdir, ...) when imported, so two
# of them cannot be imported into one process as they are (DuplicateFlagError).
ENTRY_POINTS = ("fairmoe_jax.main", "causal_attn_jax.main")
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api")


def module_names(packages: Sequence[str]) -> list[str]:
  """Every public module of `packages` (no name part starting with '_'), packages first."""
  names = []
  for package in packages:
    names.append(package)
    path = importlib.import_module(package).__path__
    for info in pkgutil.walk_packages(path, prefix=f"{package}."):
      if not any(part.startswith("_") for part in info.name.split(".")):
        names.append(info.name)
  return names


def _import_entry_points(names: Sequence[str]) -> None:
  """Imports the command-line modules among `names`, each after the flags of the previous are
  removed, so that pdoc finds them all imported (it imports a module only once).

  The other modules are imported first, so that the flags an entry point adds are its own and
  no library's.
  """
  from absl import flags  # pylint: disable=import-outside-toplevel

  for name in names:
    if name not in ENTRY_POINTS:
      importlib.import_module(name)
  for name in names:
    if name in ENTRY_POINTS:
      before = set(flags.FLAGS)
      importlib.import_module(name)
      for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)


def _place_named_tuple_constructors(names: Sequence[str]) -> None:
  """Gives each NamedTuple's generated `__new__` its class's module.

  `collections.namedtuple` creates `__new__` in a namespace of its own, so pdoc, which resolves
  the string annotations of `from __future__ import annotations` in the module of the function,
  finds no module for it and cannot resolve `np.ndarray`.
  """
  for name in names:
    for value in vars(importlib.import_module(name)).values():
      if (
          isinstance(value, type)
          and issubclass(value, tuple)
          and typing.NamedTuple in getattr(value, "__orig_bases__", ())
          and value.__module__ == name
      ):
        value.__new__.__module__ = name


def build(output: str, packages: Sequence[str] = PACKAGES) -> list[str]:
  """Writes the HTML reference of `packages` into `output`; returns pdoc's warnings."""
  import pdoc  # pylint: disable=import-outside-toplevel
  import pdoc.render  # pylint: disable=import-outside-toplevel

  pdoc.render.configure(docformat="google", show_source=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = module_names(packages)
    _import_entry_points(names)
    _place_named_tuple_constructors(names)
    pdoc.pdoc(*names, output_directory=pdoc.Path(output))
  return [f"{w.category.__name__}: {w.message}" for w in caught]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", default=DEFAULT_OUTPUT, help="directory for the HTML files")
  parser.add_argument(
      "packages", nargs="*", default=list(PACKAGES), help="packages to document (default: all)"
  )
  args = parser.parse_args(argv)
  problems = build(args.output, args.packages)
  for problem in problems:
    print(problem, file=sys.stderr)
  print(
      f"API reference: {os.path.join(args.output, 'index.html')}"
      + (f" (pdoc warnings: {len(problems)})" if problems else "")
  )
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
