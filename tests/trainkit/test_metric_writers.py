"""metrics.jsonl (`trainkit.metric_writers`): merged on resume, torn and corrupt lines, a full
disk while appending."""

import contextlib
import errno
import json
import os
import re
import signal

import numpy as np
import pytest

from event_files import scalar_events
from toy_training import WaitingIterator, toy_loop
from trainkit.checkpoint import Checkpointer
from trainkit.errors import OutOfSpace
from trainkit.metric_writers import MetricWriter, read_metrics


def test_a_flush_writes_every_tensorboard_scalar_logged_before_it(tmp_path):
  """What a checkpoint's flush has written survives the process: tensorboardX's SummaryWriter
  writes events from a thread of its own and its flush does not wait for it."""
  writer = MetricWriter(str(tmp_path))
  (events_file,) = (tmp_path / "tensorboard").iterdir()
  for step in range(1, 51):
    writer.write_scalars(step, {"loss": 1.0 / step, "val/accuracy": step / 100})
    writer.flush()
    # Read after each flush, before any close: every step so far, in order, and nothing else.
    events = scalar_events(events_file.read_bytes())
    assert [s for s, _ in events] == [s for s in range(1, step + 1) for _ in range(2)]
  assert events[-2:] == [
      (50, {"loss": pytest.approx(1.0 / 50)}),
      (50, {"val/accuracy": pytest.approx(0.5)}),
  ]
  writer.close()


class _FullDiskFile:
  """A file whose next write stores half its data, then fails as on a full disk."""

  def __init__(self, file):
    self._file = file

  def write(self, data):
    self._file.write(data[: len(data) // 2])
    self._file.flush()
    raise OSError(errno.ENOSPC, "No space left on device")

  def __getattr__(self, name):
    return getattr(self._file, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return self._file.__exit__(*exc)


def test_metric_writer_merges_steps_and_truncates_on_resume(tmp_path):
  writer = MetricWriter(str(tmp_path))
  writer.write_scalars(1, {"loss": np.float32(2.0)})
  writer.write_scalars(1, {"val/accuracy": 0.5})
  writer.write_scalars(2, {"loss": 1.0})
  writer.write_scalars(3, {"loss": float("nan")})
  writer.flush()
  writer.write_scalars(3, {"test/accuracy": 0.25})  # After a flush: merged into step 3's line.
  writer.close()
  assert read_metrics(str(tmp_path)) == [
      {"step": 1, "loss": 2.0, "val/accuracy": 0.5},
      {"step": 2, "loss": 1.0},
      {"step": 3, "loss": None, "test/accuracy": 0.25},
  ]
  assert any(
      name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard")
  )
  MetricWriter(str(tmp_path), tensorboard=False).truncate_after(2)
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]
  for line in open(tmp_path / "metrics.jsonl"):
    json.loads(line)


def test_a_torn_last_line_of_metrics_jsonl_is_dropped_and_a_resume_goes_on(tmp_path, caplog):
  # A kill or a full disk mid-append leaves a partial last line (`truncate -s -50`).
  from trainkit.metric_writers import MetricWriter, read_metrics

  writer = MetricWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3):
    writer.write_scalars(step, {"loss": 1.0 / step, "note": "x" * 40})
  writer.flush()
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(path.read_bytes()[:-50])
  with caplog.at_level("WARNING"):
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
  assert "torn write" in caplog.text
  MetricWriter(str(tmp_path), tensorboard=False).truncate_after(2)  # What a resume does.
  assert path.read_text().endswith("\n")
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_a_corrupt_line_inside_metrics_jsonl_names_the_file_and_line(tmp_path):
  from trainkit.errors import UserError
  from trainkit.metric_writers import read_metrics

  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
  with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not a JSON record"):
    read_metrics(str(tmp_path))


@contextlib.contextmanager
def _fails_after_seconds(seconds: int):
  """A failure, not a hang, when the block runs past `seconds` (the suite has no per-test
  timeout): SIGALRM interrupts the main thread even where it waits on a lock or a queue."""

  def fail(signum, frame):
    del signum, frame
    pytest.fail(f"still running after {seconds} s: hung", pytrace=False)

  previous = signal.signal(signal.SIGALRM, fail)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_full_disk_under_the_tensorboard_events_is_the_out_of_space_error(tmp_path, monkeypatch):
  """A full disk met while writing the TensorBoard event file is the loop's one out-of-space
  error naming the step to resume from. (tensorboardX's SummaryWriter wrote events from a thread
  of its own: there the error ended that thread, and this test never finished: a hang.)"""
  from tensorboardX import record_writer

  class FullAfterTwentySteps:
    """An event file whose writes fail, as on a full disk, once step 20 has been flushed."""

    def __init__(self, file):
      self._file, self.flushes = file, 0

    def write(self, data):
      if self.flushes >= 4:  # The flushes of steps 5, 10 (twice: its checkpoint), 15 and 20.
        raise OSError(errno.ENOSPC, "No space left on device")
      return self._file.write(data)

    def flush(self):
      self.flushes += 1
      self._file.flush()

    def __getattr__(self, name):
      return getattr(self._file, name)

  monkeypatch.setattr(
      record_writer,
      "open",
      lambda path, mode: FullAfterTwentySteps(open(path, mode)),
      raising=False,
  )
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with pytest.raises(OutOfSpace) as error, _fails_after_seconds(120):
    toy_loop(tmp_path, ckpt, WaitingIterator(set(), None), writer=MetricWriter(str(tmp_path)))
  assert re.search(r"no space left on the device.*resume from step 20", str(error.value)), error
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["10", "20"]


def test_a_full_disk_while_appending_metrics_leaves_no_partial_line_and_names_the_resume_step(
    tmp_path, monkeypatch, caplog
):
  # The metrics append of a live run meets a full disk. The line is all or nothing,
  # and the error is the out-of-space one naming the step to resume from.
  from trainkit import metric_writers

  def full_after_step_20(path, mode="r", *args, **kwargs):
    file = open(path, mode, *args, **kwargs)
    full = os.path.exists(path) and '"step": 20' in open(path).read()
    if str(path).endswith("metrics.jsonl") and mode.startswith("a") and full:
      return _FullDiskFile(file)
    return file

  monkeypatch.setattr(metric_writers, "open", full_after_step_20, raising=False)
  before = None
  ckpt = Checkpointer(str(tmp_path / "ckpt"))

  def remember(position):
    nonlocal before
    before = (tmp_path / "metrics.jsonl").read_text()

  with pytest.raises(OutOfSpace) as error:
    toy_loop(tmp_path, ckpt, WaitingIterator({26}, remember))
  assert re.search(
      r"no space left on the device writing '.*metrics.jsonl'.*resume from step 20",
      str(error.value),
  ), error.value
  monkeypatch.undo()
  assert (tmp_path / "metrics.jsonl").read_text() == before  # No partial line.
  with caplog.at_level("WARNING"):
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [5, 10, 15, 20]
  assert "torn" not in caplog.text
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["10", "20"]
