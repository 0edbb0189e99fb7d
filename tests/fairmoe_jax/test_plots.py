"""`write_plots` on a hand-made run directory: which PNGs appear, and which are skipped."""

import json

import pytest
from PIL import Image

from fairmoe_jax.analysis import write_plots
from fairmoe_jax.analysis.plots import validation_curves_figure
from trainkit.errors import UserError

ATTRIBUTES = {"sex": ["male", "female"], "site": ["head/neck", "torso", "palms_soles"]}
NUM_EXPERTS = 4


def _report(*, moe: bool = True, fem: bool = True) -> dict:
  report = {
      "accuracy": 0.75,
      "num_examples": 100,
      "loss": 0.8,
      "step": 30,
      "method": "fairsmoe" if moe else "multifair",
      "attributes": {
          name: {
              "pqd": 0.8,
              "dp": 0.01,
              "eopp": 0.02,
              "eodds": 0.03,
              "groups": {g: {"n": 10 + i, "accuracy": 0.6 + 0.1 * i} for i, g in enumerate(groups)},
              "empty_groups": [],
          }
          for name, groups in ATTRIBUTES.items()
      },
      "mf": {"pqd": 0.8, "dp": 0.01, "eopp": 0.02, "eodds": 0.03},
  }
  report["attributes"]["site"]["empty_groups"] = ["oral_genital"]
  if moe:
    report["expert_utilisation"] = {
        "moe_block3": {
            name: {g: [0.4, 0.3, 0.2, 0.1] for g in groups} for name, groups in ATTRIBUTES.items()
        }
    }
    report["gradient_cosine"] = {"sex|site": [0.5, -0.2, 0.1, 0.9]}
  if fem:
    report["experts_per_attribute"] = {"sex": 2, "site": 1}
  return report


def _metrics(*, val: bool = True, fem: bool = True, loss: bool = True) -> list[dict]:
  records = []
  for step in (10, 20, 30):
    record = {"step": step}
    if loss:
      record.update({"loss": 1.0 / step, "loss/cross_entropy": 0.5 / step, "accuracy": 0.4})
    if val:
      record.update({"val/accuracy": 0.5 + step / 100, "val/mf_pqd": 0.7, "val/sex/pqd": 0.9})
    if fem:
      record.update({"fem/experts/sex": step // 10, "fem/experts/site": 1})
    records.append(record)
  records.append({"step": 31, "val/mf_pqd": None})  # A non-finite value, as MetricWriter writes it.
  return records


def _write_run(directory, report: dict | None, metrics: list[dict] | None):
  directory.mkdir(parents=True, exist_ok=True)
  if report is not None:
    (directory / "report.json").write_text(json.dumps(report))
  if metrics is not None:
    (directory / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
  return str(directory)


def _assert_pngs(paths: list[str]):
  for path in paths:
    with Image.open(path) as image:
      assert image.format == "PNG"
      assert image.size[0] > 0 and image.size[1] > 0


def test_all_plots_for_a_fairsmoe_run(tmp_path):
  workdir = _write_run(tmp_path / "run", _report(), _metrics())
  paths = write_plots(workdir)
  names = sorted(p.split("/")[-1] for p in paths)
  assert names == [
      "allocation_history.png",
      "expert_activation_moe_block3.png",
      "gradient_cosine.png",
      "group_accuracy.png",
      "validation_curves.png",
  ]
  assert all(p.startswith(str(tmp_path / "run" / "plots")) for p in paths)
  _assert_pngs(paths)


def test_absent_data_skips_its_plot(tmp_path):
  # A dense method that logged nothing: no experts, no allocation, no cosines, no curves.
  workdir = _write_run(
      tmp_path / "run", _report(moe=False, fem=False), _metrics(val=False, fem=False, loss=False)
  )
  paths = write_plots(workdir)
  assert [p.split("/")[-1] for p in paths] == ["group_accuracy.png"]
  _assert_pngs(paths)
  assert sorted(p.name for p in (tmp_path / "run" / "plots").iterdir()) == ["group_accuracy.png"]
  # Without validation, the training loss alone is still worth its curves.
  workdir = _write_run(
      tmp_path / "run2", _report(moe=False, fem=False), _metrics(val=False, fem=False)
  )
  names = sorted(p.split("/")[-1] for p in write_plots(workdir))
  assert names == ["group_accuracy.png", "validation_curves.png"]


def _lines(ax) -> dict[str, tuple[list, list]]:
  return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_curves_show_training_loss_beside_validation():
  """Loss panel: the training loss and its task term at every logged step, the validation
  cross-entropy at the evaluations; then accuracy (training and validation) and PQD panels."""
  metrics = _metrics()
  metrics[1]["val/loss"] = 0.7  # An evaluation at step 20 only.
  fig = validation_curves_figure(_report(), metrics)
  loss_ax, acc_ax, pqd_ax = fig.axes
  assert loss_ax.get_shared_x_axes().joined(loss_ax, pqd_ax)
  lines = _lines(loss_ax)
  assert lines["training loss (all terms)"] == ([10, 20, 30], [1 / 10, 1 / 20, 1 / 30])
  assert lines["training task loss (cross-entropy)"] == ([10, 20, 30], [0.05, 0.025, 0.5 / 30])
  assert lines["validation cross-entropy"] == ([20], [0.7])
  lines = _lines(acc_ax)
  assert lines["training batches"][1] == pytest.approx([40.0, 40.0, 40.0])
  assert lines["validation"] == ([10, 20, 30], pytest.approx([60.0, 70.0, 80.0]))
  lines = _lines(pqd_ax)
  assert lines["MF-PQD"] == ([10, 20, 30], [0.7, 0.7, 0.7])  # Step 31's null is skipped.
  assert lines["sex"] == ([10, 20, 30], [0.9, 0.9, 0.9])


def test_without_metrics_file_plots_the_report_only(tmp_path):
  workdir = _write_run(tmp_path / "run", _report(), None)
  names = sorted(p.split("/")[-1] for p in write_plots(workdir))
  assert names == ["expert_activation_moe_block3.png", "gradient_cosine.png", "group_accuracy.png"]


def test_missing_report_is_a_user_error_naming_the_file(tmp_path):
  workdir = _write_run(tmp_path / "run", None, _metrics())
  with pytest.raises(UserError, match="report.json"):
    write_plots(workdir)


def test_unreadable_report_is_a_user_error(tmp_path):
  (tmp_path / "report.json").write_text("{not json")
  with pytest.raises(UserError, match="report.json"):
    write_plots(str(tmp_path))
