"""Per-example predictions of an evaluation, as the columns of a run's ``predictions.csv``
(docs/report.md, "Per-example predictions"): one row per test example, in split order.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from fairmoe_jax.data.types import DatasetInfo
from trainkit.storage import write_atomically


def gather_examples(batches: list[Mapping[str, Any]], num_examples: int) -> dict[str, Any]:
  """Host per-example outputs of an eval loop, padding dropped and rows in split order.

  ``batches`` (at least one) hold numpy ``index`` [B] (-1 for padding), ``prediction`` [B],
  ``probabilities`` [B, C] and ``experts`` ``{block: [B, E]}``.
  """
  index = np.concatenate([b["index"] for b in batches]).astype(np.int64)
  keep = index >= 0
  order = np.argsort(index[keep], kind="stable")

  def rows(key: str, block: str | None = None) -> np.ndarray:
    parts = [b[key] if block is None else b[key][block] for b in batches]
    return np.concatenate(parts)[keep][order]

  index = index[keep][order]
  # Every process contributes its share; a hole or a repeat would misalign the file.
  if not np.array_equal(index, np.arange(num_examples)):
    raise RuntimeError(
        f"evaluation returned {len(index)} rows for a split of {num_examples} examples"
    )
  return {
      "index": index,
      "prediction": rows("prediction"),
      "probabilities": rows("probabilities"),
      "experts": {block: rows("experts", block) for block in batches[0]["experts"]},
  }


def example_ids(split: Mapping[str, np.ndarray]) -> np.ndarray:
  """What names each example of ``split``: its file name where known, else its row."""
  if "id" in split:
    return np.asarray(split["id"])
  if "path" in split:
    return np.array([os.path.basename(str(p)) for p in split["path"]], dtype=object)
  return np.arange(len(split["label"]))


def prediction_columns(
    examples: Mapping[str, Any], split: Mapping[str, np.ndarray], info: DatasetInfo
) -> dict[str, np.ndarray]:
  """The columns of predictions.csv from ``gather_examples``'s output."""
  index = examples["index"]
  columns: dict[str, np.ndarray] = {
      "example_id": example_ids(split)[index],
      "label": np.asarray(split["label"])[index],
      "prediction": examples["prediction"],
  }
  columns.update(probability_columns(examples))
  attributes = np.asarray(split["attributes"])[index]
  for j, (name, groups) in enumerate(zip(info.attribute_names, info.group_names)):
    if name in columns:
      raise ValueError(f"sensitive attribute {name!r} clashes with a predictions.csv column")
    names = np.array([*groups, ""], dtype=object)
    columns[name] = names[attributes[:, j]]  # -1 (missing) picks the trailing "".
  columns.update(expert_columns(examples))
  return columns


def probability_columns(examples: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """`prob_<c>` per class from ``gather_examples``'s output."""
  probabilities = examples["probabilities"]
  return {f"prob_{c}": probabilities[:, c] for c in range(probabilities.shape[1])}


def expert_columns(examples: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """`<block>/expert_<e>`: per example, the share of its (token, choice) pairs each expert took."""
  return {
      f"{block}/expert_{e}": fraction[:, e]
      for block, fraction in examples["experts"].items()
      for e in range(fraction.shape[1])
  }


def write_csv(path: str, columns: Mapping[str, np.ndarray]) -> None:
  """Writes equal-length ``columns`` as a CSV with a header row."""

  def cell(value: Any) -> Any:
    # Six significant digits keep the file small while probabilities still sum to 1 to ~1e-6.
    if isinstance(value, str):  # A file name that is not UTF-8: its other bytes as \xNN.
      return os.fsencode(value).decode(errors="backslashreplace")
    return f"{value:.6g}" if isinstance(value, (float, np.floating)) else value

  names = list(columns)
  text = io.StringIO(newline="")
  writer = csv.writer(text)
  writer.writerow(names)
  for row in zip(*(columns[name] for name in names)):
    writer.writerow([cell(v) for v in row])
  # Whole or not at all: a rerun's crash must not leave a torn file in place of a good one.
  write_atomically(path, text.getvalue())
