"""The code is formatted (pyink) and its imports stay sorted and grouped (ruff's isort rules, `ruff check --select I`, settings in
ruff.toml): a module that imports one name twice or out of order fails here, naming the file."""

import subprocess
import sys

import pyink  # noqa: F401  The checks run both in a subprocess; a missing one should fail here.
import pytest
import ruff  # noqa: F401

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


@pytest.mark.slow
def test_imports_are_sorted():
  result = _ruff_isort(*LINTED)
  assert result.returncode == 0, (
      "imports out of order; `ruff check --select I --fix <file>` sorts them:\n"
      + result.stdout
      + result.stderr
  )


@pytest.mark.slow
def test_an_unsorted_or_repeated_import_fails(tmp_path):
  """What the test above relies on: the check reports a module like train.py's old imports."""
  module = tmp_path / "unsorted.py"
  module.write_text(
      "from trainkit.mesh import place\nimport os\nfrom trainkit import storage\n"
      "from trainkit.mesh import replicated\n\nprint(os, place, storage, replicated)\n"
  )
  result = _ruff_isort(module)
  assert result.returncode == 1 and "I001" in result.stdout and "unsorted.py" in result.stdout


# Google's Black, as docs/contributing.md ("Formatting") runs it.
PYINK_STYLE = (
    "--pyink-indentation=2",
    "--line-length=100",
    "--pyink-use-majority-quotes",
    "--skip-magic-trailing-comma",
)


def _pyink_check(*paths) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "pyink", "--check", *PYINK_STYLE, *map(str, paths)],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.slow
def test_the_tree_is_formatted():
  result = _pyink_check(*LINTED, "docs", "setup.py")
  assert result.returncode == 0, (
      "unformatted files; docs/contributing.md, 'Formatting', formats them:\n"
      + result.stderr[-4000:]
  )


@pytest.mark.slow
def test_an_unformatted_file_fails(tmp_path):
  """What the test above relies on: four-space indentation and odd spacing are reported."""
  module = tmp_path / "unformatted.py"
  module.write_text("def f( x ):\n    return x\n")
  result = _pyink_check(module)
  assert (
      result.returncode == 1
      and "would reformat" in result.stderr
      and "unformatted.py" in result.stderr
  )
