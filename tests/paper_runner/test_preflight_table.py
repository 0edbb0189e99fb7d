"""docs/scaling.md's table of the paper's configurations is rendered from its record alone."""

import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from paper_runner import preflight_table


def test_the_table_in_the_docs_is_the_record(monkeypatch):
  monkeypatch.chdir(REPO_ROOT)
  text = (REPO_ROOT / "docs" / "scaling.md").read_text()
  start = text.index("<!-- table:preflight_paper -->\n") + len("<!-- table:preflight_paper -->\n")
  assert text[start : text.index("<!-- /table:preflight_paper -->")] == preflight_table.render()
  record = preflight_table.load()
  # Every cell of the record is a cell of the table, with its command and provenance.
  names = {cell["name"] for cell in preflight_table.cells()}
  assert set(record["cells"]) <= names
  for result in record["cells"].values():
    assert result["command"].startswith("python -m ") and "--mode=compile" in result["command"]
    assert "error" in result or (result["peak"] and result["provenance"]["jax"])


@pytest.mark.slow
def test_check_fails_on_a_changed_table(tmp_path):
  text = (REPO_ROOT / "docs" / "scaling.md").read_text()
  start = text.index("<!-- table:preflight_paper -->")
  changed = tmp_path / "scaling.md"
  changed.write_text(text[: start + 40] + "| a changed row |\n" + text[start + 40 :])
  result = subprocess.run(
      [sys.executable, "-m", "paper_runner.tables", f"--check={changed}"],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
  )
  assert result.returncode == 1 and "table preflight_paper differs" in result.stdout


def test_a_compile_killed_from_outside_is_not_recorded_and_is_retried(
    monkeypatch, tmp_path, capsys
):
  """A cell whose compile is killed by a signal (the out-of-memory killer's SIGKILL) records
  nothing, so the next `--compile` tries it again; a compile that fails on its own is recorded
  with its error line."""
  record = {"cells": {}}
  monkeypatch.setattr(preflight_table, "load", lambda: record)
  monkeypatch.setattr(
      preflight_table, "save", lambda name, result: record["cells"].update({name: result})
  )
  outcomes = {"killed": -9, "refused": 2}

  def fake_run(command, **kwargs):
    code = outcomes["killed"] if "deit_s" in " ".join(command) else outcomes["refused"]
    return subprocess.CompletedProcess(command, code, "", "I0000 a log line\nerror: does not fit\n")

  monkeypatch.setattr(preflight_table.subprocess, "run", fake_run)
  preflight_table.compile_missing("fairsmoe/deit_", "")
  out = capsys.readouterr().out
  assert "fairsmoe/deit_s@h100x1" not in record["cells"]
  assert "killed by SIGKILL after" in out and "not recorded" in out
  assert record["cells"]["fairsmoe/deit_b@h100x1"]["error"] == "error: does not fit"
  # Retried: the killed cells are still missing, the failed ones are not.
  preflight_table.compile_missing("fairsmoe/deit_", "")
  assert capsys.readouterr().out.count("compiling fairsmoe/deit_s@") == 5
