"""--mode=export's config.json tells the truth about model.safetensors.

timm is not a test dependency, so the file is read as timm reads it: the architecture is rebuilt
from `model_args` with timm's meaning of each argument, but with our own model code, and the
weights go in through our converter with every key used and none skipped; the outputs must be
the trained model's. The stated preprocessing is checked against timm's eval transform written
out from its definition (short side to size / crop_pct, bicubic, centre crop).
"""

import contextlib
import io
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from PIL import Image

from conftest import REPO_ROOT
from conftest import one_device_env as _env
from fairmoe_jax import config as config_lib
from fairmoe_jax import export
from fairmoe_jax.data import augment
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.models import SwinTransformer, VisionTransformer
from fairmoe_jax.models.backbones import build_backbone
from fairmoe_jax.models.convert_timm import export_timm_state_dict, load_timm_checkpoint
from fairmoe_jax.run_info import Preprocessing, RunMetadata
from trainkit.errors import USER_ERROR_EXIT_CODE, UserError

# The timm constructor arguments the rebuilders below interpret; any other is a failure, so a
# new argument in the export cannot be silently ignored here.
VIT_ARGS = {
    "img_size",
    "patch_size",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "num_classes",
    "class_token",
    "global_pool",
    "qkv_bias",
}
SWIN_ARGS = {
    "img_size",
    "patch_size",
    "window_size",
    "embed_dim",
    "depths",
    "num_heads",
    "mlp_ratio",
    "num_classes",
    "global_pool",
}
METADATA = RunMetadata(
    dataset="synthetic",
    class_names=("a", "b", "c"),
    attribute_names=("sex",),
    group_names=(("male", "female"),),
    preprocessing=Preprocessing(image_size=32),
)


def _vit_from_timm_args(cfg):
  """Our ViT built from a timm VisionTransformer's arguments (timm's meaning of each)."""
  args = cfg["model_args"]
  assert cfg["architecture"].startswith(("vit_", "deit_")), cfg["architecture"]
  assert set(args) == VIT_ARGS, set(args) ^ VIT_ARGS
  # What our ViT is: a class token read after the final norm, qkv with biases.
  assert args["class_token"] is True and args["global_pool"] == "token" and args["qkv_bias"]
  return VisionTransformer(
      num_classes=args["num_classes"],
      image_size=args["img_size"],
      patch_size=args["patch_size"],
      dim=args["embed_dim"],
      depth=args["depth"],
      num_heads=args["num_heads"],
      mlp_dim=int(args["embed_dim"] * args["mlp_ratio"]),  # timm's Block: int(dim * mlp_ratio).
      moe=None,
      rngs=nnx.Rngs(params=123),
  )


def _swin_from_timm_args(cfg):
  """Our Swin built from a timm SwinTransformer's arguments (timm's meaning of each)."""
  args = cfg["model_args"]
  assert cfg["architecture"].startswith("swin_"), cfg["architecture"]
  assert set(args) == SWIN_ARGS, set(args) ^ SWIN_ARGS
  assert args["global_pool"] == "avg"
  return SwinTransformer(
      num_classes=args["num_classes"],
      image_size=args["img_size"],
      patch_size=args["patch_size"],
      embed_dim=args["embed_dim"],
      depths=args["depths"],
      num_heads=args["num_heads"],
      window_size=args["window_size"],
      mlp_ratio=args["mlp_ratio"],
      moe=None,
      rngs=nnx.Rngs(params=123),
  )


def _check_pretrained_cfg(cfg, class_names, image_size):
  pre = cfg["pretrained_cfg"]
  assert pre["input_size"] == [3, image_size, image_size] and pre["fixed_input_size"] is True
  assert (pre["interpolation"], pre["crop_pct"], pre["crop_mode"]) == ("bicubic", 1.0, "center")
  assert pre["mean"] == pre["std"] == [0.5, 0.5, 0.5]
  assert pre["num_classes"] == cfg["num_classes"] == cfg["model_args"]["num_classes"]
  assert cfg["label_names"] == list(class_names)


def _images(size, n=3):
  return np.random.default_rng(0).uniform(-1.0, 1.0, (n, size, size, 3)).astype(np.float32)


# --- A trained dense run (multifair: a plain ViT) -------------------------------------------------


