"""Packaging: version, license, citation, shipped configs and type markers, and the documented Python API."""

import ast
import importlib.metadata
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest
import setuptools
import yaml
from absl import flags
from ml_collections import config_flags

import causal_attn_jax
import fairmoe_jax
import trainkit
from conftest import REPO_ROOT
from trainkit import config_files

PACKAGES = ("fairmoe_jax", "causal_attn_jax", "trainkit")
FAIRSMOE_TITLE = (
    "FairSMoE: Mitigating Multi-Attribute Fairness Problem with Sparse Mixture-of-Experts"
)
CAUSAL_TITLE = "Causal Transformers: Improving the Robustness on Spurious Correlations"


@pytest.fixture(scope="module")
def setup_args() -> dict:
  """The keyword arguments setup.py passes to `setuptools.setup` (nothing is built or written)."""
  captured = {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(REPO_ROOT / "setup.py"), run_name="__main__")
  return captured


@pytest.fixture(scope="module")
def built_tree(tmp_path_factory) -> pathlib.Path:
  """The files a wheel would hold: `setup.py build_py` into a temporary directory (< 1 s)."""
  build_lib = tmp_path_factory.mktemp("build") / "lib"
  subprocess.run(
      [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build_lib)],
      cwd=REPO_ROOT,
      check=True,
      capture_output=True,
  )
  return build_lib


def test_one_version_everywhere(setup_args):
  assert re.fullmatch(r"\d+\.\d+\.\d+", setup_args["version"])
  for package in (fairmoe_jax, causal_attn_jax, trainkit):
    assert package.__version__ == setup_args["version"]
  citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text())
  assert str(citation["version"]) == setup_args["version"]


def test_license_is_the_full_apache_2_text(setup_args):
  text = (REPO_ROOT / "LICENSE").read_text()
  for part in (
      "Apache License\n                           Version 2.0, January 2004",
      "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
      "9. Accepting Warranty or Additional Liability.",
      "END OF TERMS AND CONDITIONS",
      "http://www.apache.org/licenses/LICENSE-2.0",
  ):
    assert part in text
  assert len(text.splitlines()) > 200
  assert setup_args["license"] == "Apache-2.0"
  assert "License :: OSI Approved :: Apache Software License" in setup_args["classifiers"]


def test_citation_cites_the_software_and_both_papers():
  citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text())
  assert citation["cff-version"] == "1.2.0"
  assert citation["type"] == "software" and citation["license"] == "Apache-2.0"
  assert citation["authors"] and citation["message"]
  references = {r["title"]: r for r in citation["references"]}
  assert set(references) == {FAIRSMOE_TITLE, CAUSAL_TITLE}
  fairsmoe_authors = [
      f"{a['given-names']} {a['family-names']}" for a in references[FAIRSMOE_TITLE]["authors"]
  ]
  assert len(fairsmoe_authors) == 13
  assert fairsmoe_authors[0] == "Changdi Yang" and fairsmoe_authors[-1] == "Yanzhi Wang"
  # The Causal Transformers paper is an anonymous ACL submission: no author names to give.
  assert references[CAUSAL_TITLE]["authors"] == [{"name": "Anonymous"}]
  for reference in references.values():
    assert reference["type"] and reference["notes"]


def test_readme_names_both_papers():
  intro = (REPO_ROOT / "README.md").read_text().split("\n## ", 1)[0]
  assert FAIRSMOE_TITLE in " ".join(intro.split())
  assert CAUSAL_TITLE in " ".join(intro.split())
  assert "Yang et al." in intro and "anonymous ACL submission" in intro


def _text_files() -> list[pathlib.Path]:
  files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
  for top in (*PACKAGES, "configs", "benchmarks", "scripts", "tests"):
    files += sorted((REPO_ROOT / top).rglob("*.py"))
  return [f for f in files if f.name != "test_packaging.py"]


def test_papers_are_named_not_numbered():
  numbered = re.compile(r"\b(paper|file)s? 00[01]\b|\b00[01]_[0-9a-f]{6,}", re.IGNORECASE)
  found = [
      f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
      for path in _text_files()
      for n, line in enumerate(path.read_text().splitlines(), 1)
      if numbered.search(line)
  ]
  assert not found, "name the paper instead:\n" + "\n".join(found)


