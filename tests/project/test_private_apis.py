"""No private internals of other libraries: the lines most likely to break on their next release.

Every non-test Python file is scanned for imports of a third-party library's private modules or
names (a dotted component starting with `_`, or tensorboardX's writer internals) and for
replacements of process-wide hooks. Where jax's private API is the only way today, the file and
name are allowed below, and a test fails loudly, naming them, once they disappear.
"""

import ast
import importlib
import pathlib
import sys

import pytest

from conftest import REPO_ROOT

ROOT = REPO_ROOT
SCANNED = (
    "trainkit", "fairmoe_jax", "causal_attn_jax", "paper_runner", "benchmarks", "scripts",
    "configs", "results", "docs",
)  # fmt: skip
OURS = {path.stem for path in ROOT.iterdir()}
# tensorboardX's public API is its top-level package (SummaryWriter, FileWriter, RecordWriter).
TENSORBOARDX_INTERNALS = (
    "tensorboardX.event_file_writer", "tensorboardX.record_writer", "tensorboardX.proto",
    "tensorboardX.summary", "tensorboardX.crc32c",
)  # fmt: skip
HOOKS = {("sys", "unraisablehook"), ("sys", "excepthook"), ("threading", "excepthook")}
# Changes to another library's logger (`logging.getLogger("lib")`), which reach every user of it.
LOGGER_CHANGES = {"setLevel", "addFilter", "disabled"}
# file -> the libraries' loggers it may change.
ALLOWED_LOGGERS = {
    # A filter that keeps one of gcsfs's per-bucket warnings (storage.py's owner to replace).
    "trainkit/storage.py": {"gcsfs"}
}

# file -> the private names it may import: each the only way today, each checked below.
ALLOWED = {
    # shard_map's varying-axes check has no public switch (`vma_check_off`).
    "fairmoe_jax/moe/dispatch/spmd.py": {"jax._src.config"},
    # The coordination service's barrier (`jax.distributed` exposes no client).
    "trainkit/distributed.py": {"jax._src.distributed"},
}
# (module, attribute) each allowed import is used for.
ALLOWED_ATTRIBUTES = [
    ("jax._src.config", "_check_vma"),
    ("jax._src.distributed", "global_state.client"),
]


def _is_private(name: str) -> bool:
  parts = name.split(".")
  if parts[0] in OURS or parts[0] in sys.stdlib_module_names or not parts[0]:
    return False
  dunder = lambda part: part.startswith("__") and part.endswith("__")
  return any(part.startswith("_") and not dunder(part) for part in parts) or any(
      name == internal or name.startswith(internal + ".") for internal in TENSORBOARDX_INTERNALS
  )


def _imported_names(node: ast.AST) -> list[str]:
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom) and not node.level and node.module:
    return [f"{node.module}.{alias.name}" for alias in node.names]
  if (  # importlib.import_module("...") and __import__("...") with a literal name.
      isinstance(node, ast.Call)
      and node.args
      and isinstance(node.args[0], ast.Constant)
      and isinstance(node.args[0].value, str)
      and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
  ):
    return [node.args[0].value]
  return []


def _foreign_logger(node: ast.AST, names: dict[str, str]) -> str | None:
  """The library whose logger `node` is: `logging.getLogger("lib")`, or a name bound to one."""
  if isinstance(node, ast.Name):
    return names.get(node.id)
  if (
      isinstance(node, ast.Call)
      and ast.unparse(node.func) in ("logging.getLogger", "getLogger")
      and node.args
      and isinstance(node.args[0], ast.Constant)
      and isinstance(node.args[0].value, str)
      and node.args[0].value.split(".")[0] not in OURS
  ):
    return node.args[0].value
  return None


def violations(path: pathlib.Path, relative: str) -> list[str]:
  """'file:line: what' for each private import, each replaced process-wide hook and each change
  to another library's logger in `path`."""
  found = []
  tree = ast.parse(path.read_text(), str(path))
  names = {  # `log = logging.getLogger("lib")`
      node.targets[0].id: library
      for node in ast.walk(tree)
      if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
      if (library := _foreign_logger(node.value, {}))
  }
  for node in ast.walk(tree):
    changed = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      changed = node.func  # log.setLevel(...), log.addFilter(...)
    elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
      changed = node.targets[0]  # log.disabled = True
    if changed is not None and changed.attr in LOGGER_CHANGES:
      library = _foreign_logger(changed.value, names)
      if library and library not in ALLOWED_LOGGERS.get(relative, ()):
        found.append(f"{relative}:{node.lineno}: changes the {library!r} logger ({changed.attr})")
    for name in _imported_names(node):
      if _is_private(name) and name not in ALLOWED.get(relative, ()):
        found.append(f"{relative}:{node.lineno}: imports {name}, a private module or name")
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    for target in targets:
      if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        if (target.value.id, target.attr) in HOOKS:
          found.append(f"{relative}:{node.lineno}: replaces {target.value.id}.{target.attr}")
  return sorted(found, key=lambda line: int(line.split(":")[1]))


