"""predictions.csv and intersectional groups: the file reproduces report.json through fairlearn,
and intersection metrics match a direct numpy computation."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import QUICKSTART_RUN_ARGS, QUICKSTART_STEPS, REPO_ROOT
from conftest import one_device_env as _env
from fairmoe_jax import config as config_lib
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.data import pipeline
from fairmoe_jax.metrics import intersections
from fairmoe_jax.metrics.report import format_report
from trainkit.errors import ConfigError

METRICS = ("pqd", "dp", "eopp", "eodds")


# ---------------------------------------------------------------------------
# A reference written from the definitions (README, docs/design.md), straight from
# per-example arrays: no count tensors, nothing shared with fairmoe_jax.metrics.
# ---------------------------------------------------------------------------


def reference_metrics(labels, preds, groups, num_classes):
  """PQD, DP, EOpp, EOdds over the distinct values of `groups` (every one non-empty)."""
  members = [groups == g for g in np.unique(groups)]
  acc = [np.mean(labels[m] == preds[m]) for m in members]
  dp, eopp, eodds = [], [], []
  for c in range(num_classes):
    dp.append(np.ptp([np.mean(preds[m] == c) for m in members]))
    tpr = [np.mean(preds[m & (labels == c)] == c) for m in members if np.any(m & (labels == c))]
    fpr = [np.mean(preds[m & (labels != c)] == c) for m in members if np.any(m & (labels != c))]
    spreads = [np.ptp(r) for r in (tpr, fpr) if len(r) >= 2]
    if len(tpr) >= 2:
      eopp.append(np.ptp(tpr))
    if spreads:
      eodds.append(max(spreads))
  return {
      "pqd": min(acc) / max(acc),
      "dp": np.mean(dp),
      "eopp": np.mean(eopp) if eopp else 0.0,
      "eodds": np.mean(eodds) if eodds else 0.0,
  }


def _hand_made():
  """sex (2 groups) x age (3 groups), 3 classes; one empty and two small intersection groups."""
  rng = np.random.default_rng(7)
  sizes = {(0, 0): 40, (0, 1): 35, (0, 2): 5, (1, 0): 50, (1, 1): 3}  # (1, 2) is empty.
  error_rate = {(0, 0): 0.1, (0, 1): 0.3, (0, 2): 0.8, (1, 0): 0.2, (1, 1): 0.0}
  rows, labels, preds = [], [], []
  for key, n in sizes.items():
    y = rng.integers(0, 3, n)
    wrong = rng.random(n) < error_rate[key]
    rows += [key] * n
    labels.append(y)
    preds.append(np.where(wrong, (y + rng.integers(1, 3, n)) % 3, y))
  # Missing values: such examples belong to no sex*age group.
  rows += [(-1, 0), (0, -1), (-1, -1)]
  labels.append(np.array([0, 1, 2]))
  preds.append(np.array([1, 2, 0]))
  return np.concatenate(labels), np.concatenate(preds), np.array(rows, np.int32)


GROUP_NAMES = (("male", "female"), ("young", "middle", "old"))


def _intersection(labels, preds, attributes, min_group_size):
  return intersections.intersection_report(
      labels,
      preds,
      attributes,
      attribute_names=("sex", "age"),
      group_names=GROUP_NAMES,
      intersections=[("sex", "age")],
      num_classes=3,
      min_group_size=min_group_size,
  )["sex*age"]


def test_intersection_metrics_match_a_numpy_reference():
  labels, preds, attributes = _hand_made()
  entry = _intersection(labels, preds, attributes, min_group_size=30)

  complete = np.all(attributes >= 0, axis=1)
  y, p, a = labels[complete], preds[complete], attributes[complete]
  names = np.array([f"{GROUP_NAMES[0][s]}*{GROUP_NAMES[1][g]}" for s, g in a])
  ref = reference_metrics(y, p, names, 3)
  for m in METRICS:
    assert entry[m] == pytest.approx(ref[m], abs=1e-12), m
  assert entry["groups"] == {
      g: {"n": int(np.sum(m)), "accuracy": pytest.approx(np.mean(y[m] == p[m]), abs=1e-12)}
      for g, m in ((g, names == g) for g in np.unique(names))
  }
  assert entry["empty_groups"] == ["female*old"]
  assert sorted(entry["small_groups"]) == ["female*middle", "male*old"]

  large = ~np.isin(names, entry["small_groups"])
  ref_large = reference_metrics(y[large], p[large], names[large], 3)
  without = entry["without_small_groups"]
  assert without["num_groups"] == 3
  for m in METRICS:
    assert without[m] == pytest.approx(ref_large[m], abs=1e-12), m
  # The case is built so that the small groups move the scores: they are not averaged in unseen.
  assert entry["pqd"] < without["pqd"] and entry["dp"] != without["dp"]

  text = format_report(
      {
          "accuracy": 0.5,
          "num_examples": 1,
          "attributes": {},
          "mf": dict.fromkeys(METRICS, 0.0),
          "intersections": {"sex*age": entry},
      }
  )
  assert "[sex*age]" in text and "without the 2 small" in text
  assert re.search(r"male\*old +5 .*small \(n < 30\)", text)


def test_without_small_groups_is_null_when_fewer_than_two_groups_are_left():
  labels, preds, attributes = _hand_made()
  entry = _intersection(labels, preds, attributes, min_group_size=45)
  assert entry["small_groups"] == ["male*young", "male*middle", "male*old", "female*middle"]
  assert entry["without_small_groups"] == {**dict.fromkeys(METRICS), "num_groups": 1}
  # With no threshold nothing is flagged and both readings agree.
  entry = _intersection(labels, preds, attributes, min_group_size=0)
  assert entry["small_groups"] == []
  assert {m: entry["without_small_groups"][m] for m in METRICS} == {m: entry[m] for m in METRICS}


def test_intersections_config_is_checked_and_names_the_key():
  assert intersections.parse_intersections("") == []
  assert intersections.parse_intersections(" sex*age , age * site*sex") == [
      ("sex", "age"),
      ("age", "site", "sex"),
  ]
  config = config_lib.base_config()
  for bad in ("sex", "sex*sex", "sex*age,sex*age", "sex*"):
    config.eval.intersections = bad
    with pytest.raises(ConfigError, match="eval.intersections"):
      config_lib.validate(config, num_devices=1)
  config.eval.intersections = "sex*age"
  config.eval.min_group_size = -1
  with pytest.raises(ConfigError, match="eval.min_group_size"):
    config_lib.validate(config, num_devices=1)
  with pytest.raises(ValueError, match="'height'.*the dataset has sex, age"):
    intersections.check_attributes([("sex", "height")], ("sex", "age"))


def test_eval_batches_index_every_example_once_over_processes():
  n = 23
  arrays = {
      "image": np.zeros((n, 8, 8, 3), np.uint8),
      "label": np.arange(n, dtype=np.int32) % 3,
      "attributes": np.zeros((n, 1), np.int32),
  }
  seen = []
  for process in range(3):
    for batch in pipeline.eval_batches(
        arrays, batch_size=4, image_size=8, process_index=process, process_count=3
    ):
      real = batch["index"][batch["mask"] > 0]
      np.testing.assert_array_equal(batch["label"][batch["mask"] > 0], arrays["label"][real])
      assert np.all(batch["index"][batch["mask"] == 0] == -1)
      seen.extend(real)
  assert sorted(seen) == list(range(n))


def test_preloaded_split_keeps_the_file_names(tmp_path):
  from PIL import Image

  paths = []
  for name in ("a.jpg", "b.jpg"):
    Image.new("RGB", (10, 10), (200, 10, 10)).save(tmp_path / name)
    paths.append(str(tmp_path / name))
  split = {
      "path": np.array(paths, dtype=object),
      "label": np.zeros(2, np.int32),
      "attributes": np.zeros((2, 1), np.int32),
  }
  assert list(images_lib.preload_images(split, 8)["id"]) == ["a.jpg", "b.jpg"]


# ---------------------------------------------------------------------------
# End to end: the reduced quickstart's run (tests/conftest.py), then other modes on its workdir.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(quickstart_run, tmp_path_factory):
  """A copy of the session's run, which the tests below write into (export/, predict/)."""
  assert quickstart_run.result.returncode == 0, quickstart_run.result.stderr[-3000:]
  workdir = tmp_path_factory.mktemp("predictions_run") / "run"
  shutil.copytree(quickstart_run.workdir, workdir)
  return workdir, quickstart_run.result.stdout


