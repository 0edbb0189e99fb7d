"""Sentence-pair classification data (NLI and paraphrase) from official files or tfds.

Every reader returns a ``PairData``: premises, hypotheses and int32 labels in a
fixed label vocabulary, so a model trained on one file scores another with the
same class indices:

* task ``"nli"``: ``NLI_LABELS`` = entailment 0, neutral 1, contradiction 2 (the
  order of tfds ``snli``/``glue/mnli`` and of the GLUE/HF label ids);
* HANS (read with task ``"nli"``): ``HANS_LABELS`` = entailment 0,
  non-entailment 1. A 3-way MNLI model is scored on HANS by collapsing its
  predictions with ``nli_to_hans`` (neutral and contradiction are both
  non-entailment), as in McCoy et al. (2019);
* task ``"paraphrase"``: ``PARAPHRASE_LABELS`` = not_paraphrase 0, paraphrase 1
  (QQP ``is_duplicate`` and PAWS ``label`` are already 0/1).

SNLI/MNLI rows whose ``gold_label`` is ``-`` had no majority among the five
annotators; the standard practice (the SNLI and MNLI papers, GLUE, tfds) is to
drop them from training and evaluation, so they are skipped and counted in
``PairData.stats["skipped_no_consensus"]``. Any other label outside the
vocabulary is an error naming file and line, never a silent drop: a typo or a
wrong column would otherwise shrink the data unnoticed.

Formats (``read_pairs`` picks one from the extension and the header row):

* ``.jsonl``: SNLI/MNLI official jsonl (``sentence1``, ``sentence2``, ``gold_label``);
* tab-separated with a header (``.tsv``/``.txt``), columns found by name:

  - HANS ``heuristics_evaluation_set.txt``: ``gold_label``, ``sentence1``,
    ``sentence2``, ``heuristic`` (kept per example), ``subcase``, ``template``;
  - MNLI/SNLI/GLUE: ``sentence1``/``premise``, ``sentence2``/``hypothesis``,
    ``gold_label`` (else ``label``);
  - QQP (GLUE): ``question1``, ``question2``, ``is_duplicate``;
  - PAWS: ``sentence1``, ``sentence2``, ``label``.

TSV fields are split on tabs only, with no quote handling: GLUE files contain
unbalanced ``"`` that a CSV reader would merge across lines.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from trainkit.errors import UserError, import_extra
from trainkit.textfiles import iter_lines

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
  """Sentence pairs with labels in a fixed vocabulary.

  Attributes:
    premises: First sentences (premise, question1), whitespace-stripped.
    hypotheses: Second sentences (hypothesis, question2).
    labels: int32 [N], indices into ``label_names``.
    label_names: The label vocabulary (``NLI_LABELS``, ``HANS_LABELS`` or
      ``PARAPHRASE_LABELS``).
    source: File or tfds dataset the pairs came from (for messages).
    heuristics: HANS only: the ``heuristic`` of each pair (lexical_overlap,
      subsequence, constituent), for per-heuristic accuracy; else None.
    subcases: HANS only: the ``subcase`` of each pair; else None.
    stats: What the reader counted: ``rows``, ``examples``,
      ``skipped_no_consensus``, ``empty_text`` and ``label_<name>``.
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
  """Maps 3-way NLI predictions (``NLI_LABELS``) to ``HANS_LABELS`` indices.

  HANS has no neutral/contradiction distinction, so both become
  non-entailment; this is how MNLI models are scored on HANS.
  """
  predictions = np.asarray(predictions)
  return np.where(predictions == NLI_LABELS.index("entailment"), 0, 1).astype(np.int32)


def _report(source: str, stats: Mapping[str, int]) -> None:
  """Logs and prints the counts once, so skipped rows are visible in every run."""
  message = f"{source}: " + ", ".join(f"{k}={v}" for k, v in stats.items())
  logging.info(message)
  print(message, flush=True)


def _check_task(task: str) -> None:
  if task not in TASKS:
    raise UserError(f"sentence-pair task {task!r} is unknown; expected one of {', '.join(TASKS)}.")


def _open_lines(path: pathlib.Path) -> Iterator[tuple[int, str]]:
  """Yields (1-based line number, line without its newline).

  Lines are split on '\\n' only: ``str.splitlines`` also splits on characters
  such as U+2028 and U+0085 that occur inside real sentences.
  """
  # Split on "\n" only: a lone "\r" inside a sentence must not end the line.
  yield from iter_lines(path, "sentence-pair")


