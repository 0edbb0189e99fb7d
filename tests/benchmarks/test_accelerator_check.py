"""benchmarks/accelerator_check.py, the command for a lent GPU, a driver of the benchmarks: run
end to end at tiny size on the CPU, every part reports figures and a failing part is recorded while
the others still report; an exhausted budget skips units with the reason; pytest's output is
counted; a prediction made beforehand is the one for the chip found; a unit that outlasts its
share is stopped with its workers."""

import json
import math
import os
import subprocess
import sys
import time

import jax
import pytest
from PIL import Image

from conftest import ONE_DEVICE_XLA_FLAGS, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import accelerator_check  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import bench_utils  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import input_pipeline  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import moe_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import train_step  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _positive(*values):
  for value in values:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, values


@pytest.mark.slow
def test_tiny_run_reports_every_part_and_a_failing_part_keeps_the_others(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", ONE_DEVICE_XLA_FLAGS)  # One device, as on the lent GPU.
  # The MoE layer's command fails (moe_layer.py has no such shape): recorded, the others report.
  monkeypatch.setitem(accelerator_check.SIZES["tiny"], "moe", ("no_such_shape", (4,), 2, 2))
  out = tmp_path / "results" / "check.json"
  returned = accelerator_check.main(["--size=tiny", f"--out={out}"])
  data = json.loads(out.read_text())
  assert data == json.loads(json.dumps(returned, default=str))

  env = data["environment"]
  assert env["status"] == "ok" and env["platform"] == "cpu" and env["jax"] == jax.__version__
  assert env["packages"]["grain"] and env["packages"]["jax"] == jax.__version__
  assert data["target"] == "h100x1"  # A CPU has no target of its own.

  layer = data["parts"]["moe_layer"]["layer"]
  assert data["parts"]["moe_layer"]["status"] == "error"
  assert "exit code 2" in layer["error"] and "no_such_shape" in layer["output_tail"]

  train = data["parts"]["train_step"]
  assert train["status"] == "ok"
  predicted, measured = train["prediction"], train["measured"]
  assert predicted["source"] == "compiled in this run" and "--mode=compile" in predicted["command"]
  assert predicted["target"] == "h100x1" and predicted["dispatch"] == measured["dispatch"]
  _positive(predicted["step_seconds"], predicted["roofline_seconds"])
  _positive(predicted["program_peak_bytes"])
  assert predicted["peak_bytes"] >= predicted["program_peak_bytes"]
  assert measured["batch_size"] == 8 and measured["timed_steps"] == 2
  _positive(measured["step_seconds"], measured["images_per_s"], measured["compile_seconds"])
  assert measured["peak_bytes"] is None  # A CPU reports no memory_stats.
  ratios = train["ratios"]
  assert ratios["step_over_predicted_step"] == pytest.approx(
      measured["step_seconds"] / predicted["step_seconds"]
  )
  assert ratios["same_dispatch"] and ratios["peak_over_program_peak"] is None

  pipeline = data["parts"]["input_pipeline"]
  assert pipeline["status"] == "ok"
  [row] = pipeline["throughput"]["rows"]
  assert row["row"] == "uint8_one_pass" and row["workers"] == 0
  _positive(row["images_per_s"], pipeline["vs_step"]["cores_to_feed_step"])
  assert pipeline["vs_step"]["step_images_per_s"] == measured["images_per_s"]

  run = data["parts"]["tests"]["device"]
  assert data["parts"]["tests"]["status"] == "ok"
  assert run["tests"] == run["passed"] >= 1 and run["failed"] == run["errors"] == 0

  quickstart = data["parts"]["quickstart"]
  on_device = quickstart["device"]
  assert quickstart["status"] == "ok" and quickstart["cpu"]["same_as_device"]
  _positive(on_device["wall_seconds"], on_device["final_loss"], on_device["examples_per_second"])
  assert 0.0 <= on_device["test_accuracy"] <= 1.0 and on_device["test_examples"] == 32
  [block] = on_device["routing_by_group"].values()  # docs/report.md's quickstart table lists it.
  assert 0.0 <= block["divergence"] <= 1.0

  md = out.with_suffix(".md").read_text()
  assert f"JAX {jax.__version__}" in md and data["date"] in md and "Device: cpu" in md
  assert "python benchmarks/accelerator_check.py --size=tiny --out=" in md
  assert "`moe_layer.layer`: error: exit code 2" in md
  assert f"| step time (ms) | {measured['step_seconds'] * 1e3:,.2f} |" in md


def test_an_exhausted_budget_skips_every_unit_with_the_reason(tmp_path, capsys):
  out = tmp_path / "check.json"
  accelerator_check.main(["--size=tiny", f"--out={out}", "--budget_s=0"])
  data = json.loads(out.read_text())
  assert data["environment"]["status"] == "skipped"
  for name, part in data["parts"].items():
    assert part["status"] == "skipped", name
    for unit in (u for u in part.values() if isinstance(u, dict)):
      assert unit["reason"] == "time budget: 0 of 0 s left", (name, unit)
  md = out.with_suffix(".md").read_text()
  assert "`quickstart.cpu`: skipped: time budget" in md and md in capsys.readouterr().out


@pytest.mark.slow
def test_pytest_output_is_counted_and_each_failure_listed(tmp_path):
  (tmp_path / "test_sample.py").write_text(
      "import pytest\n"
      "@pytest.fixture\ndef broken():\n  raise ModuleNotFoundError('no fairlearn')\n"
      "def test_ok():\n  pass\n"
      "def test_close():\n  assert 0.72952 == 0.72950, 'Not equal to tolerance'\n"
      "def test_mesh():\n  pytest.skip('needs more devices')\n"
      "def test_import(broken):\n  pass\n"
  )
  output = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "test_sample.py"],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      check=False,
  ).stdout
  summary = bench_utils.pytest_summary(output)
  assert {k: summary[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
      "tests": 4,
      "passed": 1,
      "failed": 1,
      "errors": 1,
      "skipped": 1,
  }
  [failed, error] = summary["failures"]
  assert failed["test"] == "test_sample.py::test_close" and "tolerance" in failed["message"]
  assert error["test"] == "test_sample.py::test_import" and "fairlearn" in error["message"]


def test_device_tests_stopped_before_their_report_say_how_far_they_got():
  # The end of the output of the lent H200's run on 2026-11-28, stopped at its 240 s share.
  output = (
      "bringing up nodes...\n\n"
      + "." * 72
      + " [ 22%]\n"
      + "." * 26
      + "s"
      + "." * 45
      + " [ 45%]\n"
      + "." * 40
      + "sss"
      + "." * 26
      + "sss [ 68%]\n"
      + "." * 72
      + " [ 91%]\n"
      + "." * 27
  )
  assert bench_utils.pytest_summary(output) == {"ran_before_stop": 315, "failed_before_stop": 0}
  failing = output.replace("." * 72 + " [ 22%]", ".F" + "." * 68 + "E." + " [ 22%]")
  assert bench_utils.pytest_summary(failing)["failed_before_stop"] == 2
  assert bench_utils.pytest_summary("collected 4 items\nTraceback ...") == {}


def _preflight_record(tmp_path, target, device_kind, batch):
  path = tmp_path / f"{target}_{batch}.json"
  path.write_text(
      json.dumps(
          {
              "target": {"name": target, "device_kind": device_kind},
              "batch": {"global": batch},
              "fits": True,
              "settings": {"moe.dispatch": "sort"},
              "train_step": {
                  "memory": {"peak": 10 * 2**30, "program_peak": 8 * 2**30},
                  "roofline": {"bound_s": 0.01, "bound_by": "memory"},
              },
              "run": {"step_seconds": 0.025, "utilization": 0.4},
          }
      )
  )
  return str(path)


def test_the_prediction_made_beforehand_is_the_one_for_the_chip_and_batch(tmp_path):
  assert train_step.one_device_target("NVIDIA H200") == "h200x1"
  assert train_step.one_device_target("NVIDIA H100 80GB HBM3") == "h100x1"
  assert train_step.one_device_target("cpu") == "h100x1"  # No target: the default.
  h100 = _preflight_record(tmp_path, "h100x1", "NVIDIA H100 80GB HBM3", 8)
  h200 = _preflight_record(tmp_path, "h200x1", "NVIDIA H200", 8)
  other_batch = _preflight_record(tmp_path, "h200x1", "NVIDIA H200", 256)
  for target, wanted in (("h200x1", h200), ("h100x1", h100)):
    predicted = train_step.find_prediction([other_batch, h100, h200], target, 8)
    assert predicted["target"] == target and predicted["source"] == f"--preflight_json={wanted}"
  assert train_step.find_prediction([h100, other_batch], "h200x1", 8) is None

  measured = {
      "step_seconds": 0.05,
      "peak_bytes": 9 * 2**30,
      "images_per_s": 160.0,
      "dispatch": "sort",
      "device_kind": "NVIDIA H200",
  }
  for predicted, same_chip in (
      (train_step.find_prediction([h200], "h200x1", 8), True),
      (train_step.find_prediction([h100], "h100x1", 8), False),
  ):
    ratios = train_step.compare_with_prediction(measured, predicted)
    assert ratios["step_over_predicted_step"] == pytest.approx(2.0)
    assert ratios["implied_utilization"] == pytest.approx(0.2)
    assert ratios["peak_over_program_peak"] == pytest.approx(9 / 8) and ratios["same_dispatch"]
    assert ratios["same_chip"] is same_chip
    result = {
        "command": "python benchmarks/accelerator_check.py",
        "date": "2026-11-27",
        "size": "tiny",
        "budget_s": 900.0,
        "environment": {},
        "parts": {p: {} for p in accelerator_check.PARTS},
    }
    result["parts"]["train_step"] = {"measured": measured, "prediction": predicted}
    accelerator_check.derive(result)
    md = accelerator_check.markdown(result)
    assert "| step time (ms) | 50.00 | 25.00 | 2.00 |" in md
    assert "| peak memory (GiB), the step's program | 9.00 | 8.00 | 1.12 |" in md
    assert ("The prediction is for another chip" in md) is not same_chip


def test_the_fastest_of_ours_at_every_expert_count_is_what_auto_should_be():
  def rows(times):
    return [dict(num_experts=e, dispatch=d, time_ms=t) for e, d, t in times]

  agreed = moe_layer.fastest_dispatch(
      rows(
          [
              (None, "dense_mlp", 1.0),
              (4, "vmoe_indices", 2.0),
              (4, "sort", 3.0),
              (4, "einsum", 4.0),
              (64, "sort", 5.0),
              (64, "dropless", 9.0),
          ]
      ),
      ("sort", "einsum", "dropless"),
      "gpu",
  )
  assert agreed["fastest"]["4"] == {
      "ours": "sort",
      "ours_ms": 3.0,
      "overall": "vmoe_indices",
      "overall_ms": 2.0,
  }
  assert agreed["auto"] == {"platform": "gpu", "current": "sort", "agrees": True, "fastest": "sort"}
  split = moe_layer.fastest_dispatch(
      rows([(4, "einsum", 1.0), (4, "sort", 2.0), (64, "sort", 1.0), (64, "einsum", 2.0)]),
      ("sort", "einsum"),
      "tpu",
  )
  assert split["auto"] == {"platform": "tpu", "current": "einsum", "agrees": False, "fastest": None}


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


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # A zombie has ended.
  except FileNotFoundError:
    return False


@pytest.mark.slow
def test_a_command_that_outlasts_its_share_is_stopped_with_its_children():
  # The command starts a worker (as grain's are), prints its pid, and both sleep past the share.
  command = [
      sys.executable,
      "-c",
      "import subprocess, sys, time; worker = subprocess.Popen("
      "[sys.executable, '-c', 'import time; time.sleep(120)']); print(worker.pid, "
      "flush=True); time.sleep(120)",
  ]
  code, output, seconds = bench_utils.run_command(command, dict(os.environ), timeout=3.0)
  assert code is None and seconds < 60
  worker = int(output.split()[0])
  deadline = time.monotonic() + 10
  while _alive(worker) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _alive(worker)
  assert bench_utils.run_command([sys.executable, "-c", "exit(3)"], dict(os.environ), 30)[0] == 3


def test_the_pipeline_times_synthetic_jpegs_of_celebas_size_where_no_files_are(tmp_path):
  input_pipeline.synthetic_jpegs(str(tmp_path), 2)
  paths = sorted((tmp_path / "img_align_celeba").glob("*.jpg"))
  assert [Image.open(p).size for p in paths] == [(178, 218)] * 2