def _read(workdir):
  pd = pytest.importorskip("pandas")
  return pd.read_csv(
      workdir / "predictions.csv",
      keep_default_na=False,
      dtype={"sex": str, "age": str, "site": str},
  )


@pytest.mark.slow
def test_fairlearn_on_predictions_csv_reproduces_the_report(run):
  from fairlearn.metrics import MetricFrame, count, demographic_parity_difference
  from sklearn.metrics import accuracy_score

  workdir, stdout = run
  report = json.loads((workdir / "report.json").read_text())
  df = _read(workdir)
  num_classes = len(report["class_names"])

  assert len(df) == report["num_examples"] == 128
  assert df.example_id.tolist() == list(range(128))  # Synthetic data: the index in the split.
  probs = df[[f"prob_{c}" for c in range(num_classes)]].to_numpy()
  np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-4)
  top_two = np.sort(probs, 1)[:, -2:]
  clear = top_two[:, 1] - top_two[:, 0] > 1e-5  # Rounded ties may pick either class.
  np.testing.assert_array_equal(probs.argmax(1)[clear], df.prediction.to_numpy()[clear])
  expert_columns = [c for c in df if re.fullmatch(r"moe_block\d+/expert_\d+", c)]
  assert expert_columns
  shares = df[expert_columns].to_numpy()
  assert np.all(shares >= 0) and np.all(shares.sum(1) <= 1 + 1e-4) and np.all(shares.sum(1) > 0)

  def frame(features):
    return MetricFrame(
        metrics={"accuracy": accuracy_score, "n": count},
        y_true=df.label,
        y_pred=df.prediction,
        sensitive_features=features,
    )

  def one_vs_rest_dp(features):
    return np.mean(
        [
            demographic_parity_difference(
                df.label == c, df.prediction == c, sensitive_features=features
            )
            for c in range(num_classes)
        ]
    )

  assert frame(df["sex"]).overall["accuracy"] == pytest.approx(report["accuracy"], abs=1e-12)
  for name, attribute in report["attributes"].items():
    by_group = frame(df[name]).by_group
    assert {
        g: {"n": int(row.n), "accuracy": pytest.approx(row.accuracy, abs=1e-12)}
        for g, row in by_group.iterrows()
    } == attribute["groups"]
    assert one_vs_rest_dp(df[name]) == pytest.approx(attribute["dp"], abs=1e-12), name

  entry = report["intersections"]["sex*age"]
  by_group = frame(df[["sex", "age"]]).by_group
  assert {
      f"{sex}*{age}": {"n": int(row.n), "accuracy": pytest.approx(row.accuracy, abs=1e-12)}
      for (sex, age), row in by_group.iterrows()
  } == entry["groups"]
  assert one_vs_rest_dp(df[["sex", "age"]]) == pytest.approx(entry["dp"], abs=1e-12)
  names = (df.sex + "*" + df.age).to_numpy()
  y, p = df.label.to_numpy(), df.prediction.to_numpy()
  ref = reference_metrics(y, p, names, num_classes)
  for m in METRICS:
    assert entry[m] == pytest.approx(ref[m], abs=1e-12), m
  small = {g for g, v in entry["groups"].items() if v["n"] < 10}
  assert set(entry["small_groups"]) == small
  if len(entry["groups"]) - len(small) >= 2:
    large = ~np.isin(names, list(small))
    ref = reference_metrics(y[large], p[large], names[large], num_classes)
    for m in METRICS:
      assert entry["without_small_groups"][m] == pytest.approx(ref[m], abs=1e-12), m
  assert "[sex*age]" in stdout


