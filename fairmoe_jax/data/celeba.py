"""CelebA from its official files, or from a prepared tfds ``celeb_a``.

One binary attribute is the target (``Attractive`` by default), others the sensitive
attributes (``Male``, ``Chubby``, ``Goatee``), with groups ``not_<name>`` (file value -1) and
``<name>`` (1). Splits keep identities apart (about 25 photos per person would leak): the
official partition by default, or identity-grouped k-fold cross-validation (``num_folds`` > 0)
for a small copy whose official test split holds too few images of a group (the sample's has
2 Chubby faces): fold f is the test split, f+1 (mod k) the validation split, the rest training,
so the k runs predict every image once by a model that never saw that person
(docs/protocol.md, "CelebA sample: identity folds").

Official layout under ``root``::

  img_align_celeba/NNNNNN.jpg
  list_attr_celeba.txt      # row count, attribute names, "image v1 v2 ..." (-1/1)
  list_eval_partition.txt   # "image split", 0/1/2 = train/val/test
  identity_CelebA.txt       # "image identity" (read only for identity folds)

Partial copies are common, so rows are matched by image name and what could not be matched is
counted in ``DatasetInfo.load_stats`` rather than trusted from the header.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from fairmoe_jax.data import images as images_lib
from fairmoe_jax.data.types import SPLITS, DatasetInfo, Splits
from trainkit import tfds_data
from trainkit.errors import UserError
from trainkit.textfiles import read_text, report_counts

PARTITION_FILE = "list_eval_partition.txt"
IDENTITY_FILE = "identity_CelebA.txt"
IMAGE_DIR = "img_align_celeba"
# tfds names the validation split "validation".
_TFDS_SPLITS = {"train": "train", "val": "validation", "test": "test"}


def _check_names(target: str, sensitive: Sequence[str]) -> tuple[str, ...]:
  if isinstance(sensitive, str):
    raise UserError(f"CelebA sensitive attributes must be a list of names, got {sensitive!r}.")
  sensitive = tuple(sensitive)
  if len(set(sensitive)) != len(sensitive):
    raise UserError(f"CelebA sensitive attributes must be distinct, got {sensitive!r}.")
  if target in sensitive:
    raise UserError(f"CelebA target {target!r} is also a sensitive attribute.")
  return sensitive


def celeba_info(
    target: str, sensitive: Sequence[str], image_size: int, load_stats: dict[str, int] | None = None
) -> DatasetInfo:
  """The ``DatasetInfo`` of CelebA with binary ``target`` and ``sensitive`` attributes."""
  return DatasetInfo(
      name="celeba",
      num_classes=2,
      class_names=(f"not_{target}", target),
      attribute_names=tuple(sensitive),
      group_names=tuple((f"not_{name}", name) for name in sensitive),
      image_size=image_size,
      load_stats=dict(load_stats or {}),
  )


def _read_lines(path: pathlib.Path) -> list[str]:
  return read_text(path, "CelebA").splitlines()


def _header_index(path: pathlib.Path, lines: Sequence[str]) -> int:
  """The index of the attribute-names line (after the optional row-count line)."""
  header_index = 0
  while header_index < len(lines) and not lines[header_index].split():
    header_index += 1
  if header_index < len(lines):
    first = lines[header_index].split()
    if len(first) == 1 and first[0].isdigit():
      header_index += 1
  if header_index >= len(lines) or not lines[header_index].split():
    raise UserError(f"{path}: no line with attribute names (expected on line 2).")
  return header_index


# A header of anything else is not an attribute file (data.attr_file pointed at /etc/passwd,
# say), and its content is never repeated in an error.
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_]+")


def _attribute_names(path: pathlib.Path, lines: Sequence[str], header_index: int) -> list[str]:
  names = lines[header_index].split()
  if not all(_ATTRIBUTE_NAME.fullmatch(name) for name in names):
    raise UserError(
        f"{path}:{header_index + 1}: expected the attribute names (words such as Male Young, "
        "separated by spaces) on this line; the file is not a CelebA attribute file "
        "(list_attr_celeba.txt) and its content is not repeated here: check data.attr_file"
    )
  return names


def read_attribute_names(path: str | os.PathLike) -> list[str]:
  """The attribute names of a ``list_attr_celeba.txt``, in file order."""
  path = pathlib.Path(path)
  lines = _read_lines(path)
  return _attribute_names(path, lines, _header_index(path, lines))


def read_attributes(
    path: str | os.PathLike, columns: Sequence[str]
) -> tuple[list[str], np.ndarray]:
  """Image names in file order and int32 [rows, len(columns)] 0/1 (file -1/1) of ``columns``.

  The optional row-count line is ignored: partial copies keep the full file's count.
  A missing column, malformed row, bad value or repeated image is a UserError naming the line.
  """
  path = pathlib.Path(path)
  lines = _read_lines(path)
  header_index = _header_index(path, lines)
  names = _attribute_names(path, lines, header_index)
  missing = [c for c in columns if c not in names]
  if missing:
    raise UserError(
        f"{path}:{header_index + 1}: attribute(s) {', '.join(missing)} not in the file; "
        f"available: {' '.join(names)}."
    )
  # +1: field 0 of a row is the image name.
  fields = [names.index(c) + 1 for c in columns]
  expected = len(names) + 1
  images: list[str] = []
  values: list[list[str]] = []
  line_numbers: list[int] = []
  seen: dict[str, int] = {}
  for i in range(header_index + 1, len(lines)):
    row = lines[i].split()
    if not row:
      continue
    if len(row) != expected:
      raise UserError(
          f"{path}:{i + 1}: expected {expected} fields (image name and {len(names)} "
          f"attributes), got {len(row)}."
      )
    if row[0] in seen:
      raise UserError(f"{path}:{i + 1}: image {row[0]} already listed on line {seen[row[0]]}.")
    seen[row[0]] = i + 1
    images.append(row[0])
    values.append([row[f] for f in fields])
    line_numbers.append(i + 1)
  raw = np.array(values, dtype=np.str_).reshape(len(images), len(columns))
  # Validated as a whole array: a per-value Python check is slow on 200k rows.
  bad = (raw != "1") & (raw != "-1")
  if bad.any():
    r, c = np.argwhere(bad)[0]
    raise UserError(
        f"{path}:{line_numbers[r]}: column {columns[c]} has value {str(raw[r, c])!r}; "
        "expected -1 or 1."
    )
  return images, (raw == "1").astype(np.int32)


def _read_pairs(path: str | os.PathLike, second: str, file_name: str) -> dict[str, str]:
  """{image name: second field} of a two-column CelebA file such as ``list_eval_partition.txt``."""
  path = pathlib.Path(path)
  pairs: dict[str, str] = {}
  for i, line in enumerate(_read_lines(path)):
    row = line.split()
    if not row:
      continue
    if len(row) != 2 or (second == "split" and row[1] not in ("0", "1", "2")):
      # The line itself is not repeated: the file may be anything a path was pointed at.
      raise UserError(
          f"{path}:{i + 1}: expected 'image {second}' (got {len(row)} field(s) of another form): "
          f"is it CelebA's {file_name}?"
      )
    if row[0] in pairs:
      raise UserError(f"{path}:{i + 1}: image {row[0]} is listed twice.")
    pairs[row[0]] = row[1]
  return pairs


def read_partition(path: str | os.PathLike) -> dict[str, int]:
  """Reads ``list_eval_partition.txt`` into {image name: 0 train / 1 val / 2 test}."""
  return {k: int(v) for k, v in _read_pairs(path, "split", PARTITION_FILE).items()}


def read_identities(path: str | os.PathLike) -> dict[str, str]:
  """Reads ``identity_CelebA.txt`` into {image name: identity}."""
  return _read_pairs(path, "identity", IDENTITY_FILE)


def identity_folds(identities: Sequence[str], num_folds: int) -> dict[str, int]:
  """{identity: fold} for ``identities`` (one entry per image) dealt into ``num_folds`` folds.

  Largest identity first (ties by a hash of the identity), each to the fold with the fewest
  images so far (ties to the lowest): folds never split an identity, differ by at most one
  identity's count, and depend only on the identities, never on a run's seed.
  """
  counts = collections.Counter(identities)
  if num_folds < 1 or len(counts) < num_folds:
    raise UserError(
        f"{num_folds} identity folds need at least {num_folds} identities; the images have "
        f"{len(counts)}."
    )
  order = sorted(
      counts, key=lambda name: (-counts[name], hashlib.sha256(name.encode()).hexdigest(), name)
  )
  images_in = [0] * num_folds
  fold_of: dict[str, int] = {}
  for name in order:
    fold = min(range(num_folds), key=lambda f: (images_in[f], f))
    fold_of[name] = fold
    images_in[fold] += counts[name]
  return fold_of


def fold_roles(num_folds: int, fold: int) -> dict[int, int]:
  """{fold: split id} of run ``fold``: it is the test split (2), the next fold (mod k) the
  validation split (1) and every other fold the training split (0)."""
  if num_folds < 3:
    raise UserError(
        f"identity folds need num_folds >= 3 (a training, a validation and a test fold), got "
        f"{num_folds}."
    )
  if not 0 <= fold < num_folds:
    raise UserError(f"fold {fold} is outside 0..{num_folds - 1} ({num_folds} identity folds).")
  roles = {f: 0 for f in range(num_folds)}
  roles[fold] = 2
  roles[(fold + 1) % num_folds] = 1
  return roles


def load_celeba(
    *,
    root: str,
    target: str = "Attractive",
    sensitive: Sequence[str] = ("Male", "Chubby", "Goatee"),
    image_size: int,
    attr_file: str = "list_attr_celeba.txt",
    preload: bool = True,
    max_examples_per_split: int = 0,
    num_threads: int = images_lib.DEFAULT_NUM_THREADS,
    num_folds: int = 0,
    fold: int = 0,
) -> tuple[DatasetInfo, Splits]:
  """Loads CelebA from its official files under ``root``.

  An example is an attribute row whose image file exists and which has a partition entry
  (identity folds: an identity), in the attribute file's order.

  ``attr_file`` is relative to ``root`` or absolute; ``preload`` decodes all images now
  (``image``), else splits carry ``path``; ``max_examples_per_split`` > 0 keeps the first of each
  split; ``num_folds`` 0 reads the official partition, k >= 3 makes ``fold`` the test split of
  identity folds (module doc). ``info.load_stats`` counts the rows, the image files, every kind
  of unmatched row (the first few names of each are printed) and each split's examples (with
  identity folds, also its identities).
  """
  sensitive = _check_names(target, sensitive)
  root_path, image_dir = images_lib.layout_dirs(root, IMAGE_DIR, "CelebA")
  attr_path = root_path / attr_file
  roles = fold_roles(num_folds, fold) if num_folds else {}  # Bad folds fail before any reading.
  names, values = read_attributes(attr_path, (target, *sensitive))
  image_files = {
      entry.name for entry in os.scandir(image_dir) if entry.name.lower().endswith(".jpg")
  }
  has_image = np.array([name in image_files for name in names], bool)
  stats = {
      "attribute_rows": len(names),
      "image_files": len(image_files),
      "rows_without_image": int((~has_image).sum()),
      "images_without_attributes": len(image_files - set(names)),
  }
  # Counts say how many; the first few names say which, so a user can look.
  examples = {
      "rows_without_image": [names[i] for i in np.flatnonzero(~has_image)[:5]],
      "images_without_attributes": sorted(image_files - set(names))[:5],
  }
  if num_folds:
    split_of = _identity_fold_splits(
        root_path / IDENTITY_FILE, names, has_image, num_folds, roles, stats, examples
    )
  else:
    partition = read_partition(root_path / PARTITION_FILE)
    split_of = np.array([partition.get(name, -1) for name in names], np.int64)
    stats["rows_without_partition"] = int((has_image & (split_of < 0)).sum())
    stats["partition_rows_unknown_image"] = len(set(partition) - set(names))
    examples["rows_without_partition"] = [
        names[i] for i in np.flatnonzero(has_image & (split_of < 0))[:5]
    ]
    examples["partition_rows_unknown_image"] = sorted(set(partition) - set(names))[:5]
  image_dir_abs = image_dir.resolve()
  splits: Splits = {}
  for split_id, split in enumerate(SPLITS):
    indices = np.flatnonzero(has_image & (split_of == split_id))
    if max_examples_per_split > 0:
      indices = indices[:max_examples_per_split]
    splits[split] = {
        "path": np.array([str(image_dir_abs / names[i]) for i in indices], dtype=object),
        "label": values[indices, 0].astype(np.int32),
        "attributes": values[indices, 1:].astype(np.int32).reshape(len(indices), len(sensitive)),
    }
    stats[f"{split}_examples"] = len(indices)
  report_counts(f"celeba ({attr_path})", stats, examples)
  if preload:
    splits = {k: images_lib.preload_images(v, image_size, num_threads) for k, v in splits.items()}
  return celeba_info(target, sensitive, image_size, stats), splits


def _identity_fold_splits(
    path: pathlib.Path,
    names: Sequence[str],
    has_image: np.ndarray,
    num_folds: int,
    roles: Mapping[int, int],
    stats: dict[str, int],
    examples: dict[str, list[str]],
) -> np.ndarray:
  """Per attribute row, its split id under identity folds (-1 for a row without an image);
  adds the identity counts to ``stats`` and ``examples``."""
  identity = read_identities(path)
  kept = [names[i] for i in np.flatnonzero(has_image)]
  unknown = [name for name in kept if name not in identity]
  if unknown:
    listed = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
    raise UserError(
        f"{path}: {len(unknown)} image(s) with attributes and an image file have no identity "
        f"({listed}); identity folds need every image's identity."
    )
  fold_of = identity_folds([identity[name] for name in kept], num_folds)
  split_of = np.array(
      [roles[fold_of[identity[name]]] if ok else -1 for name, ok in zip(names, has_image)], np.int64
  )
  name_set = set(names)
  stats["identities"] = len(fold_of)
  unmatched = sorted(name for name in identity if name not in name_set)
  stats["identity_rows_unknown_image"] = len(unmatched)
  examples["identity_rows_unknown_image"] = unmatched[:5]
  for split_id, split in enumerate(SPLITS):
    stats[f"{split}_identities"] = sum(roles[f] == split_id for f in fold_of.values())
  return split_of


def load_celeba_tfds(
    *,
    data_dir: str,
    target: str = "Attractive",
    sensitive: Sequence[str] = ("Male", "Chubby", "Goatee"),
    image_size: int,
    max_examples_per_split: int = 0,
    num_threads: int = images_lib.DEFAULT_NUM_THREADS,
) -> tuple[DatasetInfo, Splits]:
  """Loads tfds ``celeb_a`` already prepared in ``data_dir``; never downloads.

  ``array_record`` data is read without TensorFlow (``tfrecord`` needs it). Images are
  decoded one at a time into memory at ``image_size``, so the full-size images are never all
  held. Returns ``(info, splits)`` as ``load_celeba``.
  """
  sensitive = _check_names(target, sensitive)
  builder = tfds_data.tfds_builder("celeb_a", data_dir, "fairsmoe")
  available = list(builder.info.features["attributes"].keys())
  columns = (target, *sensitive)
  missing = [name for name in columns if name not in available]
  if missing:
    raise UserError(
        f"tfds celeb_a in {data_dir} has no attribute(s) {', '.join(missing)}; "
        f"available: {' '.join(available)}."
    )

  def convert(example: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    image = images_lib.square_resize(Image.fromarray(np.asarray(example["image"])), image_size)
    values = np.array([bool(example["attributes"][name]) for name in columns], np.int32)
    return image, values

  splits: Splits = {}
  stats: dict[str, int] = {}
  for split, tfds_split in _TFDS_SPLITS.items():
    converted = list(
        tfds_data.tfds_map(
            builder, tfds_split, max_examples_per_split, convert, max(1, num_threads)
        )
    )
    images = np.array([c[0] for c in converted], np.uint8).reshape(-1, image_size, image_size, 3)
    values = np.array([c[1] for c in converted], np.int32).reshape(-1, len(columns))
    splits[split] = {"image": images, "label": values[:, 0].copy(), "attributes": values[:, 1:]}
    stats[f"{split}_examples"] = len(converted)
  report_counts(f"celeba_tfds ({builder.data_dir})", stats)
  return celeba_info(target, sensitive, image_size, stats), splits