@pytest.fixture(scope="module")
def exported_run(dense_run, tmp_path_factory):
  """A copy of the session's dense run (tests/conftest.py), exported in this process."""
  import ml_collections

  from fairmoe_jax import inference

  workdir = tmp_path_factory.mktemp("dense_export") / "run"
  shutil.copytree(dense_run.workdir, workdir)
  # export/config.json planted as a link to a file outside the workdir: the export replaces it,
  # never writing through (test_export_where_a_file_or_a_planted_link_is_refused_or_replaced).
  outside = tmp_path_factory.mktemp("outside") / "outside.json"
  outside.write_text("precious")
  (workdir / "export").mkdir()
  (workdir / "export" / "config.json").symlink_to(outside)
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  with contextlib.redirect_stdout(io.StringIO()) as stdout:
    inference.export_checkpoint(config, str(workdir))
  return workdir, stdout.getvalue(), outside


@pytest.mark.slow
def test_dense_export_rebuilds_from_its_config_with_the_trained_outputs(exported_run):
  import fairmoe_jax

  workdir, stdout, _ = exported_run
  cfg = json.loads((workdir / "export" / "config.json").read_text())
  run_info = json.loads((workdir / "run_info.json").read_text())
  assert cfg["timm_loadable"] is True and "why_not_timm" not in cfg
  assert f"timm: {cfg['architecture']}" in stdout
  _check_pretrained_cfg(cfg, run_info["class_names"], run_info["preprocessing"]["image_size"])
  assert cfg["fairmoe_jax"]["method"] == "multifair" and cfg["fairmoe_jax"]["moe_blocks"] == []

  rebuilt = _vit_from_timm_args(cfg)
  path = str(workdir / "export" / cfg["fairmoe_jax"]["weights"])
  # Strict: every parameter found, nothing skipped, no checkpoint tensor left over.
  assert load_timm_checkpoint(rebuilt, path, skip=(), upcycle_moe=False) == []
  trained = fairmoe_jax.load_run(workdir).model
  images = _images(cfg["model_args"]["img_size"])
  np.testing.assert_allclose(
      np.asarray(rebuilt(images, train=False)[0]),
      np.asarray(trained(images, train=False)[0]),
      rtol=0,
      atol=1e-6,
  )


def test_moe_export_says_timm_cannot_load_it(tmp_path):
  """A FairSMoE model (no training needed: the config is about the architecture)."""
  config = config_lib.base_config()
  config.data.image_size = 32
  model = build_backbone(config, 3, dict(num_experts=4, top_k=2), nnx.Rngs(params=0))
  cfg = export.timm_config(model, export_timm_state_dict(model), config, METADATA, step=5)
  assert cfg["timm_loadable"] is False
  assert "blocks.3" in cfg["why_not_timm"] and "timm has no MoE block" in cfg["why_not_timm"]
  assert "load_timm_checkpoint" in cfg["load_with"] and "load_run" in cfg["load_with"]
  assert cfg["fairmoe_jax"]["moe_blocks"] == ["blocks.3"]
  _check_pretrained_cfg(cfg, METADATA.class_names, 32)


def test_muffin_export_says_timm_cannot_load_it():
  from fairmoe_jax.methods import METHODS

  config = config_lib.base_config()
  config.method = "muffin"
  config.data.image_size = 32
  metadata = RunMetadata(
      "synthetic", ("a", "b", "c"), ("sex", "age"), (("m", "f"), ("y", "o")), Preprocessing(32)
  )
  model = METHODS["muffin"].build_model(config, metadata.dataset_info(), nnx.Rngs(params=0), None)
  cfg = export.timm_config(model, export_timm_state_dict(model), config, metadata, step=5)
  assert cfg["timm_loadable"] is False and "Muffin fuses 2 vit backbones" in cfg["why_not_timm"]
  # Each backbone is a plain ViT: the arguments describe one.
  assert cfg["model_args"]["depth"] == config.model.depth and cfg["fairmoe_jax"]["moe_blocks"] == []


@pytest.mark.slow
def test_swin_export_rebuilds_from_its_config(tmp_path):
  """The same for a dense Swin (the tiny CPU one), without training: the export of any weights."""
  from safetensors.numpy import save_file

  config = config_lib.base_config()
  config.model.backbone = "swin_tiny_cpu"
  config.data.image_size = 32
  model = build_backbone(config, 3, None, nnx.Rngs(params=0))
  state = export_timm_state_dict(model)
  cfg = export.timm_config(model, state, config, METADATA, step=5)
  assert cfg["architecture"] == "swin_tiny_patch4_window7_224" and cfg["timm_loadable"]
  assert cfg["pretrained_cfg"]["classifier"] == "head.fc"
  _check_pretrained_cfg(cfg, METADATA.class_names, 32)
  path = str(tmp_path / "model.safetensors")
  save_file(state, path)
  rebuilt = _swin_from_timm_args(cfg)
  assert load_timm_checkpoint(rebuilt, path, skip=(), upcycle_moe=False) == []
  images = _images(32)
  np.testing.assert_allclose(
      np.asarray(rebuilt(images, train=False)[0]),
      np.asarray(model(images, train=False)[0]),
      rtol=0,
      atol=1e-6,
  )


