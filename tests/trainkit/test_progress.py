"""The progress bar (`trainkit.progress`)."""

import io

from trainkit import progress
from trainkit.progress import ProgressBar


def test_progress_bar_reports_throughput_eta_and_scalars():
  stream = io.StringIO()  # Not a terminal: one line per update.
  bar = ProgressBar(100, initial=20, examples_per_step=32, stream=stream)
  bar.update(60, steps_per_second=2.0, scalars={"loss": 0.123456})
  bar.close()
  line = stream.getvalue().strip()
  assert line.startswith("[#########") and "60/100" in line
  assert "64.0 ex/s" in line and "ETA " in line and "loss 0.1235" in line
  assert "\r" not in stream.getvalue()


def test_the_eta_leaves_out_the_compile_before_the_first_update(monkeypatch):
  """100 s of compiling, then a step a second: the ETA is the steady rate's, not the average's."""
  clock = iter([0.0, 110.0, 120.0])  # Created; first update (10 steps); second (10 more).
  monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
  stream = io.StringIO()
  bar = ProgressBar(100, stream=stream)
  bar.update(10, steps_per_second=1.0)
  bar.update(20, steps_per_second=1.0)
  first, second = stream.getvalue().splitlines()
  assert "ETA ?" in first
  assert "ETA 1m20s" in second  # 80 steps at 1 per second (with the compile: 9m10s).
