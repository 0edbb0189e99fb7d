"""A trained workdir is a self-contained artifact.

Tiny runs are trained on private copies of the ../shared/data samples and predict once the
usual way; then the workdir is copied elsewhere, the original and the data are deleted, and
predict and export run from the copy alone (no --config, no data), eval takes the data's new
location, and `load_run` (the Python API, and the snippets of docs/api.md) reproduces --mode=predict.
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from PIL import Image

from conftest import (
    CAUSAL_TINY_ARGS,
    ENDE,
    ENDE_TINY_DATA,
    ENDE_TINY_MODEL,
    FAIR_TINY_ARGS,
    ONE_DEVICE_XLA_FLAGS,
    REPO_ROOT,
    SHARED_DATA,
)
from trainkit.errors import USER_ERROR_EXIT_CODE

CELEBA = SHARED_DATA / "celeba"
NLI = SHARED_DATA / "nli"

FAIR_ARGS = [*FAIR_TINY_ARGS, "--config.plots=true"]  # One test reads them.
# A tiny Causal Transformer on the MNLI sample (test_causal_cli.py's), without plots.
CAUSAL_ARGS = [
    *(
        a
        for a in CAUSAL_TINY_ARGS
        if not a.startswith(("--config.log_every_steps=", "--config.plots.num_examples="))
    ),
    "--config.plots.num_examples=0",
]
PAIRS = [
    ("A man is sleeping.", "Nobody sleeps."),
    ("The cat sat on the mat.", "A cat sat down."),
    ("Two dogs run in the park.", "Animals are outside."),
]
# The docs/api.md snippets' placeholders, replaced by the tiny runs' paths.
README_FAIR_WORKDIR = '"/tmp/celeba"'
README_IMAGES = '"/path/to/images/*.jpg"'
README_CAUSAL_WORKDIR = '"/tmp/mnli_small"'


def _main(package, *args):
  env = dict(os.environ, XLA_FLAGS=ONE_DEVICE_XLA_FLAGS)  # One device, as a laptop.
  return subprocess.run(
      [sys.executable, "-m", f"{package}.main", *map(str, args)],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _one_line_error(result, *needles):
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


def _celeba_layout(directory):
  """The sample's layout under `directory`: the images linked, the list files copied."""
  directory.mkdir()
  (directory / "img_align_celeba").symlink_to(CELEBA / "img_align_celeba")
  for name in ("list_attr_celeba.txt", "list_eval_partition.txt"):
    shutil.copy(CELEBA / name, directory / name)
  return directory


def _read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def fair_run(tmp_path_factory):
  """A FairSMoE run trained and predicted with on a copy of the CelebA sample; then its workdir
  is copied, and the original workdir and the data are deleted."""
  if not CELEBA.is_dir():
    pytest.skip("../shared/data/celeba absent")
  root = tmp_path_factory.mktemp("fair")
  data = _celeba_layout(root / "data")
  # Images to classify: JPEG files (decoded as predict decodes them) and PNG copies (lossless,
  # so their arrays are exactly what predict reads from the files).
  images = root / "images"
  images.mkdir()
  names = sorted(p.name for p in (CELEBA / "img_align_celeba").iterdir())[:5]
  for name in names:
    shutil.copy(CELEBA / "img_align_celeba" / name, images / name)
    Image.open(images / name).save(images / f"{name[:-4]}.png")
  trained = root / "trained"
  config = f"--config={REPO_ROOT / 'configs/celeba.py'}:size=small,epochs=1"
  common = [config, f"--workdir={trained}", f"--config.data.root={data}", *FAIR_ARGS]
  trained_stdout = _ok(_main("fairmoe_jax", *common)).stdout
  # Predict as before: the training command's config, with the data in place.
  _ok(_main("fairmoe_jax", *common, "--mode=predict", f"--config.predict.input={images}"))
  run = types.SimpleNamespace(
      images=images,
      report=json.loads((trained / "report.json").read_text()),
      evaluated=(trained / "predictions.csv").read_text(),
      predicted=(trained / "predict" / "predictions.csv").read_text(),
      workdir=root / "copy",
      data=data,
      stdout=trained_stdout,
  )
  shutil.copytree(trained, run.workdir)
  shutil.rmtree(trained)
  shutil.rmtree(data)  # Removes the link to the shared images, not the images.
  return run