def test_deit_small_is_named_by_timm():
  config = config_lib.base_config()
  config.model.backbone = "deit_s"
  config.model.patch_size = 16
  config.data.image_size = 224
  model = build_backbone(config, 2, None, nnx.Rngs(params=0))
  cfg = export.timm_config(model, export_timm_state_dict(model), config, METADATA, step=1)
  assert cfg["architecture"] == "deit_small_patch16_224"
  args = cfg["model_args"]
  assert (args["img_size"], args["patch_size"], args["embed_dim"], args["depth"]) == (
      224,
      16,
      384,
      12,
  )
  assert (args["num_heads"], args["mlp_ratio"], args["num_classes"]) == (6, 4.0, 2)


# --- The stated preprocessing -------------------------------------------------------------------


def _timm_eval_transform(image, size, crop_pct, interpolation):
  """timm's eval transform (crop_mode="center") on a PIL image, before normalisation: torchvision
  Resize(floor(size / crop_pct)) on the short side, then CenterCrop(size)."""
  assert interpolation == "bicubic"
  scale = math.floor(size / crop_pct)
  width, height = image.size
  if width <= height:
    new = (scale, int(scale * height / width))
  else:
    new = (int(scale * width / height), scale)
  image = image.resize(new, Image.BICUBIC)
  left = int(round((new[0] - size) / 2.0))
  top = int(round((new[1] - size) / 2.0))
  return np.asarray(image.crop((left, top, left + size, top + size)))


def test_stated_preprocessing_is_the_pipeline_s(tmp_path):
  """load_image + normalize equal timm's transform with the exported pretrained_cfg (up to the
  sub-pixel rounding of the crop), and a crop_pct timm uses by default does not."""
  size = 32
  config = config_lib.base_config()
  config.data.image_size = size
  config.method = "multifair"
  model = build_backbone(config, 3, None, nnx.Rngs(params=0))
  cfg = export.timm_config(model, export_timm_state_dict(model), config, METADATA, step=0)
  pre = cfg["pretrained_cfg"]
  yy, xx = np.mgrid[0:90, 0:130]  # Landscape, smooth: differences come from geometry only.
  pixels = np.stack(
      [127 + 120 * np.sin(xx / 9.0), 127 + 120 * np.cos(yy / 7.0), (xx + yy) % 256], -1
  ).astype(np.uint8)
  path = tmp_path / "image.png"
  Image.fromarray(pixels).save(path)

  ours = augment.normalize(images_lib.load_image(path, size))
  mean, std = np.asarray(pre["mean"]), np.asarray(pre["std"])

  def timm_input(crop_pct):
    image = _timm_eval_transform(Image.open(path), size, crop_pct, pre["interpolation"])
    return (image / 255.0 - mean) / std

  stated = np.abs(timm_input(pre["crop_pct"]) - ours).mean()
  default = np.abs(timm_input(0.875) - ours).mean()
  assert stated < 0.01, stated  # 1.3 levels of 255 (0.4 measured): sub-pixel rounding.
  assert default > 5 * stated, (default, stated)


