"""The preflight against what lent GPUs measured: the step band holds the measured steps, the
`h200x1` target's memory is the device's, and the input pipeline's rate per core is the
measured one. Pure functions on the records of benchmarks/results/; nothing compiles."""

from __future__ import annotations

import glob
import json
import math
import types

import ml_collections
import pytest

from conftest import REPO_ROOT
from fairmoe_jax.preflight import IMAGES_PER_S_PER_CORE
from paper_runner import calibration
from trainkit.preflight import targets
from trainkit.preflight.calibration import CALIBRATION
from trainkit.preflight.compile import (
    EVAL_SHARE_OF_TRAIN_STEP,
    HOST_COPY_BYTES_PER_S,
    Program,
    band_seconds,
    input_cores,
    outside_steps,
)

LEASES = sorted(glob.glob(str(REPO_ROOT / "benchmarks/results/h200_*/device.json")))


def _json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _measured() -> list[dict]:
  return [_json(path)["parts"]["train_step"]["measured"] for path in LEASES]


def test_the_measured_h200_steps_fall_inside_the_band_of_every_recorded_h200x1_prediction():
  predictions = glob.glob(str(REPO_ROOT / "benchmarks/results/h200_*/preflight_h200x1*.json"))
  versions = {_json(p)["provenance"]["jax"] for p in predictions}
  assert len(predictions) >= 3 and len(versions) == 2  # Both tested jax versions.
  steps = [m["step_seconds"] for m in _measured()]
  assert len(steps) == 2
  for path in predictions:
    record = _json(path)
    train = record["train_step"]
    fastest, slowest = band_seconds(
        train["roofline"]["bound_s"], train.get("collective_seconds"), list(CALIBRATION["gpu"].band)
    )
    for step in steps:
      assert fastest <= step <= slowest, (path, fastest, step, slowest)
    # The band before this one (the public rows' range alone) missed them.
    old = band_seconds(train["roofline"]["bound_s"], None, [0.37, 0.40])
    assert all(step < old[0] for step in steps)


def test_the_band_is_every_calibration_point_widened_by_the_jax_spread():
  record = _json(REPO_ROOT / calibration.RECORD)
  derived = calibration.band(record)
  assert derived["gpu"]["measured"] == 2 and derived["gpu"]["spread"] > 1
  for platform, b in derived.items():
    low, high = CALIBRATION[platform].band
    # Rounded outwards to two decimals.
    assert low <= b["low"] < low + 0.01 and high - 0.01 < b["high"] <= high, platform
    points = [u for r in calibration._public_ranges(record)[platform] for u in r]
    if platform == "gpu":
      points += calibration.measured_utilisation()
    assert b["low"] * b["spread"] == pytest.approx(min(points))
    assert b["high"] / b["spread"] == pytest.approx(max(points))


def test_the_h200x1_targets_usable_memory_is_the_devices(monkeypatch):
  monkeypatch.delenv(targets.MEMORY_FRACTION_VARIABLE, raising=False)
  targets.gpu_memory_fraction.cache_clear()
  limits = {m["bytes_limit"] for m in _measured()}
  assert limits == {targets.get_target("h200x1").usable_bytes}
  targets.gpu_memory_fraction.cache_clear()


def test_the_pipeline_rate_per_core_is_the_lower_measured_one_with_every_core_busy():
  rows = [
      row
      for path in LEASES
      for row in _json(path)["parts"]["input_pipeline"]["throughput"]["rows"]
      if row["workers"] > 1
  ]
  assert len(rows) == 2
  assert IMAGES_PER_S_PER_CORE == min(row["images_per_s_per_core"] for row in rows)


def _program(**kwargs) -> Program:
  return Program(None, None, {}, None, {}, **kwargs)


def test_evaluations_and_checkpoints_are_counted_as_the_loop_schedules_them():
  config = ml_collections.ConfigDict(
      dict(batch_size=100, eval_every_steps=400, checkpoint_every_steps=300)
  )
  memory = {"parameters": 1e9, "optimizer_state": 2e9, "model_state": 0}
  found = outside_steps(config, _program(eval_examples=6_000), 1_000, memory)
  # Steps 400, 800 and the last; saves at 300, 600, 900 and the last.
  assert found["evaluations"] == 3 and found["checkpoints"] == 4
  # 3 x 6,000 forward passes against 1,000 x 100 training examples.
  assert found["eval_share"] == pytest.approx(3 * 6_000 * EVAL_SHARE_OF_TRAIN_STEP / 100_000)
  assert found["checkpoint_seconds"] == pytest.approx(4 * 3e9 / HOST_COPY_BYTES_PER_S)
  unknown = outside_steps(config, _program(), 1_000, memory)
  assert unknown["evaluations"] == 0 and unknown["eval_share"] == 0


def test_the_cores_that_feed_a_target_are_per_gpu_process_or_per_tpu_host():
  pipeline = dict(examples_per_s_per_core=100.0, cores=1, cores_from="data.num_workers=0")
  program = _program(input_pipeline=pipeline)
  node = types.SimpleNamespace(platform="gpu", num_devices=16, num_hosts=2)
  slice_ = types.SimpleNamespace(platform="tpu", num_devices=16, num_hosts=4)
  # 3,200 images/s over 16 GPU processes: 200 each, 2 cores; over 4 TPU hosts: 800 each, 8 cores.
  gpu = input_cores(program, node, 320, 0.1)
  assert gpu["cores_needed"] == 2 and gpu["processes_per_host"] == 8
  assert input_cores(program, slice_, 320, 0.1)["cores_needed"] == 8
  assert input_cores(program, slice_, 321, 0.1)["cores_needed"] == math.ceil(321 / 4 / 0.1 / 100)
  assert input_cores(_program(), node, 320, 0.1) is None
