"""A trained run: restoring it from its workdir, predicting and exporting, for the command line
(`--mode=predict`, `--mode=export`) and Python (`load_run`).

    import fairmoe_jax

    run = fairmoe_jax.load_run("/tmp/fairmoe_quickstart")
    result = run.predict(["a.png", "b.jpg"])  # or uint8 images [N, H, W, 3]
    result.probabilities, result.class_names

Only the workdir is read (config.json, run_info.json, latest checkpoint); predictions use
`--mode=predict`'s batches, preprocessing and eval step (`evaluation.make_eval_step`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from PIL import Image

from fairmoe_jax import config as config_lib
from fairmoe_jax import evaluation, train
from fairmoe_jax import export as export_lib
from fairmoe_jax.data import DatasetInfo
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.methods import METHODS
from fairmoe_jax.metrics import predictions as predictions_lib
from fairmoe_jax.models.convert_timm import export_timm_state_dict
from fairmoe_jax.run_info import RunMetadata
from trainkit import storage, trained_run
from trainkit.errors import ConfigError, import_extra
from trainkit.saved_config import restore_saved_run
from trainkit.storage import write_atomically
from trainkit.textfiles import is_stream, iter_lines, special_file_kind
from trainkit.workdir import output_folder


def restore_run(config: ml_collections.ConfigDict, workdir: str) -> TrainedRun:
  """The latest readable checkpoint of `workdir` (UserError if none), from the workdir alone;
  its `data` is the run's DatasetInfo."""
  metadata = RunMetadata.load(workdir)
  return TrainedRun.restore(config, workdir, metadata, metadata.dataset_info(), train.create_state)


EXPORT_FILE = os.path.join("export", export_lib.WEIGHTS_FILE)
EXPORT_CONFIG_FILE = os.path.join("export", export_lib.CONFIG_FILE)


def export_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes the latest checkpoint as a timm-named safetensors state dict.

  `<workdir>/export/model.safetensors`: PyTorch layouts and timm names
  (`fairmoe_jax.models.convert_timm`; experts stacked as `<block>.mlp.experts.*`), with step,
  backbone and class names in its metadata; `load_timm_checkpoint(model, path, skip=())` loads
  it back. Beside it, `config.json` says which timm model it is, or why timm cannot load it
  (`fairmoe_jax.export`).
  """
  save = import_extra("safetensors.numpy", "fairsmoe", "--mode=export").save

  output_folder(workdir, os.path.dirname(EXPORT_FILE), create=False)  # Before the restore.
  restored = restore_run(config, workdir)
  model = restored.model
  state = export_timm_state_dict(model)
  timm_config = export_lib.timm_config(model, state, config, restored.metadata, restored.step)
  path = storage.join(workdir, EXPORT_FILE)
  if jax.process_index() == 0:
    output_folder(workdir, os.path.dirname(EXPORT_FILE))
    metadata = {
        "format": "timm",
        "step": str(restored.step),
        "method": config.method,
        "backbone": str(config.model.get("backbone", "")),
        "class_names": json.dumps(list(restored.metadata.class_names)),
        "config": config.to_json(),
    }
    write_atomically(path, save(state, metadata=metadata))  # Mode 0644, as every output.
    write_atomically(storage.join(workdir, EXPORT_CONFIG_FILE), json.dumps(timm_config, indent=2))
    size = sum(v.nbytes for v in state.values())
    print(f"Exported step {restored.step} ({len(state)} tensors, {size / 2**20:.1f} MiB) to {path}")
    if timm_config["timm_loadable"]:
      print(
          f"timm: {timm_config['architecture']} with the model_args of "
          f"{storage.join(workdir, EXPORT_CONFIG_FILE)} (docs/api.md, 'Loading an export into timm')"
      )
    else:
      print(
          f"Not loadable by timm: {timm_config['why_not_timm']}. Load it with "
          f"{export_lib.LOAD_OURS}."
      )
  return path


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
PREDICT_FILE = os.path.join("predict", "predictions.csv")


def predict_inputs(source: str) -> list[str]:
  """The image paths `predict.input` names: a folder's images (sorted), or a list file's lines
  (relative to its folder; from a pipe such as /dev/stdin, relative to the current folder)."""
  if not source:
    raise ConfigError(
        "predict.input", "--mode=predict needs --config.predict.input=FOLDER_OR_LIST_FILE"
    )
  if os.path.isdir(source):
    names = sorted(os.listdir(source))
    paths = [os.path.join(source, n) for n in names if n.lower().endswith(IMAGE_SUFFIXES)]
    skipped = [
        n + "/" if os.path.isdir(os.path.join(source, n)) else n
        for n in names
        if not n.lower().endswith(IMAGE_SUFFIXES)
    ]
    if skipped:
      more = f", ... ({len(skipped) - 5} more)" if len(skipped) > 5 else ""
      print(
          f"predict.input: skipped {len(skipped)} entries of {source} that are not "
          f"{'/'.join(IMAGE_SUFFIXES)} files (subfolders are not read): "
          f"{', '.join(skipped[:5])}{more}",
          flush=True,
      )
    if not paths:
      raise ConfigError(
          "predict.input", f"folder {source} holds no image ({', '.join(IMAGE_SUFFIXES)})"
      )
    # Before anything is restored: a FIFO or device would block predict for good.
    special = [(p, kind) for p in paths if (kind := special_file_kind(p))]
    if special:
      path, kind = special[0]
      more = f" (and {len(special) - 1} more)" if len(special) > 1 else ""
      raise ConfigError(
          "predict.input",
          f"{path} is {kind}, not an image file{more}: predict reads regular files; move it out "
          f"of {source}",
      )
    return paths
  # A list on a pipe (`--config.predict.input=/dev/stdin`) names paths relative to the current
  # folder; a list file, relative to its own folder.
  folder = os.getcwd() if is_stream(source) else os.path.dirname(os.path.abspath(source))
  paths = []
  for _, line in iter_lines(source, "predict.input list"):
    if line.strip() and not line.lstrip().startswith("#"):
      paths.append(os.path.join(folder, line.strip()))  # Absolute paths stay as they are.
  if not paths:
    raise ConfigError("predict.input", f"list file {source} names no image")
  return paths


def check_predictable(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError when the method needs what unlabelled images lack (route_by=label)."""
  if METHODS[config.method].eval_context(config, {"attributes": None}) is not None:
    raise ConfigError(
        "fair.route_by",
        "'label' routes by the sensitive labels, which unlabelled images do not have; "
        "predict with a model trained with route_by=predicted",
    )