@pytest.mark.slow
def test_routing_measures_read_a_real_run_consistently(run):
  """fairmoe_jax/analysis/routing.py on a trained run: the split's expert shares in report.json
  are the mean of predictions.csv's per-image shares (every image has as many choices), and the
  utilisation is the report's experts active over E."""
  from fairmoe_jax.analysis import routing

  workdir, _ = run
  report = json.loads((workdir / "report.json").read_text())
  shares = routing.read_expert_columns(str(workdir / "predictions.csv"))
  measures = routing.run_concentration(str(workdir), report)
  assert set(measures) == set(shares) == set(report["experts_active"]["choices"])
  for block, m in measures.items():
    mean = shares[block].mean(axis=0)
    np.testing.assert_allclose(
        mean / mean.sum(), report["expert_share"]["choices"][block], atol=1e-4
    )
    active = report["experts_active"]["choices"][block]
    assert m["utilisation"] == pytest.approx(active / m["num_experts"], rel=1e-4)
    assert m["top_k"] == 2 and 0 < m["image_utilisation"] <= 1
    assert m["uniform_top_k_share"] <= m["top_k_share"] <= 1
  # The validation split's routing, kept in the report, read the same way.
  validation = routing.run_concentration(str(workdir), report, "validation")
  assert set(validation) == set(measures)
  for block, m in validation.items():
    active = report["validation"]["experts_active"]["choices"][block]
    assert m["utilisation"] == pytest.approx(active / m["num_experts"], rel=1e-4)
    assert math.isnan(m["image_utilisation"])
    shares = report["validation"]["expert_share"]["choices"][block]
    assert sum(shares) == pytest.approx(1.0, abs=1e-4)  # Each share rounded to 6 decimals.


