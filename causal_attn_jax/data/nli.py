"""Sentence-pair classification data (NLI and paraphrase) from official files or tfds.

Labels use a fixed vocabulary, so a model trained on one file scores another with the same
class indices: ``NLI_LABELS`` (the order of tfds ``snli``/``glue/mnli`` and the GLUE ids),
``HANS_LABELS`` (a 3-way MNLI model is scored on HANS through ``nli_to_hans``, as in McCoy et
al. 2019) and ``PARAPHRASE_LABELS`` (QQP ``is_duplicate`` and PAWS ``label`` are already 0/1).

SNLI/MNLI rows with ``gold_label`` ``-`` (no annotator majority) are dropped, as the SNLI and
MNLI papers, GLUE and tfds do, and counted in ``stats["skipped_no_consensus"]``. Any other
unknown label is an error naming file and line: a typo or a wrong column would otherwise
shrink the data unnoticed.

``read_pairs`` reads SNLI/MNLI ``.jsonl`` or a tab-separated file with a header, its columns
found by name: HANS (``heuristic``, ``subcase``), MNLI/SNLI/GLUE (``sentence1``/``premise``,
``sentence2``/``hypothesis``, ``gold_label``/``label``), QQP (``question1``, ``question2``,
``is_duplicate``), PAWS (``sentence1``, ``sentence2``, ``label``). TSV fields are split on
tabs only, without quote handling: GLUE files contain unbalanced ``"`` that a CSV reader
would merge across lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from trainkit import tfds_data
from trainkit.errors import UserError
from trainkit.textfiles import iter_lines, report_counts

NLI_LABELS = ("entailment", "neutral", "contradiction")
HANS_LABELS = ("entailment", "non-entailment")
PARAPHRASE_LABELS = ("not_paraphrase", "paraphrase")
TASKS = ("nli", "paraphrase")
# gold_label of SNLI/MNLI pairs without a majority label among annotators.
NO_CONSENSUS = "-"
# tfds stores no-consensus (SNLI) and unlabeled test examples (GLUE) as -1.
_TFDS_NO_LABEL = -1

TFDS_PAIR_DATASETS = {
    # name: (task, premise feature, hypothesis feature)
    "snli": ("nli", "premise", "hypothesis"),
    "glue/mnli": ("nli", "premise", "hypothesis"),
    "glue/qqp": ("paraphrase", "question1", "question2"),
}


@dataclasses.dataclass
class PairData:
  """Sentence pairs (whitespace-stripped) with int32 [N] ``labels`` indexing ``label_names``.

  ``heuristics`` and ``subcases`` are HANS's per-pair columns (else None); ``stats`` holds the
  reader's counts (``rows``, ``examples``, ``skipped_no_consensus``, ``empty_text``,
  ``label_<name>``).
  """

  premises: list[str]
  hypotheses: list[str]
  labels: np.ndarray
  label_names: tuple[str, ...]
  source: str
  heuristics: list[str] | None = None
  subcases: list[str] | None = None
  stats: dict[str, int] = dataclasses.field(default_factory=dict)

  def __len__(self) -> int:
    return len(self.labels)

  @property
  def num_classes(self) -> int:
    return len(self.label_names)


def nli_to_hans(predictions: np.ndarray) -> np.ndarray:
  """Maps 3-way NLI predictions to ``HANS_LABELS``: neutral and contradiction are non-entailment."""
  predictions = np.asarray(predictions)
  return np.where(predictions == NLI_LABELS.index("entailment"), 0, 1).astype(np.int32)


def _check_task(task: str) -> None:
  if task not in TASKS:
    raise UserError(f"sentence-pair task {task!r} is unknown; expected one of {', '.join(TASKS)}.")


class _Builder:
  """Accumulates pairs and counts for one file; ``-`` is skipped only with ``NLI_LABELS``."""

  def __init__(self, source: str, label_names: tuple[str, ...], keep_heuristics: bool = False):
    self.source = source
    self.skip_no_consensus = label_names == NLI_LABELS
    self.label_names = label_names
    self.index = {name: i for i, name in enumerate(label_names)}
    self.premises: list[str] = []
    self.hypotheses: list[str] = []
    self.labels: list[int] = []
    self.heuristics: list[str] | None = [] if keep_heuristics else None
    self.subcases: list[str] | None = [] if keep_heuristics else None
    self.stats = {"rows": 0, "examples": 0, "skipped_no_consensus": 0, "empty_text": 0}

  def add(
      self,
      where: str,
      field: str,
      premise: str,
      hypothesis: str,
      label: str,
      heuristic: str = "",
      subcase: str = "",
  ) -> None:
    self.stats["rows"] += 1
    label = label.strip()
    if label == NO_CONSENSUS and self.skip_no_consensus:
      self.stats["skipped_no_consensus"] += 1
      return
    if label not in self.index:
      raise UserError(
          f"{where}: field {field} has label {label!r}; expected one of "
          f"{', '.join(self.label_names)}"
          + (f" (or {NO_CONSENSUS!r}, skipped)." if self.skip_no_consensus else ".")
      )
    premise, hypothesis = premise.strip(), hypothesis.strip()
    if not premise or not hypothesis:
      # Kept (e.g. a few QQP questions are empty), but counted.
      self.stats["empty_text"] += 1
    self.premises.append(premise)
    self.hypotheses.append(hypothesis)
    self.labels.append(self.index[label])
    if self.heuristics is not None:
      self.heuristics.append(heuristic.strip())
      self.subcases.append(subcase.strip())

  def require_examples(self, rows: str) -> None:
    """UserError naming the file when it gave no example; `rows` names a row in the format."""
    if self.labels:
      return
    if not self.stats["rows"]:
      raise UserError(f"{self.source}: the file has no {rows}, so there are no pairs to read.")
    raise UserError(
        f"{self.source}: none of its {self.stats['rows']} rows is an example "
        f"({self.stats['skipped_no_consensus']} have label {NO_CONSENSUS!r}, no consensus)."
    )

  def build(self, report: bool = True) -> PairData:
    labels = np.asarray(self.labels, np.int32)
    self.stats["examples"] = len(labels)
    for i, name in enumerate(self.label_names):
      self.stats[f"label_{name}"] = int((labels == i).sum())
    if report:
      report_counts(self.source, self.stats)
    return PairData(
        premises=self.premises,
        hypotheses=self.hypotheses,
        labels=labels,
        label_names=self.label_names,
        source=self.source,
        heuristics=self.heuristics,
        subcases=self.subcases,
        stats=dict(self.stats),
    )


def read_nli_jsonl(path: str | os.PathLike, *, report: bool = True) -> PairData:
  """Reads SNLI/MNLI official jsonl (``sentence1``, ``sentence2``, ``gold_label``).

  Raises:
    UserError: A malformed line or unknown label (file, line and field named), or no example.
  """
  path = pathlib.Path(path)
  builder = _Builder(str(path), NLI_LABELS)
  for number, line in iter_lines(path, "sentence-pair"):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}: not a JSON object ({e.msg} at column {e.colno}).") from e
    if not isinstance(row, dict):
      raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    for field in ("sentence1", "sentence2", "gold_label"):
      if not isinstance(row.get(field), str):
        raise UserError(f"{where}: field {field} is missing or not a string.")
    builder.add(where, "gold_label", row["sentence1"], row["sentence2"], row["gold_label"])
  builder.require_examples("JSON lines")
  return builder.build(report)


def _read_tsv(path: pathlib.Path) -> Iterator[tuple[int, list[str]]]:
  """Yields (line number, fields) of a tab-separated file, header first; checks field counts."""
  width = None
  for number, line in iter_lines(path, "sentence-pair"):
    if not line.strip():
      continue
    fields = line.split("\t")
    if width is None:
      width = len(fields)
    elif len(fields) != width:
      raise UserError(
          f"{path}:{number}: expected {width} tab-separated fields (as in the header), "
          f"got {len(fields)}."
      )
    yield number, fields
  if width is None:
    raise UserError(f"{path}: the file is empty (expected a header row).")


def _first_present(header: Sequence[str], names: Sequence[str]) -> str | None:
  return next((name for name in names if name in header), None)


def _tsv_format(header: Sequence[str], task: str) -> tuple[str, str, str, str]:
  """(format name, first, second, label column) for a TSV header and task."""
  if "heuristic" in header:
    return "hans", "sentence1", "sentence2", "gold_label"
  if task == "paraphrase":
    if "question1" in header:
      return "qqp", "question1", "question2", "is_duplicate"
    return "paws", "sentence1", "sentence2", "label"
  first = _first_present(header, ("sentence1", "premise")) or "sentence1"
  second = _first_present(header, ("sentence2", "hypothesis")) or "sentence2"
  label = _first_present(header, ("gold_label", "label")) or "gold_label"
  return "mnli", first, second, label


def read_pairs_tsv(path: str | os.PathLike, *, task: str, report: bool = True) -> PairData:
  """Reads a tab-separated sentence-pair file with a header (see the module doc).

  HANS is recognised by its ``heuristic`` column (it needs ``task="nli"``); for
  ``task="paraphrase"`` a header with ``question1`` is QQP, otherwise PAWS.

  Raises:
    UserError: A missing column, a malformed row or unknown label (file, line and field
      named), or no example.
  """
  _check_task(task)
  path = pathlib.Path(path)
  rows = _read_tsv(path)
  header_line, header = next(rows)
  header = [name.strip() for name in header]
  kind, first, second, label = _tsv_format(header, task)
  required = [first, second, label] + (["heuristic", "subcase"] if kind == "hans" else [])
  missing = [name for name in required if name not in header]
  if missing:
    raise UserError(
        f"{path}:{header_line}: missing column(s) {', '.join(missing)} for {kind} "
        f"({task}); header is {' '.join(header)}."
    )
  if kind == "hans" and task != "nli":
    raise UserError(f"{path}: is HANS (has a heuristic column), an NLI set; got task {task!r}.")
  col = {name: header.index(name) for name in required}
  label_names = {"hans": HANS_LABELS, "mnli": NLI_LABELS}.get(kind, PARAPHRASE_LABELS)
  builder = _Builder(str(path), label_names, keep_heuristics=kind == "hans")
  # QQP/PAWS store 0/1: map them to the label names.
  numeric = dict(zip(("0", "1"), PARAPHRASE_LABELS)) if task == "paraphrase" else {}
  for number, fields in rows:
    value = fields[col[label]].strip()
    if numeric and value not in numeric:
      raise UserError(
          f"{path}:{number}: field {label} has value {value!r}; expected 0 or 1 ({kind})."
      )
    builder.add(
        f"{path}:{number}",
        label,
        fields[col[first]],
        fields[col[second]],
        numeric.get(value, value),
        heuristic=fields[col["heuristic"]] if kind == "hans" else "",
        subcase=fields[col["subcase"]] if kind == "hans" else "",
    )
  builder.require_examples("rows below its header")
  return builder.build(report)


def read_pairs(path: str | os.PathLike, *, task: str, report: bool = True) -> PairData:
  """Reads a ``.jsonl`` or header-led tab-separated pair file (module doc), in file order.

  ``task`` is ``"nli"`` or ``"paraphrase"``; ``report`` prints and logs the counts.
  """
  _check_task(task)
  path = pathlib.Path(path)
  if path.suffix.lower() == ".jsonl":
    if task != "nli":
      raise UserError(f"{path}: jsonl files are SNLI/MNLI (task 'nli'); got task {task!r}.")
    return read_nli_jsonl(path, report=report)
  return read_pairs_tsv(path, task=task, report=report)


def load_tfds_pairs(
    name: str,
    *,
    split: str,
    data_dir: str | os.PathLike,
    max_examples: int = 0,
    report: bool = True,
) -> PairData:
  """Loads one of ``TFDS_PAIR_DATASETS`` already prepared in ``data_dir``; never downloads.

  ``array_record`` data is read without TensorFlow (``tfrecord`` needs it, and this project
  does not depend on it). Label -1 (SNLI no-consensus, GLUE unlabeled test) is skipped and
  counted; ``max_examples`` > 0 reads only the first that many.
  """
  if name not in TFDS_PAIR_DATASETS:
    raise UserError(
        f"tfds sentence-pair dataset {name!r} is not supported; expected one of "
        f"{', '.join(TFDS_PAIR_DATASETS)}."
    )
  task, first, second = TFDS_PAIR_DATASETS[name]
  builder = tfds_data.tfds_builder(name, data_dir, "causal", split)
  label_names = NLI_LABELS if task == "nli" else PARAPHRASE_LABELS
  source = f"tfds {name}[{split}] ({builder.data_dir})"
  pairs = _Builder(source, label_names)
  skipped = 0
  for i, example in enumerate(tfds_data.tfds_map(builder, split, max_examples)):
    label = int(example["label"])
    if label == _TFDS_NO_LABEL:
      skipped += 1
      pairs.stats["rows"] += 1
      continue
    if not 0 <= label < len(label_names):
      raise UserError(
          f"{source} example {i}: field label is {label}; expected -1..{len(label_names) - 1}."
      )
    pairs.add(
        f"{source} example {i}",
        "label",
        as_text(example[first]),
        as_text(example[second]),
        label_names[label],
    )
  pairs.stats["skipped_no_label"] = skipped
  data = pairs.build(report)
  if not len(data):
    raise UserError(f"{source} has no labeled examples ({skipped} have label -1).")
  return data


def as_text(value: Any) -> str:
  """A tfds text feature (bytes or str) as str."""
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)
