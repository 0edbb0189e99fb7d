"""ISIC 2019 (training part) from its official files.

The target is the one-hot diagnosis, one of ``CLASS_NAMES`` (``UNK`` never occurs in the
training part and is rejected). The sensitive attributes come from the metadata CSV: ``sex``,
``age`` (``age_approx`` in 20-year bins, 80+ last) and ``site`` (``anatom_site_general``).
Metadata is missing for some rows (sex 384, age 437, site 2,631 of 25,331):
``missing="unknown"`` makes "unknown" an explicit last group, measured as a group;
``missing="exclude"`` stores -1, which the fairness metrics skip.

Layout under ``root``::

  ISIC_2019_Training_Input/<image>.jpg
  ISIC_2019_Training_GroundTruth.csv   # image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK
  ISIC_2019_Training_Metadata.csv      # image,age_approx,anatom_site_general,lesion_id,sex

Rows whose image file is absent are dropped and counted in
``DatasetInfo.load_stats``, so a partial copy of the images can be used.
"""

from __future__ import annotations

import csv
import io
import math
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from fairmoe_jax.data import images as images_lib
from fairmoe_jax.data.types import SPLITS, DatasetInfo, Splits, check_sensitive
from trainkit.errors import UserError
from trainkit.textfiles import read_text, report_counts

IMAGE_DIR = "ISIC_2019_Training_Input"
GROUND_TRUTH_FILE = "ISIC_2019_Training_GroundTruth.csv"
METADATA_FILE = "ISIC_2019_Training_Metadata.csv"

CLASS_NAMES = ("MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC")
UNKNOWN_CLASS = "UNK"
SEX_GROUPS = ("female", "male")
AGE_GROUPS = ("0-19", "20-39", "40-59", "60-79", "80+")
AGE_BIN_WIDTH = 20
SITE_GROUPS = (
    "anterior torso",
    "head/neck",
    "lateral torso",
    "lower extremity",
    "oral/genital",
    "palms/soles",
    "posterior torso",
    "upper extremity",
)
GROUPS = {"sex": SEX_GROUPS, "age": AGE_GROUPS, "site": SITE_GROUPS}
UNKNOWN_GROUP = "unknown"
MISSING_MODES = ("unknown", "exclude")