def test_fairmoe_predict_and_export_from_the_workdir_alone(fair_run):
  workdir = fair_run.workdir
  assert json.loads((workdir / "run_info.json").read_text())["class_names"] == (
      fair_run.report["class_names"]
  )
  (workdir / "predict" / "predictions.csv").unlink()
  # With an override on top of the saved config: a batch size that changes no prediction.
  result = _ok(
      _main(
          "fairmoe_jax",
          f"--workdir={workdir}",
          "--mode=predict",
          f"--config.predict.input={fair_run.images}",
          "--config.eval_batch_size=16",
      )
  )
  assert "Predicted 10 images" in result.stdout
  rows, expected = _read_csv(workdir / "predict" / "predictions.csv"), _read_csv_text(
      fair_run.predicted
  )
  assert rows[0].keys() == expected[0].keys()
  for column in rows[0]:
    got, want = [r[column] for r in rows], [r[column] for r in expected]
    if column in ("path", "prediction", "class_name"):
      assert got == want, column
    else:  # Probabilities and expert shares, written to 6 significant digits.
      np.testing.assert_allclose(np.float64(got), np.float64(want), atol=1e-5, err_msg=column)

  result = _ok(_main("fairmoe_jax", f"--workdir={workdir}", "--mode=export"))
  path = workdir / "export" / "model.safetensors"
  assert f"to {path}" in result.stdout
  from safetensors import safe_open

  with safe_open(str(path), framework="numpy") as f:
    metadata = f.metadata()
    exported = {name: f.get_tensor(name) for name in f.keys()}
  assert json.loads(metadata["class_names"]) == fair_run.report["class_names"]
  assert metadata["step"] == str(fair_run.report["step"])
  assert "blocks.0.mlp.router.attribute_heads.0.weight" in exported  # FairSMoE's SA branch.
  # The trained parameters, as load_run restores them from the same copy.
  import fairmoe_jax
  from fairmoe_jax.models.convert_timm import export_timm_state_dict

  expected_state = export_timm_state_dict(fairmoe_jax.load_run(workdir).model)
  assert sorted(exported) == sorted(expected_state)
  for name, value in expected_state.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)


def _read_csv_text(text):
  return list(csv.DictReader(text.splitlines()))


def test_fairmoe_eval_names_the_data_key_and_takes_its_new_location(fair_run, tmp_path):
  workdir = fair_run.workdir
  result = _main("fairmoe_jax", f"--workdir={workdir}", "--mode=eval")
  _one_line_error(result, "'data.root'", str(fair_run.data), "--config.data.root=DIR")
  moved = _celeba_layout(tmp_path / "moved")
  _ok(_main("fairmoe_jax", f"--workdir={workdir}", "--mode=eval", f"--config.data.root={moved}"))
  report = json.loads((workdir / "report.json").read_text())
  assert (report["step"], report["accuracy"]) == (
      fair_run.report["step"],
      fair_run.report["accuracy"],
  )
  assert (workdir / "predictions.csv").read_text() == fair_run.evaluated
  # config.json stays the trained one: the override was for this evaluation only.
  assert json.loads((workdir / "config.json").read_text())["data"]["root"] == str(fair_run.data)


def test_celeba_sample_trains_fairsmoe_and_evaluates_on_another_copy(fair_run, tmp_path):
  assert "rows_without_image=0" in fair_run.stdout  # The load report is printed.
  report = fair_run.report
  assert report["method"] == "fairsmoe" and report["num_examples"] == 96
  assert set(report["attributes"]) == {"Male"}
  usage = report["expert_utilisation"]["moe_block0"]["Male"]
  assert set(usage) == {"not_Male", "Male"} and all(len(v) == 4 for v in usage.values())
  assert (fair_run.workdir / "plots" / "expert_activation_moe_block0.png").is_file()

  # Evaluate the trained model (a copy: other tests read this one) on another copy of the
  # layout (here: a subset of the rows).
  workdir = shutil.copytree(fair_run.workdir, tmp_path / "run")
  copy = tmp_path / "copy"
  copy.mkdir()
  (copy / "img_align_celeba").symlink_to(CELEBA / "img_align_celeba")
  lines = (CELEBA / "list_attr_celeba.txt").read_text().splitlines()
  (copy / "list_attr_celeba.txt").write_text("\n".join(lines[:2] + lines[-50:]) + "\n")
  (copy / "list_eval_partition.txt").symlink_to(CELEBA / "list_eval_partition.txt")
  _ok(_main("fairmoe_jax", f"--workdir={workdir}", "--mode=eval", f"--config.data.root={copy}"))
  report_copy = json.loads((workdir / "report.json").read_text())
  assert report_copy["step"] == report["step"]
  assert report_copy["num_examples"] == 50  # The copy's test split, not the original's.
  assert "validation" not in report_copy  # The copy has no validation rows.


