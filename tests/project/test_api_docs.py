"""The API reference builds from the docstrings without a warning (`docs/build_api.py`, pdoc)."""

import os
import subprocess
import sys
import textwrap

import pdoc  # The build below runs it in a subprocess; a missing pdoc should fail here.
import pytest

from conftest import REPO_ROOT

BUILD = REPO_ROOT / "docs" / "build_api.py"


def _build(*args, pythonpath=None):
  env = dict(os.environ)
  if pythonpath:
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
  return subprocess.run(
      [sys.executable, str(BUILD), *map(str, args)],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.mark.slow
def test_api_reference_builds_without_a_warning(tmp_path):
  assert pdoc.__version__
  result = _build(f"--output={tmp_path}")
  assert result.returncode == 0, result.stderr[-5000:]
  assert "warning" not in result.stdout.lower(), result.stdout
  pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
  # Every module, also those the packages' __all__ (their entry points) leaves out, and the
  # command-line modules, which cannot be imported side by side as they are.
  assert {
      "index.html",
      "fairmoe_jax.html",
      "fairmoe_jax/export.html",
      "fairmoe_jax/models/convert_timm.html",
      "fairmoe_jax/main.html",
      "causal_attn_jax/report.html",
      "causal_attn_jax/main.html",
      "trainkit/loop.html",
  } <= pages
  assert len(pages) > 80
  # Google-style sections are rendered as such.
  export_page = (tmp_path / "fairmoe_jax" / "export.html").read_text()
  assert "timm_config" in export_page and 'id="arguments"' in export_page


@pytest.mark.slow
def test_a_warning_fails_the_build(tmp_path):
  """What the test above relies on: a docstring or annotation pdoc cannot use is an error."""
  package = tmp_path / "src" / "apidoc_broken"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text(textwrap.dedent('''\
          """A module whose function names a type that does not exist."""

          from __future__ import annotations


          def f(x: NoSuchType) -> None:
            """Does nothing."""
          '''))
  result = _build(f"--output={tmp_path / 'out'}", "apidoc_broken", pythonpath=tmp_path / "src")
  assert result.returncode == 1, result.stdout + result.stderr
  assert "NoSuchType" in result.stderr and "pdoc warnings: 1" in result.stdout
