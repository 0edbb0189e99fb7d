"""Per-example image augmentation in numpy (with PIL for resampling).

Random functions take an explicit ``np.random.Generator``, seeded per example by the pipeline.
Augmented images stay uint8; ``normalize_on_device`` makes the model's input inside the jitted
steps.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from fairmoe_jax.data.images import to_rgb8

# (top, left, height, width) of a crop, in pixels of the source image.
CropBox = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
  """Training-time augmentation.

  Attributes:
    random_resized_crop: torchvision's ``RandomResizedCrop`` with ``crop_scale`` (area
      fraction) and ``crop_ratio`` (width / height, log-uniform); if False, only a resize.
    horizontal_flip: Mirror the image left-right with probability 1/2.
  """

  random_resized_crop: bool = True
  crop_scale: tuple[float, float] = (0.35, 1.0)
  crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
  horizontal_flip: bool = True


def random_resized_crop_box(
    rng: np.random.Generator,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> CropBox:
  """Samples a crop with torchvision ``RandomResizedCrop.get_params`` semantics (10 attempts,
  then the largest centred crop with a ratio clamped to ``ratio``)."""
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = round(math.sqrt(target_area * aspect))
    h = round(math.sqrt(target_area / aspect))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, round(width / min(ratio))
  elif in_ratio > max(ratio):
    w, h = round(height * max(ratio)), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(image: np.ndarray, box: CropBox, size: int) -> np.ndarray:
  """Bilinearly resamples ``box`` of a uint8 [H, W, 3] image to [size, size, 3] in one PIL pass
  (antialiased when shrinking; several times faster than numpy on small images)."""
  top, left, h, w = box
  if (top, left, h, w) == (0, 0, *image.shape[:2]) and h == w == size:
    return image
  pil = Image.fromarray(image)
  return np.asarray(pil.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h)))


def resize(image: np.ndarray, size: int) -> np.ndarray:
  """Bilinear resize of a uint8 [H, W, 3] image to [size, size, 3]."""
  return resized_crop(image, (0, 0, *image.shape[:2]), size)


def random_resized_crop(
    image: np.ndarray,
    rng: np.random.Generator,
    size: int,
    scale: tuple[float, float] = (0.35, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
  """torchvision-style ``RandomResizedCrop`` of a uint8 [H, W, 3] image."""
  box = random_resized_crop_box(rng, *image.shape[:2], scale, ratio)
  return resized_crop(image, box, size)


def horizontal_flip(image: np.ndarray) -> np.ndarray:
  """Mirrors an [H, W, C] image left-right."""
  return image[:, ::-1]


def normalize(image: np.ndarray) -> np.ndarray:
  """Maps uint8 pixels [0, 255] to float32 [-1, 1] (works on any shape); the host-side
  reference of ``normalize_on_device``."""
  return np.asarray(image, np.float32) * np.float32(1 / 127.5) - np.float32(1)


def normalize_on_device(images: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """The model's input from a batch's ``image``: uint8 pixels become float32 [-1, 1] as
  ``normalize`` computes them (p / 127.5 - 1, i.e. mean 0.5 and std 0.5 of p / 255, the
  ``run_info`` preprocessing); floating-point images are taken as already normalised.

  Called inside the jitted steps, so the host ships uint8. With ``mask`` [b], padding examples
  are zeros: padded tokens still take MoE capacity, so their content must not change with the
  pixel format.
  """
  if not jnp.issubdtype(images.dtype, jnp.floating):
    images = images.astype(jnp.float32) * jnp.float32(1 / 127.5) - jnp.float32(1)
  if mask is not None:
    images = jnp.where(mask.reshape(-1, *(1,) * (images.ndim - 1)) > 0, images, 0)
  return images


def augment_image(
    image: np.ndarray, rng: np.random.Generator, size: int, config: AugmentConfig
) -> np.ndarray:
  """Training augmentation of one uint8 image; returns uint8 [size, size, 3]."""
  if config.random_resized_crop:
    image = random_resized_crop(image, rng, size, config.crop_scale, config.crop_ratio)
  else:
    image = resize(image, size)
  if config.horizontal_flip and rng.random() < 0.5:
    image = horizontal_flip(image)
  return image


def source_crop_box(
    box: CropBox, decode_size: int, width: int, height: int
) -> tuple[float, float, float, float]:
  """``box`` of the ``decode_size`` square that ``images.square_resize`` would make of a
  ``width`` x ``height`` image, as (left, top, right, bottom) sub-pixel coordinates in the
  image's own pixels."""
  top, left, h, w = box
  side = min(width, height)
  scale = side / decode_size
  x0, y0 = (width - side) / 2, (height - side) / 2
  return (x0 + left * scale, y0 + top * scale, x0 + (left + w) * scale, y0 + (top + h) * scale)


def augment_decoded(
    image: Image.Image, rng: np.random.Generator, size: int, decode_size: int, config: AugmentConfig
) -> np.ndarray:
  """Training augmentation of a decoded image file in one resampling pass; uint8 [size, size, 3].

  Draws the same crop box and flip from ``rng`` as ``augment_image(images.square_resize(image,
  decode_size), ...)``, but resamples the box straight from the file's pixels: the two differ
  only by interpolation (docs/design.md, "Training images in one resampling pass").
  """
  image = to_rgb8(image)
  if config.random_resized_crop:
    box = random_resized_crop_box(
        rng, decode_size, decode_size, config.crop_scale, config.crop_ratio
    )
  else:
    box = (0, 0, decode_size, decode_size)
  resized = image.resize(
      (size, size), Image.BILINEAR, box=source_crop_box(box, decode_size, *image.size)
  )
  if config.horizontal_flip and rng.random() < 0.5:
    resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
  return np.asarray(resized)