def test_python_sources_do_not_speak_of_issues():
  history = re.compile(r"\b(issue \d+|this issue|the issue\b|the issue's)", re.IGNORECASE)
  found = [
      f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
      for path in _text_files()
      if path.suffix == ".py"
      for n, line in enumerate(path.read_text().splitlines(), 1)
      if history.search(line)
  ]
  assert not found, "say what the code does instead:\n" + "\n".join(found)


def test_setup_ships_configs_and_type_markers(setup_args):
  packages = set(setup_args["packages"])
  assert set(PACKAGES) <= packages
  assert {"fairmoe_jax.moe", "causal_attn_jax.layers", "trainkit.bundled_configs"} <= packages
  assert setup_args["package_dir"]["trainkit.bundled_configs"] == "configs"
  for package in PACKAGES:
    assert "py.typed" in setup_args["package_data"][package]
    assert (REPO_ROOT / package / "py.typed").is_file()


@pytest.mark.slow
def test_built_tree_holds_every_config_and_type_marker(built_tree):
  for package in PACKAGES:
    assert (built_tree / package / "py.typed").is_file()
  assert (built_tree / "fairmoe_jax" / "quickstart_vanilla_smoe.json").is_file()  # report.py's
  bundled = built_tree / "trainkit" / config_files.BUNDLED_CONFIGS
  shipped = sorted(p.relative_to(bundled) for p in bundled.rglob("*.py"))
  configs = REPO_ROOT / "configs"
  in_repo = sorted(p.relative_to(configs) for p in configs.rglob("*.py"))
  assert shipped == in_repo
  assert pathlib.Path("sweeps/batch_experts.py") in shipped


@pytest.mark.slow
def test_installed_layout_resolves_configs_from_any_directory(built_tree, tmp_path):
  """With only the built tree on the path (as after `pip install`), configs/... still resolves."""
  script = (
      "from trainkit.config_files import resolve_config_args, resolve_config_path\n"
      "print(resolve_config_path('configs/quickstart.py:steps=5'))\n"
      "print(resolve_config_args(['prog', '--sweep', 'configs/sweeps/batch_experts.py'])[2])\n"
  )
  result = subprocess.run(
      [sys.executable, "-c", script],
      cwd=tmp_path,
      env={**os.environ, "PYTHONPATH": str(built_tree)},
      check=True,
      capture_output=True,
      text=True,
  )
  config, sweep = result.stdout.splitlines()
  bundled = built_tree / "trainkit" / config_files.BUNDLED_CONFIGS
  assert config == f"{bundled / 'quickstart.py'}:steps=5"
  assert sweep == str(bundled / "sweeps" / "batch_experts.py")


def test_checkout_resolves_configs_from_another_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  quickstart = REPO_ROOT / "configs" / "quickstart.py"
  assert config_files.resolve_config_path("configs/quickstart.py") == str(quickstart)
  with_arguments = config_files.resolve_config_path("./configs/quickstart.py:steps=5")
  assert with_arguments == f"{quickstart}:steps=5"
  # Not shipped configs: returned as typed, so the error that follows names the user's path.
  for path in ("configs/no_such.py", "other/quickstart.py", "quickstart.py", "configs", ""):
    assert config_files.resolve_config_path(path) == path
  # A file that exists as given wins over the shipped one.
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "quickstart.py").write_text("def get_config(arg=None): ...\n")
  assert config_files.resolve_config_path("configs/quickstart.py") == "configs/quickstart.py"
  assert config_files.resolve_config_path(str(quickstart)) == str(quickstart)