@pytest.mark.slow
def test_export_writes_a_timm_state_dict_that_loads_back_into_the_model(run, capsys):
  """--mode=export (in this process: test_workdir_modes.py runs the command), then the file
  loads into a freshly initialised model of the same config and gives back the trained
  parameters (FairSMoE's router and attribute branches included)."""
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  import ml_collections
  from flax import nnx

  from fairmoe_jax import inference
  from fairmoe_jax.methods import METHODS
  from fairmoe_jax.models.convert_timm import export_timm_state_dict, load_timm_checkpoint

  workdir, _ = run
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  path = workdir / "export" / "model.safetensors"
  assert inference.export_checkpoint(config, str(workdir)) == str(path)
  stdout = capsys.readouterr().out
  assert f"to {path}" in stdout
  # Readable by others like every other output (safetensors alone leaves its temp file's 0600).
  assert path.stat().st_mode & 0o044 == (workdir / "report.json").stat().st_mode & 0o044
  exported = safetensors_numpy.load_file(str(path))
  assert "head.weight" in exported and "blocks.1.mlp.experts.fc1.weight" in exported
  assert "blocks.1.mlp.router.attribute_heads.0.weight" in exported  # FairSMoE's SA branch.
  # timm has no MoE block: one line says so and what loads the file, and so does config.json.
  [line] = [l for l in stdout.splitlines() if "timm" in l and "MoE" in l]
  assert "blocks.1" in line and "load_timm_checkpoint" in line and "load_run" in line
  timm_config = json.loads((workdir / "export" / "config.json").read_text())
  assert timm_config["timm_loadable"] is False and "no MoE block" in timm_config["why_not_timm"]

  restored = inference.restore_run(config, str(workdir))
  trained = restored.model
  assert restored.step == QUICKSTART_STEPS
  expected = export_timm_state_dict(trained)
  assert sorted(exported) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)

  fresh = METHODS[config.method].build_model(config, restored.data, nnx.Rngs(params=1), None)
  assert any(  # Initialised, not trained: the load below has work to do.
      not np.array_equal(value, expected[name])
      for name, value in export_timm_state_dict(fresh).items()
  )
  assert load_timm_checkpoint(fresh, str(path), skip=()) == []
  for (name, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(fresh, nnx.Param)),
      nnx.to_flat_state(nnx.state(trained, nnx.Param)),
  ):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(name))


