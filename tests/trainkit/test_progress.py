"""The progress bar (`trainkit.progress`)."""

import io

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
