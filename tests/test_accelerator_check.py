"""benchmarks/accelerator_check.py, the command for a lent GPU, run end to end at tiny size on the
CPU: every part reports figures, a failing part is recorded while the others still report, the
markdown names the device, date, JAX version and command, and an exhausted budget skips units
with the reason."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from conftest import ONE_DEVICE_XLA_FLAGS, REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "accelerator_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import accelerator_check  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _run(out, *args):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device, as on the lent machine's one GPU.
  return subprocess.run(
      [sys.executable, str(SCRIPT), "--size=tiny", f"--out={out}", *args],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )


def _numbers(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _numbers(value)
  elif isinstance(tree, list):
    for value in tree:
      yield from _numbers(value)
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield tree


def _positive(*values):
  for value in values:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, values


def test_tiny_run_reports_every_part_and_a_failing_part_keeps_the_others(tmp_path):
  out = tmp_path / "results" / "check.json"
  result = _run(out, "--inject_failure=input_pipeline")
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  data = json.loads(out.read_text())
  assert all(math.isfinite(n) for n in _numbers(data))

  env = data["environment"]
  assert env["status"] == "ok" and env["platform"] == "cpu" and env["jax"] == jax.__version__
  assert env["packages"]["grain"] and env["packages"]["jax"] == jax.__version__
  assert set(data["parts"]) == {"train_step", "moe_layer", "input_pipeline", "tests", "quickstart"}

  # The failing part: its error recorded, what it measured before failing kept.
  pipeline = data["parts"]["input_pipeline"]
  assert pipeline["status"] == "error"
  assert "injected failure" in pipeline["throughput"]["error"]
  [row] = pipeline["throughput"]["rows"]
  _positive(row["images_per_s"], row["images_per_s_per_core"])

  # The others still report.
  train = data["parts"]["train_step"]
  assert train["status"] == "ok"
  predicted, measured = train["prediction"], train["measured"]
  assert predicted["target"] == "h100x1" and predicted["dispatch"] == measured["dispatch"]
  _positive(predicted["step_seconds"], predicted["roofline_seconds"])
  _positive(predicted["program_peak_bytes"])
  assert predicted["peak_bytes"] >= predicted["program_peak_bytes"]
  assert measured["batch_size"] == 8 and measured["timed_steps"] == 2
  _positive(measured["step_seconds"], measured["images_per_s"], measured["compile_seconds"])
  assert measured["peak_bytes"] is None and "memory_stats" in measured["peak_note"]  # CPU.
  ratios = train["ratios"]
  _positive(ratios["step_over_predicted_step"], ratios["step_over_roofline"])
  assert ratios["same_dispatch"] and ratios["peak_over_program_peak"] is None

  layer = data["parts"]["moe_layer"]["layer"]
  assert data["parts"]["moe_layer"]["status"] == "ok" and not layer["errors"]
  references = {"vmoe_einsum", "vmoe_indices"} if "error" not in layer["peer"] else {"vmoe_ref"}
  ours = {"sort", "einsum", "dropless"}
  assert {r["dispatch"] for r in layer["rows"]} == {"dense_mlp"} | ours | references
  for r in layer["rows"]:
    _positive(r["time_ms"], r["vs_dense"])
  assert layer["auto"]["current"] == "sort" and layer["auto"]["fastest"] in ours
  assert layer["fastest"]["4"]["ours"] == layer["auto"]["fastest"]

  quickstart = data["parts"]["quickstart"]
  assert quickstart["status"] == "ok"
  on_device = quickstart["device"]
  _positive(on_device["wall_seconds"], on_device["final_loss"], on_device["examples_per_second"])
  assert 0.0 <= on_device["test_accuracy"] <= 1.0 and on_device["test_examples"] == 32
  # The report's routing figures come back too (docs/report.md's quickstart table lists them).
  [block] = on_device["routing_by_group"].values()
  assert 0.0 <= block["divergence"] <= 1.0 and "=" in block["group"]
  assert quickstart["cpu"]["same_as_device"]  # The device is this CPU: one run serves both.

  # The tests on the device (here the CPU): run, counted, none failing.
  tests = data["parts"]["tests"]
  assert tests["status"] == "ok", tests
  run = tests["device"]
  assert run["tests"] == run["passed"] >= 1 and run["failed"] == run["errors"] == 0
  assert run["command"].startswith("JAX_PLATFORMS=cpu python -m pytest")

  # The step's consumption beside the pipeline's rate, from two parts.
  _positive(pipeline["vs_step"]["cores_to_feed_step"], pipeline["vs_step"]["pipeline_over_step"])

  md = out.with_suffix(".md").read_text()
  assert md in result.stdout
  assert f"JAX {jax.__version__}" in md and f"date {data['date']}" in md and "Device: cpu" in md
  assert "python benchmarks/accelerator_check.py --size=tiny --out=" in md
  assert "`input_pipeline.throughput`: error: RuntimeError: injected failure" in md


def test_an_exhausted_budget_skips_every_unit_with_the_reason(tmp_path):
  out = tmp_path / "check.json"
  result = _run(out, "--budget_s=0", "--parts=train_step,quickstart")
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  data = json.loads(out.read_text())
  assert data["environment"]["status"] == "skipped"
  for name, part in data["parts"].items():
    assert part["status"] == "skipped", name
    for unit in (u for u in part.values() if isinstance(u, dict)):
      wanted = "time budget" if name in ("train_step", "quickstart") else "not in --parts"
      assert wanted in unit["reason"], (name, unit)
  assert "Not measured" in out.with_suffix(".md").read_text()


def test_failing_device_tests_are_counted_and_listed_by_cause(tmp_path):
  junit = tmp_path / "junit.xml"
  junit.write_text(
      '<testsuites><testsuite name="pytest" tests="4">'
      '<testcase classname="tests.test_moe" name="test_ok"/>'
      '<testcase classname="tests.test_moe" name="test_close">'
      '<failure message="AssertionError:\n Not equal to tolerance rtol=1e-05">trace</failure>'
      "</testcase>"
      '<testcase classname="tests.test_mesh" name="test_mesh">'
      '<skipped message="needs more devices"/></testcase>'
      '<testcase classname="tests.test_fair" name="test_import">'
      '<error message="ModuleNotFoundError: No module named \'fairlearn\'">trace</error>'
      "</testcase></testsuite></testsuites>"
  )
  summary = accelerator_check.junit_summary(str(junit))
  assert {k: summary[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
      "tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
  assert summary["failures"] == [
      {"test": "test_moe::test_close", "message": "AssertionError: Not equal to tolerance rtol=1e-05"},
      {"test": "test_fair::test_import", "message": "ModuleNotFoundError: No module named 'fairlearn'"},
  ]
  assert accelerator_check.junit_summary(str(tmp_path / "absent.xml")) == {}
  lines = accelerator_check._tests_markdown(  # pylint: disable=protected-access
      {"status": "error", "device": dict(summary, command="pytest", seconds=3.0)}
  )
  assert "1 passed, 1 failed, 1 errors, 1 skipped" in lines[0]
  assert "| `test_moe::test_close` | AssertionError: Not equal to tolerance rtol=1e-05 |" in lines


def test_device_tests_stopped_before_their_report_say_how_far_they_got():
  # The end of the output of the lent H200's run on 2026-11-28, stopped at its 240 s share.
  output = (
      "bringing up nodes...\n\n"
      + "." * 72 + " [ 22%]\n"
      + "." * 26 + "s" + "." * 45 + " [ 45%]\n"
      + "." * 40 + "sss" + "." * 26 + "sss [ 68%]\n"
      + "." * 72 + " [ 91%]\n"
      + "." * 27
  )
  assert accelerator_check.progress_summary(output) == {
      "ran_before_stop": 315, "failed_before_stop": 0}
  failing = output.replace("." * 72 + " [ 22%]", ".F" + "." * 68 + "E." + " [ 22%]")
  assert accelerator_check.progress_summary(failing)["failed_before_stop"] == 2
  assert accelerator_check.progress_summary("collected 4 items\nTraceback ...") == {}
  stopped = {"error": "stopped after 241 s, its share of the budget",
             **accelerator_check.progress_summary(failing)}
  lines = accelerator_check._tests_markdown(  # pylint: disable=protected-access
      {"status": "timeout", "device": stopped})
  assert lines == ["**Tests on the device** (timeout): stopped after 241 s, its share of the "
                   "budget; 315 tests had run by then, 2 of them failing"]


def _preflight_record(batch):
  return {
      "target": {"name": "h100x1", "device_kind": "NVIDIA H100 80GB HBM3"},
      "batch": {"global": batch},
      "fits": True,
      "settings": {"moe.dispatch": "sort"},
      "train_step": {"memory": {"peak": 10 * 2**30, "program_peak": 8 * 2**30},
                     "roofline": {"bound_s": 0.01, "bound_by": "memory"}},
      "run": {"step_seconds": 0.025, "utilization": 0.4},
  }


def test_a_preflight_made_beforehand_is_the_prediction_and_the_step_is_compared_with_it(tmp_path):
  made = tmp_path / "preflight.json"
  made.write_text(json.dumps(_preflight_record(batch=8)))
  args = accelerator_check.parse_args(["--size=tiny", "--target=h100x1", f"--preflight_json={made}"])
  result = {"budget_s": 900.0, "environment": {}, "parts": {p: {} for p in accelerator_check.PARTS}}
  [unit] = [u for u in accelerator_check.UNITS if u.name == "prediction"]
  predicted = accelerator_check._skip_or_reuse(unit, args, result, 100.0)
  assert predicted["status"] == "ok" and str(made) in predicted["source"]
  train = result["parts"]["train_step"]
  train["prediction"] = predicted
  train["measured"] = {"step_seconds": 0.05, "peak_bytes": 9 * 2**30, "images_per_s": 160.0,
                       "dispatch": "sort"}
  accelerator_check.derive(result)
  ratios = train["ratios"]
  assert ratios["step_over_predicted_step"] == pytest.approx(2.0)
  assert ratios["implied_utilization"] == pytest.approx(0.2)
  assert ratios["peak_over_program_peak"] == pytest.approx(9 / 8) and ratios["same_dispatch"]
  result.update(command="python benchmarks/accelerator_check.py", date="2026-11-27", size="tiny")
  md = accelerator_check.markdown(result)
  assert "| step time (ms) | 50.00 | 25.00 | 2.00 |" in md
  assert "| peak memory (GiB), the step's program | 9.00 | 8.00 | 1.12 |" in md

  # A record of another batch is not this run's prediction: it is compiled here instead.
  made.write_text(json.dumps(_preflight_record(batch=256)))
  assert accelerator_check._skip_or_reuse(unit, args, result, 100.0) is None
  assert "batch 256" in result["parts"]["train_step"]["preflight_json_unusable"]


def test_the_prediction_is_for_the_chip_found_and_a_record_for_another_chip_is_not_used(tmp_path):
  check = accelerator_check
  assert check.target_for_device({"device_kind": "NVIDIA H200"}) == "h200x1"
  assert check.target_for_device({"device_kind": "NVIDIA H100 80GB HBM3"}) == "h100x1"
  assert check.target_for_device({"device_kind": "cpu"}) == "h100x1"  # No target: the default.
  h100, h200 = tmp_path / "h100.json", tmp_path / "h200.json"
  h100.write_text(json.dumps(_preflight_record(batch=8)))
  h200.write_text(json.dumps(dict(
      _preflight_record(batch=8), target={"name": "h200x1", "device_kind": "NVIDIA H200"}
  )))
  [unit] = [u for u in check.UNITS if u.name == "prediction"]
  for target, wanted in (("h200x1", h200), ("h100x1", h100)):
    args = check.parse_args(["--size=tiny", f"--target={target}", f"--preflight_json={h100},{h200}"])
    result = {"budget_s": 900.0, "environment": {}, "parts": {p: {} for p in check.PARTS}}
    predicted = check._skip_or_reuse(unit, args, result, 100.0)
    assert predicted["target"] == target and str(wanted) in predicted["source"]
  # Only another chip's record: compiled here instead, the reason named.
  args = check.parse_args(["--size=tiny", "--target=h200x1", f"--preflight_json={h100}"])
  result = {"budget_s": 900.0, "environment": {}, "parts": {p: {} for p in check.PARTS}}
  assert check._skip_or_reuse(unit, args, result, 100.0) is None
  assert "is for h100x1, not h200x1" in result["parts"]["train_step"]["preflight_json_unusable"]
  # A comparison across chips says so.
  train = result["parts"]["train_step"]
  train["prediction"] = dict(check.prediction_summary(_preflight_record(batch=8)), status="ok")
  train["measured"] = {"step_seconds": 0.05, "peak_bytes": 9 * 2**30, "device_kind": "NVIDIA H200"}
  check.derive(result)
  assert train["ratios"]["same_chip"] is False
  result.update(command="python benchmarks/accelerator_check.py", date="2026-11-27", size="tiny")
  assert "The prediction is for another chip" in check.markdown(result)


def test_a_recorded_device_result_is_compared_again_with_the_prediction_for_its_chip(tmp_path):
  """`--from_result`: a device's JSON and a prediction made later, compared without a device."""
  check = accelerator_check
  h100, h200 = tmp_path / "h100.json", tmp_path / "h200.json"
  h100.write_text(json.dumps(_preflight_record(batch=8)))
  h200.write_text(json.dumps(dict(
      _preflight_record(batch=8), target={"name": "h200x1", "device_kind": "NVIDIA H200"}
  )))
  device = tmp_path / "device.json"
  device.write_text(json.dumps({
      "command": "python benchmarks/accelerator_check.py --size=tiny", "date": "2026-11-27",
      "size": "tiny", "budget_s": 900.0, "target": "h100x1",
      "environment": {"device_kind": "NVIDIA H200", "platform": "gpu"},
      "parts": {
          "train_step": {"status": "ok", "measured": {
              "step_seconds": 0.05, "peak_bytes": 9 * 2**30, "device_kind": "NVIDIA H200",
              "dispatch": "sort"}},
          **{p: {"status": "skipped"} for p in ("moe_layer", "input_pipeline", "quickstart")},
      },
  }))
  out = tmp_path / "again.json"
  args = check.parse_args([f"--from_result={device}", f"--preflight_json={h100},{h200}", f"--out={out}"])
  result = check.compare_again(args)
  train = result["parts"]["train_step"]
  assert result["target"] == "h200x1" and str(h200) in train["prediction"]["source"]
  assert train["ratios"]["step_over_predicted_step"] == pytest.approx(2.0)
  assert train["ratios"]["same_chip"] is True
  assert json.loads(out.read_text())["compared_again"].startswith("python benchmarks/")
  assert "--from_result=" in out.with_suffix(".md").read_text()
  # No record for the chip: one line, not a wrong comparison.
  args = check.parse_args([f"--from_result={device}", f"--preflight_json={h100}", f"--out={out}"])
  with pytest.raises(SystemExit, match="no --preflight_json for h200x1"):
    check.compare_again(args)


def test_the_markdown_of_a_run_that_measured_nothing_still_names_where_and_how():
  result = {
      "command": "python benchmarks/accelerator_check.py --out=x.json",
      "date": "2026-11-27",
      "size": "full",
      "budget_s": 420.0,
      "environment": {"status": "error", "error": "no GPU"},
      "parts": {p: {"status": "pending"} for p in accelerator_check.PARTS},
  }
  md = accelerator_check.markdown(result)
  assert "unknown device" in md and "2026-11-27" in md and "--out=x.json" in md
  assert "`environment.probe`: error: no GPU" in md


def test_a_unit_that_outlasts_its_share_is_stopped_and_recorded_as_such():
  command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"]
  code, tail, seconds = accelerator_check.run_process(command, dict(os.environ), timeout=2.0)
  assert code is None and "started" in tail and seconds < 60
  record = accelerator_check._outcome({"rows": [1]}, code, tail, seconds, failed="")
  assert record["status"] == "timeout" and "its share of the budget" in record["error"]
  assert record["rows"] == [1]  # What it saved before is kept.