def age_group(age: float) -> int:
  """Index into ``AGE_GROUPS`` of an age in years (20-year bins, 80+ last)."""
  return min(int(age // AGE_BIN_WIDTH), len(AGE_GROUPS) - 1)


def _read_csv(path: pathlib.Path, required: Sequence[str]):
  """Yields (line number, row dict) of a CSV whose header has the ``required`` columns.

  Strict where the csv module is lenient, naming the line a row starts on: a quoted field over
  a line break (an unclosed quote would swallow the following rows), a quote inside a value (no
  ISIC value has one), a wrong field count, a non-UTF-8 byte or an oversized field.
  """
  text = read_text(path, "ISIC")
  # csv.reader, not DictReader: DictReader skips blank lines, so the line a row starts on could
  # not be told from the line number of the row before it.
  reader = csv.reader(io.StringIO(text, newline=""), strict=True)
  first = 1
  try:
    header = next(reader, [])
    missing = [c for c in required if c not in header]
    if missing:
      raise UserError(
          f"{path}:1: missing column(s) {', '.join(missing)}; header is {','.join(header)}."
      )
    while True:
      first = reader.line_num + 1
      fields = next(reader, None)
      if fields is None:
        return
      if not fields:
        continue  # A blank line.
      last = reader.line_num
      if last > first or any("\n" in v or "\r" in v for v in fields):
        raise UserError(
            f"{path}:{first}: a quoted field runs from line {first} to line {last}; "
            'is a quote (") left unclosed?'
        )
      if len(fields) != len(header):
        raise UserError(f"{path}:{first}: expected {len(header)} comma-separated fields.")
      quoted = [(c, v) for c, v in zip(header, fields) if '"' in v]
      if quoted:
        raise UserError(
            f"{path}:{first}: column {quoted[0][0]} has value {quoted[0][1]!r}, with a quote "
            '(") inside; is it a stray quote?'
        )
      yield first, dict(zip(header, fields))
  except csv.Error as e:
    if "unexpected end of data" in str(e):  # A quote opened on `first` and never closed.
      raise UserError(
          f"{path}:{first}: a quoted field runs from line {first} to the end of the file; "
          'is a quote (") left unclosed?'
      ) from None
    raise UserError(f"{path}:{reader.line_num}: {e}.") from None


def read_ground_truth(path: str | os.PathLike) -> dict[str, int]:
  """Reads the one-hot ground truth into {image: class index into ``CLASS_NAMES``}."""
  path = pathlib.Path(path)
  columns = (*CLASS_NAMES, UNKNOWN_CLASS)
  labels: dict[str, int] = {}
  for line, row in _read_csv(path, ("image", *columns)):
    onehot = []
    for column in columns:
      text = row[column].strip()
      try:
        value = float(text)
      except ValueError:
        value = math.nan
      if value not in (0.0, 1.0):
        raise UserError(f"{path}:{line}: column {column} has value {text!r}; expected 0 or 1.")
      onehot.append(value)
    if sum(onehot) != 1:
      raise UserError(
          f"{path}:{line}: columns {' '.join(columns)} are not one-hot " f"(sum {sum(onehot):g})."
      )
    if onehot[-1]:
      raise UserError(
          f"{path}:{line}: column {UNKNOWN_CLASS} is 1; only the 8 diagnostic classes "
          f"{' '.join(CLASS_NAMES)} are supported."
      )
    image = row["image"].strip()
    if image in labels:
      raise UserError(f"{path}:{line}: image {image} is listed twice.")
    labels[image] = onehot.index(1.0)
  return labels


def read_metadata(path: str | os.PathLike) -> dict[str, tuple[int, int, int]]:
  """Reads the metadata into {image: (sex, age, site)} group indices, -1 = missing."""
  path = pathlib.Path(path)
  metadata: dict[str, tuple[int, int, int]] = {}
  columns = ("image", "age_approx", "anatom_site_general", "sex")
  for line, row in _read_csv(path, columns):
    sex = row["sex"].strip().lower()
    if sex and sex not in SEX_GROUPS:
      raise UserError(
          f"{path}:{line}: column sex has value {row['sex']!r}; expected "
          f"{' or '.join(SEX_GROUPS)} or empty."
      )
    age_text = row["age_approx"].strip()
    age = -1
    if age_text:
      try:
        years = float(age_text)
      except ValueError:
        years = math.nan
      if not 0 <= years < 200:
        raise UserError(
            f"{path}:{line}: column age_approx has value {age_text!r}; expected an age in "
            "years or empty."
        )
      age = age_group(years)
    site = row["anatom_site_general"].strip().lower()
    if site and site not in SITE_GROUPS:
      raise UserError(
          f"{path}:{line}: column anatom_site_general has value "
          f"{row['anatom_site_general']!r}; expected one of {', '.join(SITE_GROUPS)} or empty."
      )
    image = row["image"].strip()
    if image in metadata:
      raise UserError(f"{path}:{line}: image {image} is listed twice.")
    metadata[image] = (
        SEX_GROUPS.index(sex) if sex else -1,
        age,
        SITE_GROUPS.index(site) if site else -1,
    )
  return metadata


def isic2019_info(
    sensitive: Sequence[str], missing: str, image_size: int, load_stats=None
) -> DatasetInfo:
  """The ``DatasetInfo`` of ISIC 2019 with the given sensitive attributes."""
  extra = (UNKNOWN_GROUP,) if missing == "unknown" else ()
  return DatasetInfo(
      name="isic2019",
      num_classes=len(CLASS_NAMES),
      class_names=CLASS_NAMES,
      attribute_names=tuple(sensitive),
      group_names=tuple(GROUPS[name] + extra for name in sensitive),
      image_size=image_size,
      load_stats=dict(load_stats or {}),
  )


def random_split(
    images: Sequence[str], seed: int, test_fraction: float, val_fraction: float
) -> dict[str, int]:
  """Seeded random train/val/test assignment {image: 0 train / 1 val / 2 test}.

  Called on all ground-truth rows, not only those with an image file, so that an image's
  split does not depend on which other images are on disk.
  """
  order = np.random.default_rng(seed).permutation(len(images))
  n_test = round(test_fraction * len(images))
  n_val = round(val_fraction * (len(images) - n_test))
  split_of = np.zeros(len(images), np.int64)
  split_of[order[:n_test]] = 2
  split_of[order[n_test : n_test + n_val]] = 1
  return {image: int(s) for image, s in zip(images, split_of)}


def read_split_files(split: str) -> tuple[dict[str, int], dict[str, str]]:
  """Reads a given split: {image: 0/1/2} and {image: file and line it came from}.

  ``split`` is a directory with ``{train,val,test}.csv`` (only their ``image`` column is read:
  labels come from the official ground truth), or one CSV with ``image`` and ``split``.
  """
  path = pathlib.Path(split)
  assignment: dict[str, int] = {}
  origin: dict[str, str] = {}

  def add(image: str, split_id: int, where: str):
    if image in assignment:
      raise UserError(f"{where}: image {image} is already in the split at {origin[image]}.")
    assignment[image] = split_id
    origin[image] = where

  if path.is_dir():
    for split_id, name in enumerate(SPLITS):
      file = path / f"{name}.csv"
      for line, row in _read_csv(file, ("image",)):
        add(row["image"].strip(), split_id, f"{file}:{line}")
  elif path.is_file():
    for line, row in _read_csv(path, ("image", "split")):
      name = row["split"].strip()
      if name not in SPLITS:
        raise UserError(
            f"{path}:{line}: column split has value {name!r}; expected train, val or test."
        )
      add(row["image"].strip(), SPLITS.index(name), f"{path}:{line}")
  else:
    raise UserError(
        f"ISIC split {split!r} is neither 'random' nor an existing directory or CSV file."
    )
  return assignment, origin


def load_isic2019(
    *,
    root: str,
    image_size: int,
    sensitive: Sequence[str] = ("sex", "age", "site"),
    missing: str = "unknown",
    split: str = "random",
    split_seed: int = 0,
    test_fraction: float = 0.2,
    val_fraction: float = 0.05,
    preload: bool = True,
    max_examples_per_split: int = 0,
    num_threads: int = images_lib.DEFAULT_NUM_THREADS,
) -> tuple[DatasetInfo, Splits]:
  """Loads the ISIC 2019 training part with sensitive attributes from its metadata.

  ``sensitive``: any of ``sex``, ``age``, ``site``, in the column order wanted; ``split``:
  ``"random"`` (``random_split`` over all ground-truth rows) or a split directory or CSV
  (``read_split_files``); other arguments as ``load_celeba``'s. Splits are in ground-truth
  order; ``info.load_stats`` counts the rows, image files, unmatched rows of each kind, missing
  values per attribute and each split's examples.
  """
  sensitive = check_sensitive("isic2019", sensitive, tuple(GROUPS))
  if missing not in MISSING_MODES:
    raise UserError(f"ISIC missing={missing!r}: expected one of {', '.join(MISSING_MODES)}.")
  if not (0 <= test_fraction < 1 and 0 <= val_fraction < 1):
    raise UserError(
        f"ISIC test_fraction={test_fraction} and val_fraction={val_fraction} must be in [0, 1)."
    )
  root_path, image_dir = images_lib.layout_dirs(root, IMAGE_DIR, "ISIC")
  labels = read_ground_truth(root_path / GROUND_TRUTH_FILE)
  metadata = read_metadata(root_path / METADATA_FILE)
  image_files = {
      entry.name[:-4] for entry in os.scandir(image_dir) if entry.name.lower().endswith(".jpg")
  }
  names = list(labels)
  stats = {
      "label_rows": len(names),
      "image_files": len(image_files),
      "rows_without_image": sum(name not in image_files for name in names),
      "rows_without_metadata": sum(name not in metadata for name in names),
      "metadata_rows_without_label": sum(name not in labels for name in metadata),
  }
  all_missing = (-1, -1, -1)
  groups = np.array([metadata.get(name, all_missing) for name in names], np.int32).reshape(-1, 3)
  for j, attribute in enumerate(GROUPS):
    stats[f"missing_{attribute}"] = int((groups[:, j] < 0).sum())
  if split == "random":
    assignment = random_split(names, split_seed, test_fraction, val_fraction)
    stats["split_rows_unknown_image"] = 0
  else:
    assignment, _ = read_split_files(split)
    stats["split_rows_unknown_image"] = sum(image not in labels for image in assignment)
  has_image = np.array([name in image_files for name in names], bool)
  split_of = np.array([assignment.get(name, -1) for name in names], np.int64)
  stats["unassigned_rows"] = int((has_image & (split_of < 0)).sum())

  columns = [list(GROUPS).index(name) for name in sensitive]
  attributes = groups[:, columns]
  if missing == "unknown":
    # "unknown" is the last group of each attribute.
    sizes = np.array([len(GROUPS[name]) for name in sensitive], np.int32)
    attributes = np.where(attributes < 0, sizes, attributes)
  label_array = np.array([labels[name] for name in names], np.int32)
  image_dir_abs = image_dir.resolve()
  splits: Splits = {}
  for split_id, split_name in enumerate(SPLITS):
    indices = np.flatnonzero(has_image & (split_of == split_id))
    if max_examples_per_split > 0:
      indices = indices[:max_examples_per_split]
    splits[split_name] = {
        "path": np.array([str(image_dir_abs / f"{names[i]}.jpg") for i in indices], dtype=object),
        "label": label_array[indices],
        "attributes": attributes[indices].astype(np.int32),
    }
    stats[f"{split_name}_examples"] = len(indices)
  report_counts(f"isic2019 ({root_path})", stats)
  if preload:
    splits = {k: images_lib.preload_images(v, image_size, num_threads) for k, v in splits.items()}
  return isic2019_info(sensitive, missing, image_size, stats), splits
