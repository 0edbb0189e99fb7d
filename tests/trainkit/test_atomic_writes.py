"""Files a run rewrites in place (report.json, predictions.csv; config.json and
run_info.json likewise) are replaced whole or
not at all: a write that fails midway leaves the earlier file as it was."""

from __future__ import annotations

import json

import numpy as np
import pytest

from causal_attn_jax import report as causal_report
from fairmoe_jax.metrics import predictions
from trainkit.storage import write_atomically


class _Unprintable(float):
  """A value that fails when written, after the rows before it were."""

  def __format__(self, spec):
    raise RuntimeError("cannot format")


def test_predictions_csv_is_kept_when_a_rewrite_fails(tmp_path):
  path = str(tmp_path / "predictions.csv")
  predictions.write_csv(path, {"index": np.arange(3), "p": np.array([0.1, 0.2, 0.3])})
  before = open(path).read()
  values = np.array([0.5, 0.6, _Unprintable(0.7)], dtype=object)
  with pytest.raises(RuntimeError):
    predictions.write_csv(path, {"index": np.arange(3), "p": values})
  assert open(path).read() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.csv"]  # No temporary left.


def test_causal_report_is_kept_when_a_rewrite_fails(tmp_path):
  path = tmp_path / "report.json"
  path.write_text(json.dumps({"accuracy": 0.5}))
  # Fails after part of the JSON would have been written.
  with pytest.raises(TypeError):
    causal_report.write_report({"accuracy": 0.7, "bad": object()}, str(tmp_path))
  assert json.loads(path.read_text()) == {"accuracy": 0.5}


def test_write_atomically_itself_keeps_the_old_file_when_the_write_fails(tmp_path):
  # The failure happens inside the helper, while the bytes are written (the tests above fail
  # before it is called): a helper that wrote in place would leave a truncated file.
  path = tmp_path / "notes.txt"
  write_atomically(str(path), "old text\n")
  unencodable = "new text " * 1000 + "\ud800"  # A lone surrogate: not valid UTF-8.
  with pytest.raises(UnicodeEncodeError):
    write_atomically(str(path), unencodable)
  assert path.read_text() == "old text\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # No temporary left.
