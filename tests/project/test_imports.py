"""The imports between the repository's modules: no circle, and no arrow from a layer up to a
layer above it.

The layers, bottom first: `trainkit` (training kit), the two research packages (`fairmoe_jax`,
`causal_attn_jax`), `paper_runner` (sweeps, results tables, references, comparisons, calibration
rows: the runner reads the research packages, never the other way round), then what drives them
(`configs`, the table specs of `results/`, `scripts`, `benchmarks`, `docs/build_api.py`), and
`launch` on top. A module may
import from its own layer or one below. Every import statement counts, wherever it is: at the
top, inside a function, under `if TYPE_CHECKING:`. A module named by a string
(`importlib.import_module`, a `python -m` command line) is not read. `tests/` is outside the
layers.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from conftest import REPO_ROOT

LAYERS = {
    "trainkit": 0,
    "fairmoe_jax": 1,
    "causal_attn_jax": 1,
    "paper_runner": 2,
    "configs": 3,
    "results": 3,
    "scripts": 3,
    "benchmarks": 3,
    "docs": 3,
    "launch": 4,
}
# Top-level folders outside the layers.
UNLAYERED = {"tests"}


@dataclasses.dataclass(frozen=True)
class Import:
  importer: str  # Dotted module names (a package is its __init__.py).
  imported: str
  path: pathlib.Path  # The importer's file.
  line: int


def modules(root: pathlib.Path, tops=tuple(LAYERS)) -> dict[str, pathlib.Path]:
  """Dotted name -> file, for every .py file under the folders `tops` of `root`."""
  found = {}
  for top in tops:
    for path in sorted((root / top).rglob("*.py")):
      parts = list(path.relative_to(root).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      found[".".join(parts)] = path
  return found


def _named_module(name: str, known: dict[str, pathlib.Path]) -> str | None:
  """The module `name` is or lies in (`a.b.f` -> `a.b` where f is a name in it), if ours."""
  while name and name not in known:
    name = name.rpartition(".")[0]
  return name or None


def imports(root: pathlib.Path, tops=tuple(LAYERS)) -> list[Import]:
  """Every import of one of the modules of `tops` by another, at module granularity.

  `from a.b import c` imports `a.b.c` where that is a module, else `a.b`; a relative import is
  resolved against the importer's package; a bare `import bench_utils` in a folder holding
  `bench_utils.py` (a script's own folder is on sys.path) imports that file.
  """
  known = modules(root, tops)
  found = []
  for importer, path in known.items():
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    folder = importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          parts = parts[: len(parts) - node.level + 1]
          base = ".".join(p for p in [*parts, node.module] if p)
        names = [f"{base}.{alias.name}" for alias in node.names]
        names = [name if name in known else base for name in names]
      else:
        continue
      for name in names:
        local = f"{folder}.{name}" if folder else name
        if name not in known and local in known:
          name = local
        imported = _named_module(name, known)
        if imported and imported != importer:
          found.append(Import(importer, imported, path, node.lineno))
  return found


def upward_imports(found: list[Import], root: pathlib.Path) -> list[str]:
  """'file:line: imports module (layer above)' for each import from a higher layer."""
  return [
      f"{i.path.relative_to(root)}:{i.line}: imports {i.imported} ({i.imported.split('.')[0]} is "
      f"above {i.importer.split('.')[0]})"
      for i in found
      if LAYERS[i.imported.split(".")[0]] > LAYERS[i.importer.split(".")[0]]
  ]


def cycles(found: list[Import], root: pathlib.Path) -> list[str]:
  """One circle of each group of modules that import one another (directly or in a loop), as
  'a (file:line) -> b (file:line) -> ... -> a'."""
  edges: dict[str, dict[str, Import]] = {}
  for i in found:
    edges.setdefault(i.importer, {}).setdefault(i.imported, i)
  # Tarjan's strongly connected components, iterative.
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  groups = []
  for start in sorted(edges):
    if start in index:
      continue
    work = [(start, iter(sorted(edges.get(start, {}))))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(edges.get(child, {})))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        group = set()
        while True:
          member = stack.pop()
          on_stack.discard(member)
          group.add(member)
          if member == node:
            break
        if len(group) > 1:
          groups.append(group)
  found_cycles = []
  for group in groups:
    # The shortest way back from the group's first module to itself (breadth first).
    first = min(group)
    previous = {first: None}
    queue = [first]
    closing = None
    while queue and closing is None:
      node = queue.pop(0)
      for child in sorted(edges[node]):
        if child == first:
          closing = node
          break
        if child in group and child not in previous:
          previous[child] = node
          queue.append(child)
    path = [first]
    node = closing
    while node != first:
      path.insert(1, node)
      node = previous[node]
    steps = [
        f"{a} ({edges[a][b].path.relative_to(root)}:{edges[a][b].line})"
        for a, b in zip(path, [*path[1:], first])
    ]
    found_cycles.append(" -> ".join([*steps, first]))
  return sorted(found_cycles)


@pytest.fixture(scope="module")
def repository_imports() -> list[Import]:
  return imports(REPO_ROOT)


def test_every_top_level_folder_with_python_has_a_layer():
  folders = {
      folder.name
      for folder in REPO_ROOT.iterdir()
      if folder.is_dir()
      and not folder.name.startswith((".", "__"))
      and next(folder.rglob("*.py"), None)
  }
  assert folders - UNLAYERED - set(LAYERS) == set()


def test_the_imports_are_read(repository_imports):
  # The reader sees imports of every kind: at the top, under TYPE_CHECKING, across layers, and
  # from a script's own folder.
  pairs = {(i.importer, i.imported) for i in repository_imports}
  assert ("trainkit.metric_writers", "trainkit.storage") in pairs
  assert ("causal_attn_jax.report", "causal_attn_jax.tasks") in pairs  # Under TYPE_CHECKING.
  assert ("paper_runner.calibration", "fairmoe_jax.models.backbones") in pairs  # In a function.
  assert ("benchmarks.moe_layer", "benchmarks.bench_utils") in pairs  # A script's own folder.
  assert len(repository_imports) > 500


def test_no_module_imports_from_a_layer_above(repository_imports):
  found = upward_imports(repository_imports, REPO_ROOT)
  assert not found, "imports from a higher layer:\n" + "\n".join(found)


RESEARCH_AND_KIT = ("trainkit", "fairmoe_jax", "causal_attn_jax")


def test_the_research_packages_and_the_kit_import_no_runner(repository_imports):
  # The rule by name, beside the layer numbers above: the runner (sweeps, tables, references,
  # comparisons, calibration rows) is built on the papers' packages, so moving it below them
  # again fails here even if someone renumbers LAYERS.
  found = [
      f"{i.path.relative_to(REPO_ROOT)}:{i.line}: imports {i.imported}"
      for i in repository_imports
      if i.importer.split(".")[0] in RESEARCH_AND_KIT and i.imported.split(".")[0] == "paper_runner"
  ]
  assert not found, "the research packages and trainkit import the runner:\n" + "\n".join(found)
  assert LAYERS["paper_runner"] > max(LAYERS[p] for p in RESEARCH_AND_KIT)


def test_no_import_circles(repository_imports):
  found = cycles(repository_imports, REPO_ROOT)
  assert not found, "modules that import one another:\n" + "\n".join(found)


def test_a_planted_circle_and_upward_import_are_caught(tmp_path):
  def write(name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

  write("trainkit/__init__.py", "")
  write("trainkit/a.py", "from trainkit import b\n")
  write("trainkit/b.py", "def f():\n  from . import c\n")
  write("trainkit/c.py", "import typing\nif typing.TYPE_CHECKING:\n  import trainkit.a\n")
  write("trainkit/d.py", "def f():\n  from paper_runner.x import y\n")
  write("paper_runner/__init__.py", "")
  write("paper_runner/x.py", "y = 1\nimport trainkit.d\n")
  found = imports(tmp_path, ("trainkit", "paper_runner"))
  assert upward_imports(found, tmp_path) == [
      "trainkit/d.py:2: imports paper_runner.x (paper_runner is above trainkit)"
  ]
  assert cycles(found, tmp_path) == [
      "paper_runner.x (paper_runner/x.py:2) -> trainkit.d (trainkit/d.py:2) -> paper_runner.x",
      "trainkit.a (trainkit/a.py:1) -> trainkit.b (trainkit/b.py:2) -> "
      "trainkit.c (trainkit/c.py:3) -> trainkit.a",
  ]
