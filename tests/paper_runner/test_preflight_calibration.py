"""The preflight's per-platform utilisation is the calibration record's, and the record's
utilisation is what its definition says."""

from __future__ import annotations

import json

import pytest

from conftest import REPO_ROOT
from paper_runner import calibration
from trainkit.preflight.calibration import CALIBRATION


def _record() -> dict:
  return json.loads((REPO_ROOT / calibration.RECORD).read_text())


def test_the_preflight_uses_the_utilisation_the_record_gives():
  from_record = calibration.calibrated_utilisation(_record())
  assert set(from_record) == set(CALIBRATION) == {"tpu", "gpu"}
  for platform, measured in from_record.items():
    used = CALIBRATION[platform].utilization
    assert used == pytest.approx(measured["utilization"], abs=0.005), platform


def test_utilisation_is_the_roofline_bound_over_the_public_step_time():
  run = dict(calibration.PUBLIC_RUNS[0], batch=1000, images_per_s=(2000.0, 4000.0))
  # Public step 0.25-0.5 s against a 0.1 s bound: 20-40% of the bound reached.
  assert calibration.utilisation(run, {"roofline_s": 0.1}) == pytest.approx((0.2, 0.4))
  record = {"rows": {run["name"]: {"roofline_s": 0.1}}}
  original = calibration.PUBLIC_RUNS
  try:
    calibration.PUBLIC_RUNS = (run,)
    found = calibration.calibrated_utilisation(record)
  finally:
    calibration.PUBLIC_RUNS = original
  assert found == {"tpu": pytest.approx(dict(utilization=0.3, low=0.2, high=0.4, rows=1))}


def test_mfu_is_the_step_s_flops_per_second_over_the_peak_of_the_dtype_it_ran_in():
  from trainkit.preflight.targets import TARGETS

  run = dict(calibration.PUBLIC_RUNS[0], target="h100x8", batch=800, images_per_s=(400.0, 800.0))
  h100 = TARGETS["h100x8"]
  row = {"flops_per_device": h100.peak_bf16_flops}  # One second of bfloat16 peak per step.
  # A step every 2 s (low) and every 1 s (high); float32 runs at the lower TF32 peak.
  assert calibration.mfu(dict(run, compute_dtype="bfloat16"), row) == pytest.approx((0.5, 1.0))
  tf32 = h100.peak_bf16_flops / h100.peak_tf32_flops
  assert calibration.mfu(dict(run, compute_dtype="float32"), row) == pytest.approx(
      (0.5 * tf32, tf32)
  )


def test_every_public_run_names_its_source_and_a_known_target():
  from trainkit.preflight.targets import TARGETS

  for run in calibration.PUBLIC_RUNS:
    assert run["target"] in TARGETS
    assert run["source"] and run["framework"]
    low, high = run["images_per_s"]
    assert 0 < low <= high


def test_the_calibration_table_in_the_docs_is_the_records():
  text = (REPO_ROOT / "docs" / "scaling.md").read_text()
  start = text.index("<!-- table:calibration -->\n") + len("<!-- table:calibration -->\n")
  end = text.index("<!-- /table:calibration -->")
  assert text[start:end] == calibration.table(_record())


def test_the_preflight_takes_its_platform_s_calibration_unless_the_config_names_one():
  import ml_collections

  from trainkit.preflight.compile import _utilization, preflight_config
  from trainkit.preflight.targets import get_target

  config = ml_collections.ConfigDict({"preflight": preflight_config()})
  rows = calibration.calibrated_utilisation(_record())
  for name, platform in (("v5e-16", "tpu"), ("h100x8", "gpu")):
    utilization, source, spread = _utilization(config, get_target(name))
    calibrated = CALIBRATION[platform]
    assert utilization == calibrated.utilization and spread == list(calibrated.band)
    # Wider than the public rows alone.
    assert spread[0] < rows[platform]["low"] < rows[platform]["high"] < spread[1]
    assert platform.upper() in source
  config.preflight.utilization = 0.25
  assert _utilization(config, get_target("h100x8")) == (0.25, "preflight.utilization", None)
