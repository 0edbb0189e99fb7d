"""A trained run restored from its workdir alone, for `--mode=predict` and Python (`load_run`,
then `run.predict_pairs(pairs)` or `run.translate(sentences)`, as `--mode=predict` predicts).
"""

from __future__ import annotations

import csv
import functools
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from causal_attn_jax import config as config_lib
from causal_attn_jax import decoding, tasks, train
from causal_attn_jax.data import tokenizer as tokenizer_lib
from causal_attn_jax.data.loading import TaskData
from causal_attn_jax.data.tokenizer import Tokenizer
from causal_attn_jax.run_info import RunMetadata
from trainkit import storage, trained_run
from trainkit.errors import ConfigError, UserError
from trainkit.saved_config import restore_saved_run
from trainkit.storage import write_atomically
from trainkit.workdir import RUN_INFO_FILE, output_folder


def restore_run(config: ml_collections.ConfigDict, workdir: str) -> TrainedRun:
  """The latest readable checkpoint of `workdir`, from the workdir alone: config, tokenizer,
  run_info.json and checkpoints (no data file); its `data` holds the tokenizer and label names, no
  examples. No readable checkpoint is a UserError."""
  train.require_tokenizer(workdir)
  metadata = RunMetadata.load(workdir)
  if metadata.task != config.task:
    raise UserError(
        f"{workdir}/{RUN_INFO_FILE} is a {metadata.task} run's, but the config "
        f"says task={config.task!r}"
    )
  # The saved vocabulary; load_or_train checks it has the config's settings and never retrains.
  tokenizer = tokenizer_lib.load_or_train(
      workdir,
      (),
      config.data.vocab_size,
      model_type=config.data.tokenizer_type,
      name=os.path.splitext(metadata.tokenizer)[0],
      seed=config.seed,
  )
  data = TaskData(
      tokenizer=tokenizer,
      train={},
      eval={},
      num_classes=len(metadata.label_names),
      label_names=metadata.label_names,
  )
  return TrainedRun.restore(config, workdir, metadata, data, train.create_state)


PREDICT_FILE = os.path.join("predict", "predictions.tsv")