def _scanned_files() -> list[pathlib.Path]:
  return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_no_file_imports_a_private_module_or_replaces_a_process_wide_hook():
  files = _scanned_files()
  assert len(files) > 100 and ROOT / "trainkit" / "checkpoint.py" in files
  found = [v for p in files for v in violations(p, p.relative_to(ROOT).as_posix())]
  assert not found, "private internals (see tests/project/test_private_apis.py):\n" + "\n".join(
      found
  )


def test_the_scanner_reports_a_planted_private_import_and_hook_with_file_and_line(tmp_path):
  planted = tmp_path / "planted.py"
  planted.write_text(
      "from __future__ import annotations\n"
      "import sys\n"
      "import orbax.checkpoint as ocp\n"
      "from orbax.checkpoint._src.futures import future\n"
      "from tensorboardX.event_file_writer import EventsWriter\n"
      "from jax import _src\n"
      "sys.unraisablehook = print\n"
      "import importlib\n"
      "importlib.import_module('tensorstore._tensorstore')\n"
      "from tensorboardX import SummaryWriter\n"
      "import logging\n"
      "logging.getLogger('absl').setLevel(logging.ERROR)\n"
      "orbax_log = logging.getLogger('orbax.checkpoint')\n"
      "orbax_log.addFilter(lambda record: False)\n"
      "orbax_log.disabled = True\n"
      "logging.getLogger(__name__).setLevel(logging.INFO)\n"  # Its own logger: allowed.
      "logging.getLogger('trainkit.loop').setLevel(logging.INFO)\n"
  )
  assert violations(planted, "planted.py") == [
      "planted.py:4: imports orbax.checkpoint._src.futures.future, a private module or name",
      "planted.py:5: imports tensorboardX.event_file_writer.EventsWriter, a private module or name",
      "planted.py:6: imports jax._src, a private module or name",
      "planted.py:7: replaces sys.unraisablehook",
      "planted.py:9: imports tensorstore._tensorstore, a private module or name",
      "planted.py:12: changes the 'absl' logger (setLevel)",
      "planted.py:14: changes the 'orbax.checkpoint' logger (addFilter)",
      "planted.py:15: changes the 'orbax.checkpoint' logger (disabled)",
  ]
  # An allowed import is allowed in its own file only.
  planted.write_text("from jax._src import distributed\n")
  assert violations(planted, "trainkit/distributed.py") == []
  assert violations(planted, "trainkit/other.py") == [
      "trainkit/other.py:1: imports jax._src.distributed, a private module or name"
  ]


def test_every_allowed_file_still_uses_its_private_names():
  """An allowance that is no longer used goes: the allow-list names exactly what is imported."""
  for relative, allowed in ALLOWED.items():
    source = ROOT / relative
    if not source.exists():
      pytest.fail(f"{relative} is allowed private imports but no longer exists: update ALLOWED")
    imported = {
        name
        for node in ast.walk(ast.parse(source.read_text()))
        for name in _imported_names(node)
        if _is_private(name)
    }
    assert imported == allowed, f"{relative}: update ALLOWED in tests/project/test_private_apis.py"
  for relative, libraries in ALLOWED_LOGGERS.items():
    found = " ".join(violations(ROOT / relative, "a file without allowances"))
    assert all(
        f"the {name!r} logger" in found for name in libraries
    ), f"update ALLOWED_LOGGERS: {relative}"


@pytest.mark.parametrize("module, attribute", ALLOWED_ATTRIBUTES)
def test_each_allowed_private_name_still_exists(module, attribute):
  """jax's private API that we rely on (ALLOWED): when a release removes it, this fails first,
  naming it, rather than a run failing later in a way that hides why."""
  import jax

  try:
    found, value = True, importlib.import_module(module)
    for name in attribute.split("."):  # A value may be None (no client before initialize()).
      found, value = found and hasattr(value, name), getattr(value, name, None)
  except ImportError as e:
    pytest.fail(f"jax {jax.__version__} no longer has {module} ({e}): see ALLOWED", pytrace=False)
  if not found:
    pytest.fail(
        f"jax {jax.__version__} no longer has {module}.{attribute}, a private name trainkit or "
        "fairmoe_jax relies on (see ALLOWED in tests/project/test_private_apis.py): find its public "
        "replacement",
        pytrace=False,
    )
