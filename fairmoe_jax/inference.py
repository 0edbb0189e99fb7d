"""A trained run from Python: `load_run(workdir)`, then `run.predict(images)`.

    import fairmoe_jax

    run = fairmoe_jax.load_run("/tmp/fairmoe_quickstart")
    result = run.predict(["a.png", "b.jpg"])  # or uint8 images [N, H, W, 3]
    result.probabilities, result.class_names

The workdir alone is read: its config.json, run_info.json (class names, attribute names,
preprocessing) and latest checkpoint. Predictions are made exactly as `--mode=predict` makes
them: same batches (`eval_batch_size`), same preprocessing, same jitted evaluation step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import functools
import os
from typing import Any, NamedTuple

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from PIL import Image

from fairmoe_jax import config as config_lib
from fairmoe_jax import train
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.run_info import RunMetadata
from trainkit.saved_config import restore_saved_run

ImageBatch = Sequence[str | os.PathLike] | Sequence[np.ndarray] | np.ndarray | jax.Array


class Predictions(NamedTuple):
  """What `TrainedRun.predict` returns for a batch of N images, in their order.

  Attributes:
    probabilities: float32 [N, C]: the softmax probability of each class
      (`RunMetadata.class_names` names the columns).
    classes: int [N]: the index of the most probable class.
    class_names: The name of each image's most probable class.
    experts: Per MoE block, float32 [N, E]: the share of the image's (token, choice) pairs
      that each expert served (predictions.csv's `<block>/expert_<e>` columns).
  """

  probabilities: np.ndarray
  classes: np.ndarray
  class_names: list[str]
  experts: dict[str, np.ndarray]


class TrainedRun:
  """A trained run loaded by `load_run`: its model, config and metadata, and `predict`.

  Attributes:
    workdir: The run's working directory (absolute).
    config: The config the run was trained with (with `load_run`'s overrides).
    metadata: Class names, attribute and group names, and the image preprocessing.
    step: The training step of the restored checkpoint.
  """

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, restored: train.Restored):
    """Wraps a restored checkpoint (`train.restore_run`); `load_run` is the way to make one."""
    self.workdir = workdir
    self.config = config
    self.metadata: RunMetadata = restored.metadata
    self.step: int | None = restored.step
    self._restored = restored
    self._eval_step = train.make_eval_step(restored.graphdef, restored.info, config)

  @functools.cached_property
  def model(self) -> nnx.Module:
    """The Flax NNX model with the checkpoint's parameters.

    It is called as `logits, aux = model(images, train=False, context=None)` on images
    normalised as `metadata.preprocessing` says (float32 [N, S, S, 3]). `predict` always uses
    the checkpoint's parameters, whatever is later done to this module.
    """
    return self._restored.model

  def predict(self, images: ImageBatch) -> Predictions:
    """Classifies a batch of images as `--mode=predict` does.

    Args:
      images: Image file paths (a list of str or os.PathLike), or images as arrays: uint8
        [N, H, W, 3] (or a list of [H, W, 3] arrays of any sizes), floats in [0, 1] (as
        matplotlib reads a PNG), or one [H, W, 3] image. Files are decoded as
        `--mode=predict` decodes them; an array of another size than the model's is brought
        to it the same way (short side resized, centred square crop), and float pixels are
        rounded to the uint8 values the model was trained on. So a PNG file and its pixels
        give the same probabilities; a JPEG file is decoded at a reduced scale first when it
        is much larger than the model's input, so its full-size pixels may differ slightly.

    Returns:
      The class probabilities, the predicted classes and their names, and the expert shares
      per MoE block, one row per image in the order given.

    Raises:
      TypeError: `images` is a single path, or mixes paths and arrays.
      ValueError: An image has another shape than [H, W, 3], or pixel values out of range.
      trainkit.errors.UserError: An image file is missing or unreadable (the message names it).
    """
    train.check_predictable(self.config)
    inputs = _model_inputs(images, self.metadata.preprocessing.image_size)
    examples = train.predict_examples(self._restored, self.config, inputs, self._eval_step)
    classes = examples["prediction"]
    return Predictions(
        probabilities=examples["probabilities"],
        classes=classes,
        class_names=[self.metadata.class_names[c] for c in classes],
        experts=examples["experts"],
    )

  def __repr__(self) -> str:
    return (
        f"TrainedRun(workdir={self.workdir!r}, method={self.config.method!r}, step={self.step}, "
        f"classes={list(self.metadata.class_names)})"
    )


def load_run(workdir: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> TrainedRun:
  """Loads a trained run from its workdir alone: config.json, run_info.json, latest checkpoint.

  Args:
    workdir: The working directory a training run (`python -m fairmoe_jax.main`) wrote.
    overrides: Config keys to change, by dotted name, e.g. `{"eval_batch_size": 16,
      "mesh.data": 1}`; the same as `--config.KEY=VALUE` on the command line.

  Returns:
    The run: `model`, `config`, `metadata`, `step` and `predict`.

  Raises:
    trainkit.errors.UserError: The workdir has no config.json or no readable checkpoint, or
      another run holds it; a ConfigError names an override with a wrong key or value.
  """
  workdir, config, restored = restore_saved_run(
      workdir, config_lib.base_config(), config_lib.validate, train.restore_run, overrides
  )
  return TrainedRun(workdir, config, restored)


def _model_inputs(images: ImageBatch, image_size: int) -> np.ndarray:
  """Image paths as an object array [N], or arrays as uint8 [N, image_size, image_size, 3]."""
  if isinstance(images, (str, bytes, os.PathLike)):
    raise TypeError(f"predict takes a batch of images; for one file, pass [{images!r}]")
  if isinstance(images, (np.ndarray, jax.Array)):
    array = np.asarray(images)
    if array.ndim == 3:  # One image.
      array = array[None]
    if (
        array.dtype == np.uint8
        and array.ndim == 4
        and array.shape[1:]
        == (
            image_size,
            image_size,
            3,
        )
    ):
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
