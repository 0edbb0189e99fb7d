"""Image files on disk: decoding to square uint8 arrays, eagerly or on access.

A loader may return a split with ``path`` (absolute file paths) instead of ``image``:
``preload_images`` decodes it once at the model's image size, or the input pipeline decodes on
read (``pipeline.ArraySource``).
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from PIL import Image

from trainkit.errors import UserError
from trainkit.textfiles import special_file_kind

DEFAULT_NUM_THREADS = min(16, os.cpu_count() or 1)
T = TypeVar("T")


# Pillow's modes of 16-bit grey pixels (PNG, TIFF); `convert("RGB")` clips them at 255.
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def to_rgb8(image: Image.Image) -> Image.Image:
  """The image in 8-bit RGB, 16-bit grey scaled (v / 257, rounded); ValueError for 32-bit
  integer or float pixels, whose range no file states."""
  if image.mode == "RGB":
    return image
  if image.mode in _SIXTEEN_BIT_MODES:
    grey = np.asarray(image).astype(np.uint32)
    return Image.fromarray(((grey + 128) // 257).astype(np.uint8), "L").convert("RGB")
  if image.mode in ("I", "F"):
    raise ValueError(
        f"its pixels are 32-bit {'integers' if image.mode == 'I' else 'floats'} with no stated "
        "range; convert it to an 8-bit (or 16-bit) image"
    )
  return image.convert("RGB")


def square_resize(image: Image.Image, size: int) -> np.ndarray:
  """Resizes the short side of a PIL image to ``size`` and centre-crops a square.

  One bicubic, antialiased PIL pass over the central square (resizing then cropping, up to
  sub-pixel rounding, without a second full-size copy). Returns uint8 [size, size, 3].
  """
  image = to_rgb8(image)
  width, height = image.size
  side = min(width, height)
  left = (width - side) / 2
  top = (height - side) / 2
  if side == size and left == int(left) and top == int(top):
    return np.asarray(image.crop((int(left), int(top), int(left) + size, int(top) + size)))
  resized = image.resize(
      (size, size), Image.BICUBIC, box=(left, top, left + side, top + side), reducing_gap=None
  )
  return np.asarray(resized)


def read_image(path: str | os.PathLike, size: int, convert: Callable[[Image.Image], T]) -> T:
  """``convert(image)`` of an image file opened for a ``size`` output.

  JPEG decodes at 1/2, 1/4 or 1/8 scale directly (PIL's draft mode keeps both sides >=
  ``size``). A missing or unreadable file is a UserError naming it.
  """
  kind = special_file_kind(path)
  if kind is not None:  # A FIFO would block the read for good; a device, read forever.
    raise UserError(f"image file {os.fspath(path)} is {kind}, not an image file.")
  try:
    with Image.open(path) as image:
      image.draft("RGB", (size, size))
      return convert(image)
  except FileNotFoundError as e:
    raise UserError(f"image file {os.fspath(path)} does not exist.") from e
  except (OSError, ValueError, Image.DecompressionBombError) as e:
    raise UserError(f"image file {os.fspath(path)} is not a readable image: {e}") from e


def load_image(path: str | os.PathLike, size: int) -> np.ndarray:
  """Decodes an image file to uint8 [size, size, 3] (RGB, short side resized, centre crop)."""
  return read_image(path, size, lambda image: square_resize(image, size))


def load_images(
    paths: Sequence[str], size: int, num_threads: int = DEFAULT_NUM_THREADS
) -> np.ndarray:
  """Decodes ``paths`` to uint8 [len(paths), size, size, 3] with a thread pool.

  PIL releases the GIL while decoding, so threads scale without worker processes' memory.
  """
  images = np.empty((len(paths), size, size, 3), np.uint8)

  def decode(i: int) -> None:
    images[i] = load_image(paths[i], size)

  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
    # list() re-raises the first decoding error (a UserError naming the file).
    list(pool.map(decode, range(len(paths))))
  return images


def preload_images(
    split: Mapping[str, np.ndarray], size: int, num_threads: int = DEFAULT_NUM_THREADS
) -> dict[str, np.ndarray]:
  """Returns ``split`` with ``path`` replaced by decoded ``image`` uint8 [N, size, size, 3].

  The file names are kept as ``id`` (predictions.csv); a split with ``image`` is returned as a
  shallow copy.
  """
  out = dict(split)
  if "path" not in out:
    return out
  paths = out.pop("path")
  out.setdefault("id", np.array([os.path.basename(str(p)) for p in paths], dtype=object))
  out["image"] = load_images(paths, size, num_threads)
  return out


def layout_dirs(root: str, image_dir: str, dataset: str) -> tuple[pathlib.Path, pathlib.Path]:
  """(root, its `image_dir` folder) of a dataset's official layout, or a UserError naming the one
  that is missing. Some archives (e.g. Kaggle's) unpack to `image_dir/image_dir/`."""
  root_path = pathlib.Path(root)
  if not root_path.is_dir():
    raise UserError(f"{dataset} root directory {root_path} does not exist.")
  images = root_path / image_dir
  if not images.is_dir():
    raise UserError(f"{dataset} image directory {images} does not exist.")
  return root_path, images / image_dir if (images / image_dir).is_dir() else images
