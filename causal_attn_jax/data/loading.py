"""From a config's `data` section to tokenised numpy splits, for either task: which files or
tfds splits a run reads, the carved eval set, the tokenizer (trained on the training text only)
and fixed-length int32 arrays, in `TaskData`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_collections
import numpy as np

from causal_attn_jax import config as config_lib
from causal_attn_jax.data import nli, translation
from causal_attn_jax.data import tokenizer as tokenizer_lib
from trainkit.distributed import main_process_first
from trainkit.errors import UserError


@dataclasses.dataclass
class TaskData:
  """Tokenised splits as numpy arrays plus what the report needs."""

  tokenizer: tokenizer_lib.Tokenizer
  train: dict[str, np.ndarray]
  eval: dict[str, np.ndarray]
  num_classes: int = 0  # Classification.
  label_names: tuple[str, ...] = ()
  challenge: dict[str, np.ndarray] | None = None
  challenge_hans: bool = False  # 3-way predictions scored on 2-way HANS labels.
  challenge_heuristics: list[str] | None = None
  eval_references: list[str] = dataclasses.field(default_factory=list)  # Translation.
  glove_matched: int | None = None  # Pieces initialised from model.glove_path.


def _tokenizer(
    config: ml_collections.ConfigDict, workdir: str, texts: Callable[[], list[str]]
) -> tokenizer_lib.Tokenizer:
  # Process 0 trains and saves it; the others load it.
  return main_process_first(
      "tokenizer",
      lambda: tokenizer_lib.load_or_train(
          workdir,
          texts,
          config.data.vocab_size,
          model_type=config.data.tokenizer_type,
          seed=config.seed,
      ),
  )


# --- Sentence pairs -------------------------------------------------------------------------------


def _subset(pairs: nli.PairData, indices: np.ndarray) -> nli.PairData:
  pick = lambda xs: None if xs is None else [xs[i] for i in indices]
  return dataclasses.replace(
      pairs,
      premises=pick(pairs.premises),
      hypotheses=pick(pairs.hypotheses),
      labels=pairs.labels[indices],
      heuristics=pick(pairs.heuristics),
      subcases=pick(pairs.subcases),
  )


def _truncate(pairs: nli.PairData, limit: int) -> nli.PairData:
  return _subset(pairs, np.arange(min(limit, len(pairs)))) if limit > 0 else pairs


def load_pairs(
    config: ml_collections.ConfigDict,
) -> tuple[nli.PairData, nli.PairData, nli.PairData | None]:
  """The (train, eval, challenge or None) sentence pairs a classification config reads."""
  d = config.data
  if d.generator:
    spec = config_lib.generator_spec(config)
    train, evaluation, challenge = config_lib.GENERATORS[d.generator][2](spec)
    cue = f", challenge_cue={spec.challenge_cue}" if d.generator == "ood_pairs" else ""
    print(
        f"{d.generator}: {len(train)} train, {len(evaluation)} eval, {len(challenge)} challenge "
        f"pairs (cue_agreement={spec.cue_agreement}{cue}, seed={spec.seed})",
        flush=True,
    )
    return train, evaluation, challenge
  if config_lib.uses_tfds(config):
    load = lambda split, limit: nli.load_tfds_pairs(
        d.tfds_name, split=split, data_dir=d.tfds_data_dir, max_examples=limit
    )
    train = load(d.tfds_train_split, d.max_train_examples)
    evaluation = load(d.tfds_eval_split, d.max_eval_examples)
  else:
    train = nli.read_pairs(d.train_file, task=d.pair_task)
    if d.eval_file:
      evaluation = nli.read_pairs(d.eval_file, task=d.pair_task)
    else:
      # Carve a fixed random eval set out of the train file.
      order = np.random.default_rng(config.seed).permutation(len(train))
      num_eval = max(1, int(round(d.eval_fraction * len(train))))
      evaluation = _subset(train, np.sort(order[:num_eval]))
      train = _subset(train, np.sort(order[num_eval:]))
      print(f"eval set: {num_eval} pairs carved from {d.train_file} (data.eval_fraction)")
    train = _truncate(train, d.max_train_examples)
  evaluation = _truncate(evaluation, d.max_eval_examples)
  if evaluation.label_names != train.label_names:
    raise UserError(
        f"{evaluation.source} has labels {evaluation.label_names} but the training data "
        f"{train.source} has {train.label_names}; data.eval_file must be the same task"
    )
  challenge = None
  if d.challenge_file:
    challenge = _truncate(nli.read_pairs(d.challenge_file, task=d.pair_task), d.max_eval_examples)
    if challenge.label_names not in (train.label_names, nli.HANS_LABELS):
      raise UserError(
          f"data.challenge_file {d.challenge_file} has labels {challenge.label_names}, which "
          f"cannot score a model trained on {train.label_names}"
      )
  return train, evaluation, challenge


def _encode_pairs(
    tok: tokenizer_lib.Tokenizer, pairs: nli.PairData, max_len: int
) -> dict[str, np.ndarray]:
  ids, segments = tok.encode_pair(pairs.premises, pairs.hypotheses, max_len)
  return {"ids": ids, "segment_ids": segments, "label": pairs.labels.astype(np.int32)}


def load_classification(config: ml_collections.ConfigDict, workdir: str) -> TaskData:
  """Train/eval (and challenge) pairs as {"ids", "segment_ids", "label"} arrays."""
  train, evaluation, challenge = load_pairs(config)
  tok = _tokenizer(config, workdir, lambda: train.premises + train.hypotheses)
  max_len = config.data.max_len
  data = TaskData(
      tokenizer=tok,
      train=_encode_pairs(tok, train, max_len),
      eval=_encode_pairs(tok, evaluation, max_len),
      num_classes=train.num_classes,
      label_names=train.label_names,
  )
  if challenge is not None:
    data.challenge = _encode_pairs(tok, challenge, max_len)
    data.challenge_hans = (
        challenge.label_names == nli.HANS_LABELS and train.label_names != nli.HANS_LABELS
    )
    data.challenge_heuristics = challenge.heuristics
  return data


# --- Parallel text --------------------------------------------------------------------------------

Parallel = tuple[list[str], list[str]]  # (sources, targets)


def load_parallel(config: ml_collections.ConfigDict) -> tuple[Parallel, Parallel]:
  """The (train, eval) (sources, targets) a translation config reads, reversed if it says so."""
  d = config.data
  if config_lib.uses_tfds(config):
    load = lambda split, limit: translation.load_tfds_translation(
        d.tfds_name,
        split=split,
        data_dir=d.tfds_data_dir,
        source_lang=d.source_lang,
        target_lang=d.target_lang,
        max_examples=limit,
    )
    train = load(d.tfds_train_split, d.max_train_examples)
    evaluation = load(d.tfds_eval_split, d.max_eval_examples)
  else:
    train = translation.read_parallel(d.train_source, d.train_target, unescape=d.unescape)
    evaluation = translation.read_parallel(d.eval_source, d.eval_target, unescape=d.unescape)
    cut = lambda pair, n: (pair[0][:n], pair[1][:n]) if n > 0 else pair
    train, evaluation = cut(train, d.max_train_examples), cut(evaluation, d.max_eval_examples)
  flip = lambda pair: (pair[1], pair[0]) if d.reverse else pair
  return flip(train), flip(evaluation)


def _encode_parallel(
    tok: tokenizer_lib.Tokenizer,
    sources: list[str],
    targets: list[str],
    config: ml_collections.ConfigDict,
) -> dict[str, np.ndarray]:
  src = tok.encode(sources, config.data.max_source_len, add_bos=False, add_eos=True)
  tgt = tok.encode(targets, config.data.max_target_len + 1, add_bos=True, add_eos=True)
  return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def load_translation(config: ml_collections.ConfigDict, workdir: str) -> TaskData:
  """Train/eval sentence pairs as {"src", "tgt_in", "tgt_out"} arrays, eval references as text."""
  (train_src, train_tgt), (eval_src, eval_tgt) = load_parallel(config)
  keep = [i for i, (s, t) in enumerate(zip(train_src, train_tgt)) if s.strip() and t.strip()]
  train_src, train_tgt = [train_src[i] for i in keep], [train_tgt[i] for i in keep]
  # A joint vocabulary: the embeddings are tied.
  tok = _tokenizer(config, workdir, lambda: train_src + train_tgt)
  return TaskData(
      tokenizer=tok,
      train=_encode_parallel(tok, train_src, train_tgt, config),
      eval=_encode_parallel(tok, eval_src, eval_tgt, config),
      eval_references=list(eval_tgt),
  )