def predict_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Classifies `predict.input`'s images with the latest checkpoint.

  Writes `<workdir>/predict/predictions.csv`: per image its path, predicted class (index, name),
  class probabilities and, per MoE block and expert, the share of its (token, choice) pairs that
  expert served. Reads no label, attribute or dataset (class names from run_info.json).
  """
  check_predictable(config)
  output_folder(workdir, os.path.dirname(PREDICT_FILE), create=False)  # Before the restore.
  paths = predict_inputs(config.predict.input)
  for path in paths:  # Headers: an unreadable image is named before the restore and compile.
    images_lib.read_image(path, 1, Image.Image.verify)
  restored = restore_run(config, workdir)
  examples = restored.predict_examples(np.array(paths, dtype=object))
  prediction = examples["prediction"]
  columns: dict[str, np.ndarray] = {
      "path": np.array(paths, dtype=object)[examples["index"]],
      "prediction": prediction,
      "class_name": np.array(restored.metadata.class_names, dtype=object)[prediction],
  }
  columns.update(predictions_lib.probability_columns(examples))
  columns.update(predictions_lib.expert_columns(examples))
  path = storage.join(workdir, PREDICT_FILE)
  if jax.process_index() == 0:
    output_folder(workdir, os.path.dirname(PREDICT_FILE))
    predictions_lib.write_csv(path, columns)
    print(f"Predicted {len(paths)} images with the checkpoint of step {restored.step}: {path}")
  return path


ImageBatch = Sequence[str | os.PathLike] | Sequence[np.ndarray] | np.ndarray | jax.Array


class Predictions(NamedTuple):
  """What `TrainedRun.predict` returns for a batch of N images, in their order.

  Attributes:
    probabilities: float32 [N, C], columns named by `RunMetadata.class_names`.
    classes: int [N], the most probable class.
    class_names: The name of each image's most probable class.
    experts: Per MoE block, float32 [N, E]: the share of the image's (token, choice) pairs
      each expert served (predictions.csv's `<block>/expert_<e>` columns).
  """

  probabilities: np.ndarray
  classes: np.ndarray
  class_names: list[str]
  experts: dict[str, np.ndarray]


class TrainedRun(trained_run.TrainedRun):
  """A trained run loaded by `load_run`, with its metadata (names and preprocessing) and
  `predict`. Its `model` is called as `logits, aux = model(images, train=False, context=None)`
  on images normalised as `metadata.preprocessing` says; `predict` always uses the checkpoint's
  parameters."""

  metadata: RunMetadata
  data: DatasetInfo

  @functools.cached_property
  def _eval_step(self) -> Callable[..., Any]:  # Compiled once for every `predict`.
    return evaluation.make_eval_step(self.graphdef, self.data, self.config)

  def predict(self, images: ImageBatch) -> Predictions:
    """Classifies a batch of images as `--mode=predict` does.

    Args:
      images: Image file paths, or arrays: uint8 [N, H, W, 3] (or a list of [H, W, 3] of any
        sizes), floats in [0, 1], or one [H, W, 3] image. Arrays of another size are resized
        and centre-cropped as files are, floats rounded to uint8, so a PNG and its pixels give
        the same probabilities (a large JPEG is decoded at reduced scale first).

    Returns:
      Probabilities, predicted classes and names, and expert shares, one row per image.

    Raises:
      TypeError: `images` is a single path, or mixes paths and arrays.
      ValueError: An image is not [H, W, 3], or has pixel values out of range.
      trainkit.errors.UserError: An image file is missing or unreadable.
    """
    check_predictable(self.config)
    inputs = _model_inputs(images, self.metadata.preprocessing.image_size)
    examples = self.predict_examples(inputs)
    classes = examples["prediction"]
    return Predictions(
        probabilities=examples["probabilities"],
        classes=classes,
        class_names=[self.metadata.class_names[c] for c in classes],
        experts=examples["experts"],
    )

  def predict_examples(self, images: np.ndarray) -> dict[str, Any]:
    """Classifies unlabelled images, file paths (an object array [N]) or uint8 [N, S, S, 3], as
    evaluation does (same batches, padding and eval step). Returns per example, in `images`'
    order: `prediction` [N], `probabilities` [N, C] and `experts` {block: [N, E]}."""
    # Labels and attributes are placeholders the eval step needs in its batch; unread by the model.
    split = {
        "path" if images.dtype == object else "image": images,
        "label": np.zeros(len(images), np.int32),
        "attributes": np.full((len(images), len(self.data.attribute_names)), -1, np.int32),
    }
    _, examples = evaluation.evaluate(
        self._eval_step, self.state, split, self.data, self.config, self.mesh, keep_examples=True
    )
    return examples

  def __repr__(self) -> str:
    return (
        f"TrainedRun(workdir={self.workdir!r}, method={self.config.method!r}, step={self.step}, "
        f"classes={list(self.metadata.class_names)})"
    )


def load_run(workdir: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> TrainedRun:
  """Loads a trained run from its workdir alone: config.json, run_info.json, latest checkpoint.

  `overrides` change config keys by dotted name, as `--config.KEY=VALUE`, e.g.
  `{"eval_batch_size": 16}`.

  Raises:
    trainkit.errors.UserError: No config.json or readable checkpoint, or another run holds
      the workdir; a ConfigError names a wrong override.
  """
  _, _, run = restore_saved_run(
      workdir, config_lib.base_config(), config_lib.validate, restore_run, overrides
  )
  return run


def _model_inputs(images: ImageBatch, image_size: int) -> np.ndarray:
  """Image paths as an object array [N], or arrays as uint8 [N, image_size, image_size, 3]."""
  if isinstance(images, (str, bytes, os.PathLike)):
    raise TypeError(f"predict takes a batch of images; for one file, pass [{images!r}]")
  if isinstance(images, (np.ndarray, jax.Array)):
    array = np.asarray(images)
    if array.ndim == 3:  # One image.
      array = array[None]
    if array.dtype == np.uint8 and array.shape[1:] == (image_size, image_size, 3):
      return array
    images = list(array)
  items = list(images)
  if not items:
    raise ValueError("predict needs at least one image")
  if all(isinstance(item, (str, os.PathLike)) for item in items):
    return np.array([os.fspath(item) for item in items], dtype=object)
  if any(isinstance(item, (str, bytes, os.PathLike)) for item in items):
    raise TypeError("predict takes either image paths or image arrays, not both in one batch")
  return np.stack([_as_uint8(i, item, image_size) for i, item in enumerate(items)])


def _as_uint8(index: int, image: Any, image_size: int) -> np.ndarray:
  """One image as uint8 [image_size, image_size, 3] (`TrainedRun.predict` says how)."""
  array = np.asarray(image)
  if array.ndim != 3 or array.shape[-1] != 3:
    raise ValueError(f"image {index}: expected an RGB array [H, W, 3], got shape {array.shape}")
  if np.issubdtype(array.dtype, np.floating):
    if not np.all(np.isfinite(array)) or array.min() < 0 or array.max() > 1:
      raise ValueError(
          f"image {index}: float pixels must lie in [0, 1], got [{array.min()}, {array.max()}]"
      )
    array = np.round(array * 255).astype(np.uint8)
  elif np.issubdtype(array.dtype, np.integer):
    if array.min() < 0 or array.max() > 255:
      raise ValueError(
          f"image {index}: integer pixels must lie in [0, 255], got "
          f"[{array.min()}, {array.max()}]"
      )
    array = array.astype(np.uint8)
  else:
    raise ValueError(f"image {index}: unsupported dtype {array.dtype} (uint8 or float)")
  if array.shape[:2] != (image_size, image_size):
    array = images_lib.square_resize(Image.fromarray(array), image_size)
  return array
