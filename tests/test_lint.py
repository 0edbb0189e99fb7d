"""Imports stay sorted and grouped (ruff's isort rules, `ruff check --select I`, settings in
ruff.toml): a module that imports one name twice or out of order fails here, naming the file."""

import subprocess
import sys

import ruff  # noqa: F401  The checks run it in a subprocess; a missing ruff should fail here.

from conftest import REPO_ROOT

# Every folder of Python code in the repository.
LINTED = (
    "fairmoe_jax",
    "causal_attn_jax",
    "trainkit",
    "tests",
    "paper_runner",
    "results",
    "benchmarks",
    "scripts",
    "configs",
    "launch",
)


def _ruff_isort(*paths) -> subprocess.CompletedProcess:
  return subprocess.run(
      [
          sys.executable,
          "-m",
          "ruff",
          "check",
          "--select=I",
          "--no-cache",
          "--output-format=concise",
          f"--config={REPO_ROOT / 'ruff.toml'}",
          *map(str, paths),
      ],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )


def test_imports_are_sorted():
  result = _ruff_isort(*LINTED)
  assert result.returncode == 0, (
      "imports out of order; `ruff check --select I --fix <file>` sorts them:\n"
      + result.stdout
      + result.stderr
  )


def test_an_unsorted_or_repeated_import_fails(tmp_path):
  """What the test above relies on: the check reports a module like train.py's old imports."""
  module = tmp_path / "unsorted.py"
  module.write_text(
      "from trainkit.mesh import place\nimport os\nfrom trainkit import storage\n"
      "from trainkit.mesh import replicated\n\nprint(os, place, storage, replicated)\n"
  )
  result = _ruff_isort(module)
  assert result.returncode == 1 and "I001" in result.stdout and "unsorted.py" in result.stdout