def test_fairmoe_load_run_reproduces_predict_mode(fair_run):
  import fairmoe_jax

  run = fairmoe_jax.load_run(fair_run.workdir)
  assert run.step == fair_run.report["step"] and run.config.method == "fairsmoe"
  assert list(run.metadata.class_names) == fair_run.report["class_names"]
  assert run.metadata.attribute_names == ("Male",)
  assert run.metadata.group_names == (("not_Male", "Male"),)
  assert run.metadata.preprocessing.image_size == 32
  assert isinstance(run.config.moe.blocks, tuple)  # Read back with the base config's types.

  expected = _read_csv_text(fair_run.predicted)  # One row per file, sorted by path.
  paths = [r["path"] for r in expected]
  result = run.predict(paths)
  assert result.class_names == [r["class_name"] for r in expected]
  np.testing.assert_array_equal(result.classes, [int(r["prediction"]) for r in expected])
  for c in range(2):  # predictions.csv rounds to 6 significant digits.
    np.testing.assert_allclose(
        result.probabilities[:, c], [float(r[f"prob_{c}"]) for r in expected], atol=1e-6
    )
  for e in range(4):
    np.testing.assert_allclose(
        result.experts["moe_block0"][:, e],
        [float(r[f"moe_block0/expert_{e}"]) for r in expected],
        atol=1e-6,
    )

  # Arrays of the PNG files' pixels (any size; uint8 or floats in [0, 1]) are the files.
  pngs = [p for p in paths if p.endswith(".png")]
  from_files = run.predict(pngs)
  pixels = [np.asarray(Image.open(p)) for p in pngs]
  assert pixels[0].shape == (218, 178, 3)  # Not the model's 32 x 32: resized and cropped.
  for images in (pixels, [p / 255.0 for p in pixels]):
    from_arrays = run.predict(images)
    np.testing.assert_array_equal(from_arrays.probabilities, from_files.probabilities)

  # The model itself on the documented preprocessing gives the same probabilities.
  from fairmoe_jax.data.images import square_resize

  preprocessing = run.metadata.preprocessing
  inputs = np.stack([square_resize(Image.fromarray(p), preprocessing.image_size) for p in pixels])
  inputs = (inputs / 255.0 - np.array(preprocessing.mean)) / np.array(preprocessing.std)
  logits, _ = run.model(inputs.astype(np.float32), train=False, context=None)
  probabilities = np.asarray(jax.nn.softmax(logits, -1))
  np.testing.assert_allclose(probabilities, from_files.probabilities, atol=1e-5)

  with pytest.raises(TypeError, match=r"for one file, pass \["):
    run.predict(pngs[0])
  with pytest.raises(ValueError, match=r"image 0: expected an RGB array \[H, W, 3\]"):
    run.predict([pixels[0][..., 0]])
  with pytest.raises(ValueError, match=r"image 0: float pixels must lie in \[0, 1\]"):
    run.predict([pixels[0] * 1.0])