@pytest.mark.slow
def test_predict_on_image_files_gives_the_evaluation_s_predictions(run, tmp_path, capsys):
  """Test images saved as PNG files (lossless) and classified with --mode=predict (in this
  process), from a folder and from a list file, get the probabilities evaluation gave them,
  with no label or sensitive attribute read."""
  import ml_collections
  from PIL import Image

  from fairmoe_jax import inference, train

  workdir, _ = run
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  _, splits = train.load_data(config)
  chosen = [3, 0, 17, 42, 5]
  folder = tmp_path / "images"
  folder.mkdir()
  for i in chosen:
    Image.fromarray(splits["test"]["image"][i]).save(folder / f"test_{i:03d}.png")
  (folder / "notes.txt").write_text("not an image")
  evaluated = _read(workdir).set_index("example_id")

  listing = tmp_path / "list.txt"
  listing.write_text("# a comment\n" + "".join(f"images/test_{i:03d}.png\n" for i in chosen[:2]))
  for source, expected in ((folder, sorted(chosen)), (listing, chosen[:2])):
    config.predict.input = str(source)
    inference.predict_checkpoint(config, str(workdir))
    assert f"Predicted {len(expected)} images" in capsys.readouterr().out
    pd = pytest.importorskip("pandas")
    predicted = pd.read_csv(workdir / "predict" / "predictions.csv", keep_default_na=False)
    assert [int(p[-7:-4]) for p in predicted["path"]] == expected
    probabilities = [c for c in predicted.columns if c.startswith("prob_")]
    np.testing.assert_allclose(
        predicted[probabilities].to_numpy(),
        evaluated.loc[expected, probabilities].to_numpy(),
        atol=2e-5,
    )
    np.testing.assert_array_equal(predicted["prediction"], evaluated.loc[expected, "prediction"])
    assert any(c.endswith("/expert_0") for c in predicted.columns)


@pytest.mark.slow
def test_predict_refuses_routing_by_labels_and_empty_inputs(run, tmp_path):
  import ml_collections

  from fairmoe_jax import inference

  workdir, _ = run
  # The command: exit status 2 and one line naming the key.
  command = [
      sys.executable,
      "-m",
      "fairmoe_jax.main",
      f"--workdir={workdir}",
      *QUICKSTART_RUN_ARGS,
      "--mode=predict",
      "--config.fair.route_by=label",
      f"--config.predict.input={tmp_path}",
  ]
  result = subprocess.run(command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True)
  assert result.returncode == 2 and "config key 'fair.route_by'" in result.stderr, result.stderr
  assert len(result.stderr.strip().splitlines()) == 1
  # The empty inputs, in this process: the same UserError before anything is restored.
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  for source in (str(tmp_path), ""):
    config.predict.input = source
    with pytest.raises(ConfigError, match="^config key 'predict.input'"):
      inference.predict_checkpoint(config, str(workdir))


def test_an_image_named_in_latin_1_is_read_and_its_name_written_escaped(tmp_path):
  # predictions.csv's UTF-8 write raised UnicodeEncodeError and the whole predict was lost.
  from PIL import Image

  from fairmoe_jax.inference import predict_inputs
  from fairmoe_jax.metrics import predictions as predictions_lib

  Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / os.fsdecode(b"caf\xe9.png"))
  (path,) = predict_inputs(str(tmp_path))
  assert images_lib.load_image(path, 8).shape == (8, 8, 3)
  csv_path = tmp_path / "predictions.csv"
  columns = {"path": np.array([path], dtype=object), "class_name": np.array(["b\xe9"], object)}
  predictions_lib.write_csv(str(csv_path), columns)
  rows = csv_path.read_text(encoding="utf-8").splitlines()
  assert rows == ["path,class_name", f"{tmp_path}/caf\\xe9.png,b\xe9"]


def test_predict_names_what_it_skips_and_a_corrupt_image_before_the_restore(
    tmp_path, capsys, monkeypatch
):
  """Other suffixes (an animated GIF) and subfolders were skipped silently, and
  a corrupt image was reported only after the checkpoint was restored and compiled."""
  from PIL import Image

  from fairmoe_jax import inference
  from trainkit.errors import UserError

  folder = tmp_path / "images"
  (folder / "more").mkdir(parents=True)
  Image.new("RGB", (8, 8)).save(folder / "a.png")
  Image.new("RGB", (8, 8)).save(folder / "anim.gif")
  (folder / "b.jpg").write_bytes(b"not a JPEG at all")
  assert inference.predict_inputs(str(folder)) == [str(folder / "a.png"), str(folder / "b.jpg")]
  assert capsys.readouterr().out == (
      f"predict.input: skipped 2 entries of {folder} that are not "
      f"{'/'.join(inference.IMAGE_SUFFIXES)} files (subfolders are not read): anim.gif, more/\n"
  )

  def restore(*args):
    raise AssertionError("restored before the images were checked")

  monkeypatch.setattr(inference, "restore_run", restore)
  config = config_lib.quickstart_config()
  config.predict.input = str(folder)
  with pytest.raises(UserError, match=f"image file {folder / 'b.jpg'} is not a readable image"):
    inference.predict_checkpoint(config, str(tmp_path / "run"))