def test_resolve_config_args_rewrites_only_config_files(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  shipped = REPO_ROOT / "configs"
  argv = [
      "configs/quickstart.py",  # argv[0] is the program, never a config.
      "--config=configs/quickstart.py:steps=5",
      "--config.moe.top_k=1",
      "--sweep",
      "configs/sweeps/scaling_cpu8.py",
      "--workdir=configs/quickstart.py",
      "--",
      "--config=configs/quickstart.py",
  ]
  assert config_files.resolve_config_args(argv) == [
      "configs/quickstart.py",
      f"--config={shipped / 'quickstart.py'}:steps=5",
      "--config.moe.top_k=1",
      "--sweep",
      str(shipped / "sweeps" / "scaling_cpu8.py"),
      "--workdir=configs/quickstart.py",
      "--",
      "--config=configs/quickstart.py",
  ]


def test_resolved_flags_load_the_config_from_another_directory(tmp_path, monkeypatch):
  """What the command line does with the rewritten argv: ml_collections loads the shipped file."""
  monkeypatch.chdir(tmp_path)
  argv = ["main", "--config=configs/quickstart.py:steps=7,experts=8", "--config.batch_size=16"]
  flag_values = flags.FlagValues()
  # Overrides are read from `sys_argv` (sys.argv by default), which the rewrite leaves as it is.
  config_flags.DEFINE_config_file(
      "config", None, "config file", flag_values=flag_values, sys_argv=argv
  )
  flag_values(config_files.resolve_config_args(argv))
  config = flag_values.config
  assert (config.num_train_steps, config.moe.num_experts, config.batch_size) == (7, 8, 16)


def _python_api_blocks() -> list[str]:
  api = (REPO_ROOT / "docs" / "api.md").read_text()
  section = api.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_python_api_has_the_three_snippets():
  blocks = _python_api_blocks()
  assert len(blocks) == 3
  assert "from fairmoe_jax.moe import SparseMoE" in blocks[0] and "nnx.Rngs" in blocks[0]
  assert "aux" in blocks[0]
  assert "from fairmoe_jax.metrics import" in blocks[1]
  assert "constraint_violations" in blocks[2] and "MultiHeadAttention" in blocks[2]


@pytest.mark.parametrize("index", range(3))
def test_readme_python_api_snippet_runs(index, capsys):
  namespace = {"__name__": f"readme_python_api_{index}"}
  code = compile(_python_api_blocks()[index], f"docs/api.md, Python API block {index + 1}", "exec")
  exec(code, namespace)  # pylint: disable=exec-used
  assert capsys.readouterr().out.strip()  # Every snippet prints what it shows.


_FIRST_PARTY = {"fairmoe_jax", "causal_attn_jax", "trainkit", "paper_runner"}


def _third_party_imports(paths) -> dict[str, set[str]]:
  """Top-level third-party modules imported anywhere in `paths` (function-local imports too)."""
  found: dict[str, set[str]] = {}
  for path in paths:
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        # Modules of tests/ (its helpers, and test modules beside the importing one) and of
        # benchmarks/ (the benchmark tests import those).
        local = any(
            (folder / f"{top}.py").exists()
            for folder in (REPO_ROOT / "tests", pathlib.Path(path).parent, REPO_ROOT / "benchmarks")
        )
        if top not in sys.stdlib_module_names and top not in _FIRST_PARTY and not local:
          found.setdefault(top, set()).add(str(path))
  return found


def _requirement_names(requirements) -> set[str]:
  return {
      re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower() for r in requirements
  }


def _undeclared(imports: dict[str, set[str]], declared: set[str]) -> dict[str, set[str]]:
  distributions = importlib.metadata.packages_distributions()
  missing = {}
  for module, files in imports.items():
    names = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(module, [module])}
    if not names & declared:
      missing[module] = files
  return missing


# The extras each package's code may import beyond install_requires (the runner drives both papers).
_PACKAGE_EXTRAS = {
    "trainkit": (),
    "fairmoe_jax": ("fairsmoe",),
    "causal_attn_jax": ("causal",),
    "paper_runner": ("fairsmoe", "causal"),
}