def _readme_block(heading_text, index):
  api = (REPO_ROOT / "docs" / "api.md").read_text()
  section = api.split("\n## Using a trained run from Python\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2, "the section has the fairmoe_jax and the causal_attn_jax snippets"
  assert heading_text in blocks[index]
  return blocks[index]


def test_readme_fairmoe_snippet_runs_on_a_trained_workdir(fair_run, capsys):
  block = _readme_block("fairmoe_jax.load_run(", 0)
  assert README_FAIR_WORKDIR in block and README_IMAGES in block
  code = block.replace(README_FAIR_WORKDIR, repr(str(fair_run.workdir))).replace(
      README_IMAGES, repr(str(fair_run.images / "*.jpg"))
  )
  exec(compile(code, "docs/api.md, Using a trained run from Python, block 1", "exec"), {})
  out = capsys.readouterr().out.splitlines()
  predicted = [r for r in _read_csv_text(fair_run.predicted) if r["path"].endswith(".jpg")]
  assert [line.split()[0] for line in out[1:]] == [r["class_name"] for r in predicted]


def test_train_needs_a_config_and_other_modes_a_trained_workdir(tmp_path):
  result = _main("fairmoe_jax", f"--workdir={tmp_path / 'run'}")
  _one_line_error(result, "--config is required with --mode=train")
  result = _main("causal_attn_jax", f"--workdir={tmp_path / 'run'}", "--config.batch_size=8")
  _one_line_error(result, "--config is required with --mode=train")
  for package, mode in (("fairmoe_jax", "export"), ("causal_attn_jax", "predict")):
    result = _main(package, f"--workdir={tmp_path / 'run'}", f"--mode={mode}")
    _one_line_error(
        result, f"--mode={mode} without --config", str(tmp_path / "run" / "config.json")
    )
  assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def causal_run(tmp_path_factory):
  """A pair classifier trained and predicted with on a copy of the MNLI sample; then its
  workdir is copied, and the original workdir and the data are deleted."""
  if not NLI.is_dir():
    pytest.skip("../shared/data/nli absent")
  root = tmp_path_factory.mktemp("causal")
  data = root / "data"
  data.mkdir()
  shutil.copy(NLI / "mnli_dev_matched.tsv", data / "train.tsv")
  pairs = root / "pairs.tsv"
  pairs.write_text("".join(f"{p}\t{h}\n" for p, h in PAIRS))
  trained = root / "trained"
  config = f"--config={REPO_ROOT / 'configs/mnli_hans.py'}:size=small,steps=4"
  common = [config, f"--workdir={trained}", f"--config.data.train_file={data / 'train.tsv'}"]
  _ok(_main("causal_attn_jax", *common, *CAUSAL_ARGS))
  _ok(
      _main(
          "causal_attn_jax",
          *common,
          *CAUSAL_ARGS,
          "--mode=predict",
          f"--config.predict.input={pairs}",
      )
  )
  run = types.SimpleNamespace(
      pairs=pairs,
      predicted=(trained / "predict" / "predictions.tsv").read_text(),
      workdir=root / "copy",
  )
  shutil.copytree(trained, run.workdir)
  shutil.rmtree(trained)
  shutil.rmtree(data)
  return run


def test_causal_predict_from_the_workdir_alone(causal_run):
  workdir = causal_run.workdir
  (workdir / "predict" / "predictions.tsv").unlink()
  result = _ok(
      _main(
          "causal_attn_jax",
          f"--workdir={workdir}",
          "--mode=predict",
          f"--config.predict.input={causal_run.pairs}",
      )
  )
  assert "Predicted 3 inputs" in result.stdout
  assert (workdir / "predict" / "predictions.tsv").read_text() == causal_run.predicted
  # Evaluation needs the data: the message names the key that says where it is now.
  result = _main("causal_attn_jax", f"--workdir={workdir}", "--mode=eval")
  _one_line_error(result, "'data.train_file'", "--config.data.train_file=FILE")


def test_causal_load_run_reproduces_predict_mode(causal_run, capsys):
  import causal_attn_jax

  run = causal_attn_jax.load_run(causal_run.workdir)
  assert run.metadata.task == "classification"
  assert run.metadata.label_names == ("entailment", "neutral", "contradiction")
  assert run.step == 4 and run.config.model.attention == "causal"
  expected = list(csv.DictReader(causal_run.predicted.splitlines(), delimiter="\t"))
  result = run.predict_pairs(PAIRS)
  assert result.labels == [r["prediction"] for r in expected]
  for c, label in enumerate(run.metadata.label_names):
    np.testing.assert_allclose(
        result.probabilities[:, c], [float(r[f"prob_{label}"]) for r in expected], atol=1e-6
    )
  with pytest.raises(TypeError, match="translate needs a translation run"):
    run.translate(["A sentence."])
  with pytest.raises(TypeError, match=r"pair 0: expected \(premise, hypothesis\) strings"):
    run.predict_pairs(["just one sentence"])

  block = _readme_block("causal_attn_jax.load_run(", 1)
  assert README_CAUSAL_WORKDIR in block
  code = block.replace(README_CAUSAL_WORKDIR, repr(str(causal_run.workdir)))
  exec(compile(code, "docs/api.md, Using a trained run from Python, block 2", "exec"), {})
  out = capsys.readouterr().out
  assert str(run.predict_pairs([PAIRS[0]]).labels) in out


@pytest.mark.skipif(not ENDE.is_dir(), reason="needs ../shared/data/translation")
def test_causal_load_run_translates_as_predict_mode(tmp_path):
  import causal_attn_jax
  from causal_attn_jax import config as config_lib
  from causal_attn_jax import inference, train

  data = tmp_path / "data"
  data.mkdir()
  copies = {}  # The tiny run's data files, copied: removed after training.
  for key in ("data.train_source", "data.train_target", "data.eval_source", "data.eval_target"):
    copies[key] = str(shutil.copy(ENDE_TINY_DATA[key], data))
  config = config_lib.paper_config(task="translation", size="small", attention="causal", steps=4)
  config.update_from_flattened_dict(
      {
          **ENDE_TINY_DATA,
          **copies,
          "data.max_eval_examples": 8,
          **ENDE_TINY_MODEL,
          "eval_every_steps": 0,
          "checkpoint_every_steps": 4,
          "plots.num_examples": 0,
      }
  )
  config_lib.validate(config, num_devices=jax.device_count())
  workdir = tmp_path / "run"
  train.train_and_evaluate(config, str(workdir))
  sources = [line for line in (data / "src-val.txt").read_text().splitlines()[:3]]
  (tmp_path / "sources.txt").write_text("".join(line + "\n" for line in sources))
  shutil.rmtree(data)

  run = causal_attn_jax.load_run(workdir)
  assert run.metadata.task == "translation" and run.metadata.label_names == ()
  translations = run.translate(sources)
  config.predict.input = str(tmp_path / "sources.txt")
  with open(inference.predict_checkpoint(config, str(workdir)), newline="") as f:
    rows = list(csv.DictReader(f, delimiter="\t"))
  assert translations == [r["translation"] for r in rows]
  with pytest.raises(TypeError, match="predict_pairs needs a classification run"):
    run.predict_pairs(PAIRS)


def test_a_one_slash_uri_workdir_is_refused_up_front(tmp_path):
  # `gs:/bucket/run` is a local path to the system: the run trained until its first
  # checkpoint, crashed there in TensorStore, and left a `gs:` tree in the current directory.
  from trainkit import storage
  from trainkit.errors import UserError

  for typo, meant in (
      ("gs:/bucket/run", "gs://bucket/run"),
      ("gs:bucket/run", "gs://bucket/run"),
      ("s3:/bucket/run", "s3://bucket/run"),
  ):
    with pytest.raises(UserError, match=f"did you mean {meant}"):
      storage.resolve(typo)
  assert storage.resolve("gsx:/run") == os.path.abspath("gsx:/run")  # Not a URI scheme of ours.
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "fairmoe_jax.main",
          f"--config={REPO_ROOT / 'configs/quickstart.py'}",
          "--workdir=gs:/bucket/run",
      ],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=300,
  )
  _one_line_error(result, "'gs:/bucket/run' is not a gs:// URI", "did you mean gs://bucket/run?")
  assert list(tmp_path.iterdir()) == []


def test_a_workdir_through_a_link_and_dot_dot_is_where_the_system_resolves_it(tmp_path):
  # `link/../run` with `link` -> `a/b`: the system's `run` is `a/run`; abspath made it
  # `./run`, a folder the user never named.
  from trainkit.workdir import prepare_workdir

  tmp_path = tmp_path.resolve()  # Itself free of links, so the expected path is exact.
  (tmp_path / "a" / "b").mkdir(parents=True)
  (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
  given = str(tmp_path / "link" / ".." / "run")
  assert prepare_workdir(given) == str(tmp_path / "a" / "run")
  assert (tmp_path / "a" / "run").is_dir() and not (tmp_path / "run").exists()
  assert os.path.samefile(given, tmp_path / "a" / "run")