def predict_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Runs the latest checkpoint on `predict.input` into `<workdir>/predict/predictions.tsv`.

  Pairs: a TSV of `premise<TAB>hypothesis` lines -> label and each label's probability;
  translation: one source sentence per line -> its beam-search translation. Blank lines (and,
  for pairs, # lines) are skipped. Reads the workdir alone.
  """
  if not config.predict.input:
    raise ConfigError("predict.input", "--mode=predict needs --config.predict.input=FILE")
  output_folder(workdir, os.path.dirname(PREDICT_FILE), create=False)  # Before the restore.
  restored = restore_run(config, workdir)
  columns = tasks.get_task(config).predict(
      config,
      restored.data,
      restored.state,
      graphdef=restored.graphdef,
      mesh=restored.mesh,
      path=config.predict.input,
  )
  path = storage.join(workdir, PREDICT_FILE)
  if jax.process_index() == 0:
    output_folder(workdir, os.path.dirname(PREDICT_FILE))
    names = list(columns)
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t", quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
    writer.writerow(names)
    writer.writerows(zip(*(columns[name] for name in names)))
    write_atomically(path, text.getvalue())
    rows = len(columns[names[0]])
    print(f"Predicted {rows} inputs with the checkpoint of step {restored.step}: {path}")
  return path


class PairPredictions(NamedTuple):
  """What `TrainedRun.predict_pairs` returns for N sentence pairs, in their order.

  Attributes:
    probabilities: float32 [N, C], columns named by `RunMetadata.label_names`.
    classes: int [N], the most probable label.
    labels: The name of each pair's most probable label.
  """

  probabilities: np.ndarray
  classes: np.ndarray
  labels: list[str]


class TrainedRun(trained_run.TrainedRun):
  """A trained run loaded by `load_run`, with its metadata (task, label names), tokenizer,
  `predict_pairs` and `translate`; its `model` is a `PairClassifier` or a `Seq2Seq`."""

  metadata: RunMetadata
  data: TaskData

  @property
  def tokenizer(self) -> Tokenizer:
    """The run's SentencePiece tokenizer (its workdir's model file)."""
    return self.data.tokenizer

  @functools.cached_property
  def _pair_probabilities(self) -> tasks.PairProbabilities:
    return tasks.make_pair_probabilities(self.graphdef)

  @functools.cached_property
  def _translate(self) -> decoding.TranslateFn:
    return decoding.make_translate_fn(self.graphdef, self.config)

  def predict_pairs(self, pairs: Sequence[tuple[str, str]]) -> PairPredictions:
    """Classifies (premise, hypothesis) string pairs as `--mode=predict` does.

    Returns label probabilities, classes and labels, one row per pair.

    Raises:
      TypeError: The run is a translation run, or a pair is not two strings.
      ValueError: `pairs` is empty.
    """
    self._require_task("classification", "predict_pairs", "translate")
    pairs = list(pairs)
    if not pairs:
      raise ValueError("predict_pairs needs at least one (premise, hypothesis) pair")
    for i, pair in enumerate(pairs):
      if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
        raise TypeError(f"pair {i}: expected (premise, hypothesis) strings, got {pair!r}")
    probabilities = tasks.pair_probabilities(
        self.config,
        self.data,
        self.state,
        self._pair_probabilities,
        self.mesh,
        [premise for premise, _ in pairs],
        [hypothesis for _, hypothesis in pairs],
    )
    classes = probabilities.argmax(-1)
    return PairPredictions(
        probabilities=probabilities,
        classes=classes,
        labels=[self.metadata.label_names[c] for c in classes],
    )

  def translate(self, sentences: Sequence[str]) -> list[str]:
    """Translates sentences as `--mode=predict` does (beam search, `nmt.*`), in order.

    Raises:
      TypeError: The run is a pair classification run, or a sentence is not a string.
      ValueError: `sentences` is empty.
    """
    self._require_task("translation", "translate", "predict_pairs")
    if isinstance(sentences, str):
      raise TypeError(f"translate takes a list of sentences; for one, pass [{sentences!r}]")
    sentences = list(sentences)
    if not sentences:
      raise ValueError("translate needs at least one sentence")
    for i, sentence in enumerate(sentences):
      if not isinstance(sentence, str):
        raise TypeError(f"sentence {i}: expected a string, got {sentence!r}")
    return tasks.translate_sentences(
        self.config, self.data, self.state, self._translate, self.mesh, sentences
    )

  def _require_task(self, task: str, method: str, other: str) -> None:
    if self.metadata.task != task:
      raise TypeError(
          f"{method} needs a {task} run; {self.workdir} is a {self.metadata.task} run "
          f"(use {other})"
      )

  def __repr__(self) -> str:
    labels = f", labels={list(self.metadata.label_names)}" if self.metadata.label_names else ""
    return (
        f"TrainedRun(workdir={self.workdir!r}, task={self.metadata.task!r}, "
        f"attention={self.config.model.attention!r}, step={self.step}{labels})"
    )


def load_run(workdir: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> TrainedRun:
  """Loads a trained run from its workdir alone (config.json, tokenizer, run_info.json,
  latest checkpoint).

  Args:
    workdir: The working directory a training run (`python -m causal_attn_jax.main`) wrote.
    overrides: Config keys to change by dotted name, as `--config.KEY=VALUE`, e.g.
      `{"nmt.beam_size": 1}`.

  Raises:
    trainkit.errors.UserError: No config.json, tokenizer or readable checkpoint, or another
      run holds the workdir; a ConfigError names a wrong override.
  """
  _, _, run = restore_saved_run(
      workdir, config_lib.base_config(), config_lib.validate, restore_run, overrides
  )
  return run