class _Builder:
  """Accumulates pairs and counts for one file.

  ``NO_CONSENSUS`` rows are skipped only for the 3-way NLI vocabulary (SNLI,
  MNLI); in HANS or paraphrase files a ``-`` is an unknown label.
  """

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
    """UserError naming the file when it gave no example (read nothing, or skipped every row).

    `rows` says what a row is in this format ("rows below the header", "JSON lines").
    """
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
      _report(self.source, self.stats)
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

  Rows with ``gold_label`` ``-`` (no annotator consensus) are skipped and
  counted. Blank lines are ignored.

  Raises:
    UserError: A line is not a JSON object, lacks a field, or has a label
      outside ``NLI_LABELS`` and ``-``; the message names file, line and field.
      A file without an example (no line, or every row ``-``) names the file.
  """
  path = pathlib.Path(path)
  builder = _Builder(str(path), NLI_LABELS)
  for number, line in _open_lines(path):
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
  """Yields (line number, fields) of a tab-separated file; the header comes first.

  Raises:
    UserError: A row's field count differs from the header's (file and line).
  """
  width = None
  for number, line in _open_lines(path):
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

  HANS is recognised by its ``heuristic`` column and read with ``HANS_LABELS``
  (it needs ``task="nli"``). For ``task="paraphrase"`` a header with
  ``question1`` is QQP, otherwise PAWS.

  Raises:
    UserError: A required column is missing (the header is listed), a row has
      the wrong field count, or a label is outside the vocabulary (file, line
      and field are named); the file has no example (only a header, or every
      row ``-``).
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
  """Reads a sentence-pair file, choosing the format from its extension and header.

  Args:
    path: A ``.jsonl`` (SNLI/MNLI) file, or a tab-separated file with a header
      (MNLI/GLUE ``.tsv``, MNLI ``.txt``, QQP, PAWS, HANS).
    task: ``"nli"`` (``NLI_LABELS``; ``HANS_LABELS`` for HANS) or
      ``"paraphrase"`` (``PARAPHRASE_LABELS``).
    report: Print and log the counts (rows, skipped, per label).

  Returns:
    The pairs in file order, minus no-consensus (``-``) rows.

  Raises:
    UserError: The file is missing or unreadable, or a row is malformed or has
      an unknown label (the message names file and line).
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
  """Loads ``snli``, ``glue/mnli`` or ``glue/qqp`` already prepared in ``data_dir``.

  Nothing is downloaded or prepared here (a missing dataset is a user error),
  and tensorflow_datasets is imported only when this is called. A dataset in
  ``array_record`` format is read without TensorFlow; ``tfrecord`` needs
  TensorFlow, which this project does not depend on. Examples with label -1
  (SNLI no-consensus, GLUE unlabeled test splits) are skipped and counted.

  Args:
    name: One of ``TFDS_PAIR_DATASETS``.
    split: A tfds split, e.g. ``train``, ``validation`` (snli, qqp),
      ``validation_matched`` (mnli).
    data_dir: tfds data directory holding ``<name>/<version>/``.
    max_examples: If > 0, read only the first this many examples.
    report: Print and log the counts.
  """
  if name not in TFDS_PAIR_DATASETS:
    raise UserError(
        f"tfds sentence-pair dataset {name!r} is not supported; expected one of "
        f"{', '.join(TFDS_PAIR_DATASETS)}."
    )
  task, first, second = TFDS_PAIR_DATASETS[name]
  builder = tfds_builder(name, data_dir)
  if split not in builder.info.splits:
    raise UserError(
        f"tfds {name} in {data_dir} has no split {split!r}; available: "
        f"{', '.join(builder.info.splits)}."
    )
  label_names = NLI_LABELS if task == "nli" else PARAPHRASE_LABELS
  source = f"tfds {name}[{split}] ({builder.data_dir})"
  pairs = _Builder(source, label_names)
  skipped = 0
  for i, example in enumerate(tfds_examples(builder, split, max_examples)):
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
        _text(example[first]),
        _text(example[second]),
        label_names[label],
    )
  pairs.stats["skipped_no_label"] = skipped
  data = pairs.build(report)
  if not len(data):
    raise UserError(f"{source} has no labeled examples ({skipped} have label -1).")
  return data


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def tfds_builder(name: str, data_dir: str | os.PathLike) -> Any:
  """The tfds builder of a dataset prepared in ``data_dir``; never downloads.

  Shared with the translation loaders.

  Raises:
    UserError: tensorflow_datasets is missing or the dataset is not prepared there.
  """
  tfds = import_extra("tensorflow_datasets", "causal", f"tfds dataset {name}")
  hint = (
      f"prepare it there first (e.g. `tfds build {name} --data_dir={data_dir} "
      "--file_format=array_record`); it is never downloaded here."
  )
  try:
    builder = tfds.builder(name, data_dir=os.fspath(data_dir))
  except Exception as e:  # pylint: disable=broad-except
    # Without TensorFlow some builders (glue, wmt) are not registered and tfds
    # looks only in data_dir, so "not found" means "not prepared".
    raise UserError(
        f"tfds dataset {name} is not prepared in {data_dir} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); {hint}"
    ) from e
  if not builder.is_prepared():
    raise UserError(
        f"tfds dataset {name} is not prepared in {data_dir} (looked for {builder.data_dir}); "
        f"{hint}"
    )
  return builder


def tfds_examples(builder: Any, split: str, max_examples: int = 0) -> Iterator[Mapping[str, Any]]:
  """Yields numpy examples of a split, without TensorFlow when stored as array_record."""
  file_format = str(getattr(builder.info, "file_format", "") or "")
  if "array_record" in file_format or importlib.util.find_spec("tensorflow") is None:
    try:
      source = builder.as_data_source(split=split)
    except Exception as e:  # pylint: disable=broad-except
      raise UserError(
          f"tfds {builder.info.full_name} in {builder.data_dir} is stored as "
          f"{file_format or 'tfrecord'}, which needs TensorFlow to read; install tensorflow "
          f"or prepare it with --file_format=array_record ({type(e).__name__}: {e})."
      ) from e
    n = len(source)
    n = min(n, max_examples) if max_examples > 0 else n
    for i in range(n):
      yield source[i]
    return
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  dataset = builder.as_dataset(split=split, shuffle_files=False)
  if max_examples > 0:
    dataset = dataset.take(max_examples)
  yield from tfds.as_numpy(dataset)