def test_declared_dependencies_cover_every_import(setup_args):
  install = _requirement_names(setup_args["install_requires"])
  assert set(_PACKAGE_EXTRAS) == _FIRST_PARTY
  for package, extras in _PACKAGE_EXTRAS.items():
    declared = install.union(
        *(_requirement_names(setup_args["extras_require"][extra]) for extra in extras)
    )
    code = (REPO_ROOT / package).rglob("*.py")
    assert _undeclared(_third_party_imports(code), declared) == {}, package
  # One paper's extra is not the other's: FairSMoE's code imports no tokenizer or BLEU.
  fairsmoe_only = install | _requirement_names(setup_args["extras_require"]["fairsmoe"])
  fairsmoe_imports = _third_party_imports((REPO_ROOT / "fairmoe_jax").rglob("*.py"))
  assert not {"sentencepiece", "sacrebleu", "sacremoses"} & set(fairsmoe_imports)
  assert _undeclared({"sacrebleu": {"x.py"}}, fairsmoe_only) == {"sacrebleu": {"x.py"}}
  # Tests and the Python snippets of the README and docs/ may also use the test extra.
  test = install | _requirement_names(setup_args["extras_require"]["test"])
  assert _undeclared(_third_party_imports((REPO_ROOT / "tests").rglob("*.py")), test) == {}
  documents = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
  blocks = [
      (document.name, block)
      for document in documents
      for block in re.findall(r"```python\n(.*?)```", document.read_text(), re.S)
  ]
  assert any(name == "api.md" for name, _ in blocks)
  found = {}
  for i, (name, block) in enumerate(blocks):
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
        for name in [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]:
          top = name.split(".")[0]
          # A snippet may import the repository's scripts (docs/dataset.md: scripts/*.py).
          local = (REPO_ROOT / "scripts" / f"{top}.py").exists()
          if top not in sys.stdlib_module_names and top not in _FIRST_PARTY and not local:
            found.setdefault(top, set()).add(f"{name} python block {i}")
  # The recipe for loading an export into timm imports what the timm extra declares.
  timm = _requirement_names(setup_args["extras_require"]["timm"])
  assert _undeclared(found, test | timm) == {}
  assert set(_undeclared(found, test)) <= {"timm", "torch"}
  # A deliberate gap is caught: an import of a module nothing declares.
  assert _undeclared({"pandas": {"x.py"}}, install) == {"pandas": {"x.py"}}


def test_constraints_pin_every_declared_dependency(setup_args):
  pinned = {}
  for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, _, version = line.partition("==")
      pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
  declared = _requirement_names(setup_args["install_requires"]) | _requirement_names(
      setup_args["extras_require"]["test"]
  )
  # The test extra holds every paper's extra, so CI's `.[test]` installs them all.
  for extra in ("fairsmoe", "causal"):
    assert _requirement_names(setup_args["extras_require"][extra]) <= declared, extra
  assert declared - set(pinned) == set()
  assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in pinned.values()), pinned


# What each extra installs, and what must not be imported on the quickstart's path.
_EXTRA_ONLY = ("tensorflow_datasets", "safetensors", "sentencepiece", "sacrebleu", "sacremoses")


@pytest.mark.slow
def test_the_quickstart_imports_nothing_an_extra_installs():
  # A base install (`pip install -e .`) serves the quickstart: its modules, imported in a process
  # of their own, load none of the extras' packages.
  code = (
      "import sys\n"
      "import fairmoe_jax.main, fairmoe_jax.train, fairmoe_jax.inference, fairmoe_jax.evaluation\n"
      "import fairmoe_jax.report, fairmoe_jax.analysis.plots\n"
      f"print(sorted(m for m in {_EXTRA_ONLY!r} if m in sys.modules))\n"
  )
  result = subprocess.run(
      [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
  )
  assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
  from trainkit.errors import UserError, import_extra  # pylint: disable=import-outside-toplevel

  monkeypatch.setitem(sys.modules, "sacrebleu", None)  # Importing it now raises ImportError.
  with pytest.raises(
      UserError, match=r"BLEU needs sacrebleu, .*pip install 'fairmoe-jax\[causal\]'"
  ):
    from causal_attn_jax.metrics import bleu  # pylint: disable=import-outside-toplevel

    bleu.corpus_bleu(["a"], ["a"])
  assert import_extra("json", "causal", "x").dumps([]) == "[]"