@pytest.mark.slow
def test_export_where_a_file_or_a_planted_link_is_refused_or_replaced(exported_run, tmp_path):
  workdir = tmp_path / "copy"
  shutil.copytree(exported_run[0], workdir, symlinks=True)
  shutil.rmtree(workdir / "export")

  # export/ is a file: one line naming it (it was a FileExistsError traceback).
  (workdir / "export").write_text("not a folder")
  result = subprocess.run(
      [sys.executable, "-m", "fairmoe_jax.main", f"--workdir={workdir}", "--mode=export"],
      cwd=REPO_ROOT,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(f"error: '{workdir / 'export'}' (or a folder above it) is a file"), line
  # export/config.json was a link to a file outside the workdir (planted before exported_run's
  # export): replaced, never written through.
  trained, _, outside = exported_run
  assert outside.read_text() == "precious"
  assert not (trained / "export" / "config.json").is_symlink()
  assert json.loads((trained / "export" / "config.json").read_text())["timm_loadable"] is True


@pytest.mark.slow
def test_export_or_predict_as_a_link_to_a_folder_outside_the_workdir_is_refused(
    exported_run, tmp_path
):
  # Round three kept single files from being written through a planted link; a link in place
  # of the export/ or predict/ folder still had model.safetensors, config.json and
  # predictions.csv written to the folder it points to.
  workdir = tmp_path / "copy"
  shutil.copytree(exported_run[0], workdir, symlinks=True)
  shutil.rmtree(workdir / "export")
  images = tmp_path / "images"
  images.mkdir()
  Image.new("RGB", (32, 32)).save(images / "a.png")
  import ml_collections

  from fairmoe_jax import inference

  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  config.predict.input = str(images)
  # In this process (the command's one-line error is the test above's).
  for folder, write in (
      ("export", inference.export_checkpoint),
      ("predict", inference.predict_checkpoint),
  ):
    outside = tmp_path / f"outside_{folder}"
    outside.mkdir()
    (workdir / folder).symlink_to(outside)
    with pytest.raises(UserError) as refused:
      write(config, str(workdir))
    assert str(refused.value).startswith(
        f"'{workdir / folder}' is a symbolic link to {outside}, outside the workdir"
    ), refused.value
    assert list(outside.iterdir()) == []  # Nothing written there.
  # A link to a folder inside the workdir stays allowed.
  (workdir / "export").unlink()
  (workdir / "exports").mkdir()
  (workdir / "export").symlink_to(workdir / "exports")
  from trainkit.workdir import output_folder

  assert output_folder(str(workdir), "export") == str(workdir / "export")


@pytest.mark.slow
def test_predict_refuses_special_files_without_hanging_and_reads_a_list_from_stdin(
    exported_run, tmp_path
):
  # A FIFO among the images hung --mode=predict until killed (a stale lock left);
  # `--config.predict.input=/dev/stdin` (a pipe) said "list file does not exist".
  import os
  import socket

  workdir = tmp_path / "copy"
  shutil.copytree(exported_run[0], workdir, symlinks=True)
  images = tmp_path / "images"
  images.mkdir()
  Image.new("RGB", (32, 32), (200, 10, 10)).save(images / "a.png")

  def predict(source, **kwargs):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fairmoe_jax.main",
            f"--workdir={workdir}",
            "--mode=predict",
            f"--config.predict.input={source}",
        ],
        cwd=kwargs.pop("cwd", REPO_ROOT),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )

  # A list on stdin: its relative paths are read from the current folder.
  result = predict("/dev/stdin", input="a.png\n", cwd=images)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = (workdir / "predict" / "predictions.csv").read_text().splitlines()
  assert len(rows) == 2 and rows[1].startswith(f"{images / 'a.png'},"), rows
  # Special files with an image's name: one line naming the file and its kind, before the run
  # restores anything; and the image reader refuses them too (a list file may name one).
  os.mkfifo(images / "b.jpg")
  result = predict(images)
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  (line,) = result.stderr.strip().splitlines()
  assert line == (
      f"error: config key 'predict.input': {images / 'b.jpg'} is a named pipe (FIFO), not an "
      f"image file: predict reads regular files; move it out of {images}"
  ), line
  assert not (workdir / ".run.lock").exists()
  os.remove(images / "b.jpg")
  with socket.socket(socket.AF_UNIX) as server:
    server.bind(str(images / "c.png"))
    (images / "d.jpg").mkdir()
    from fairmoe_jax.inference import predict_inputs

    with pytest.raises(UserError, match=r"c\.png is a socket, not an image file \(and 1 more\)"):
      predict_inputs(str(images))
  os.mkfifo(tmp_path / "e.jpg")
  with pytest.raises(UserError, match=r"e\.jpg is a named pipe \(FIFO\), not an image file"):
    images_lib.load_image(tmp_path / "e.jpg", 32)  # Not opened: that would block.


@pytest.mark.slow
def test_an_evaluation_step_that_cannot_fit_is_refused_naming_eval_batch_size(
    exported_run, monkeypatch
):
  import fairmoe_jax
  from trainkit import fits

  run = fairmoe_jax.load_run(exported_run[0])
  images = (np.random.default_rng(0).uniform(0, 1, (3, 32, 32, 3))).astype(np.float32)
  assert run.predict(images) is not None  # It fits as it is.
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 16)  # A 16-byte device.
  with pytest.raises(UserError, match=r"the evaluation step needs .* make the model smaller"):
    run.predict(images)  # 3 images in a small batch: the parameters are most of the memory.
  large = fairmoe_jax.load_run(exported_run[0], overrides={"eval_batch_size": 4096})
  with pytest.raises(
      UserError, match=r"the evaluation step needs .* lower eval_batch_size \(now 4096\)"
  ):
    large.predict(images)  # Padded to 4096 rows: the activations are.
