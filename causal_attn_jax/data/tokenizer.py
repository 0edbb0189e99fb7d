"""SentencePiece tokenizer trained in the run's workdir, with fixed special ids (``PAD_ID`` 0
... ``EOS_ID`` 3, then ``[SEP]``) that models, masks and the loss hard-code.

``load_or_train`` trains ``<workdir>/<name>.model`` once and reuses it on resume (retraining
would change the ids under the checkpointed embeddings); multi-host runs call it on one process
first.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from trainkit import storage
from trainkit.errors import UserError, import_extra
from trainkit.storage import write_atomically

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
SEP_PIECE = "[SEP]"
# pad, unk, bos, eos and [SEP]: the pieces every vocabulary starts with.
NUM_RESERVED_PIECES = 5
MODEL_TYPES = ("unigram", "bpe")
# encode_pair's segment ids: 0 = padding, 1 = <bos> premise <sep>, 2 = hypothesis <eos>.
NUM_SEGMENT_IDS = 3
# <bos>, <sep> and <eos> of a packed pair.
_PAIR_SPECIALS = 3

Texts = Iterable[str] | Callable[[], Iterable[str]]


def _spm() -> Any:
  return import_extra("sentencepiece", "causal", "the tokenizer")


def train_sentencepiece(
    texts: Texts,
    model_prefix: str | os.PathLike,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 0.9995,
    seed: int = 0,
) -> None:
  """Trains a SentencePiece model; writes ``<model_prefix>.model`` (and ``.vocab``).

  Args:
    texts: Training sentences (or a callable returning them); empty ones are skipped. Give
      source and target text together for a shared NMT vocabulary.
    vocab_size: Pieces in the vocabulary, specials and ``[SEP]`` included.
    character_coverage: Fraction of characters covered by single pieces; the rarest rest map
      to ``<unk>``. At most 2M sentences are sampled for training.

  Raises:
    UserError: Bad settings, no text, or SentencePiece refused the corpus.
  """
  if model_type not in MODEL_TYPES:
    raise UserError(
        f"tokenizer model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}."
    )
  if vocab_size <= NUM_RESERVED_PIECES:
    raise UserError(
        f"tokenizer vocab_size {vocab_size} must exceed the {NUM_RESERVED_PIECES} reserved pieces."
    )
  spm = _spm()
  prefix = os.fspath(model_prefix)
  # Trained in memory, checked, then written atomically: never a truncated model.
  output: dict[str, Any] = {"model_writer": io.BytesIO()}
  count = 0  # Sentences read: tells "no text" from other failures.

  def sentences() -> Iterator[str]:
    nonlocal count
    for text in texts() if callable(texts) else texts:
      if text and text.strip():
        count += 1
        yield text

  spm.set_random_generator_seed(seed)
  try:
    with open(os.devnull, "w") as devnull:
      spm.SentencePieceTrainer.train(
          sentence_iterator=sentences(),
          **output,
          vocab_size=vocab_size,
          model_type=model_type,
          character_coverage=character_coverage,
          input_sentence_size=2_000_000,
          shuffle_input_sentence=True,
          byte_fallback=False,
          num_threads=4,
          pad_id=PAD_ID,
          unk_id=UNK_ID,
          bos_id=BOS_ID,
          eos_id=EOS_ID,
          pad_piece="<pad>",
          unk_piece="<unk>",
          bos_piece="<s>",
          eos_piece="</s>",
          user_defined_symbols=[SEP_PIECE],
          logstream=devnull,
      )
  except RuntimeError as e:
    if not count:
      raise UserError(f"tokenizer {prefix}.model: no non-empty training text was given.") from e
    raise UserError(
        f"tokenizer {prefix}.model: SentencePiece training on {count} sentences "
        f"failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
    ) from e
  proto = output["model_writer"].getvalue()
  vocab = _vocab_text(proto)  # Parses the model: a proto that does not load is never written.
  parent = posixpath.dirname(prefix) if storage.is_remote(prefix) else os.path.dirname(prefix)
  if parent:
    storage.makedirs(parent)
  write_atomically(f"{prefix}.vocab", vocab)
  write_atomically(f"{prefix}.model", proto)  # Last: the model means the tokenizer is complete.


def _vocab_text(model_proto: bytes) -> str:
  """The `.vocab` file SentencePiece writes beside a model (piece, tab, score per line)."""
  processor = _spm().SentencePieceProcessor(model_proto=model_proto)
  return "".join(
      f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
      for i in range(processor.get_piece_size())
  )


def load_or_train(
    workdir: str | os.PathLike,
    texts: Texts,
    vocab_size: int,
    *,
    model_type: str = "unigram",
    name: str = "spm",
    character_coverage: float = 0.9995,
    seed: int = 0,
) -> Tokenizer:
  """Returns the tokenizer ``<workdir>/<name>.model``, training it only if absent.

  A reused model leaves ``texts`` unread (pass a generator or callable); one whose vocabulary
  size or recorded setting differs from the requested one is a UserError naming both values.
  """
  workdir = os.fspath(workdir)
  model_path = storage.join(workdir, f"{name}.model")
  settings_path = storage.join(workdir, f"{name}.json")
  settings = {
      "vocab_size": vocab_size,
      "model_type": model_type,
      "character_coverage": character_coverage,
      "byte_fallback": False,  # Always; recorded, so a model trained with bytes is refused.
  }
  if storage.path(model_path).is_file():
    tokenizer = Tokenizer(model_path)
    if tokenizer.vocab_size != vocab_size:
      raise UserError(
          f"tokenizer {model_path} has vocab_size {tokenizer.vocab_size} but {vocab_size} was "
          "requested; use the same vocab_size to resume, or a new workdir (or delete the "
          "model) to train another."
      )
    if storage.path(settings_path).is_file():
      try:
        saved = json.loads(storage.read_text(settings_path))
      except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"tokenizer settings {settings_path} cannot be read: {e}") from e
      for key, value in settings.items():
        if key in saved and saved[key] != value:
          raise UserError(
              f"tokenizer {model_path} was trained with {key}={saved[key]!r} "
              f"(recorded in {settings_path}) but {key}={value!r} was requested."
          )
    return tokenizer
  train_sentencepiece(
      texts,
      storage.join(workdir, name),
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      seed=seed,
  )
  write_atomically(settings_path, json.dumps(settings, indent=2) + "\n")
  return Tokenizer(model_path)


def pair_lengths(premise_len: int, hypothesis_len: int, budget: int) -> tuple[int, int]:
  """Lengths kept when truncating a pair to ``budget`` tokens, longer sentence first.

  As removing one token at a time from the end of the longer sentence (the hypothesis on ties),
  BERT's "longest_first": a short hypothesis is not cut because the premise is long.
  """
  if premise_len + hypothesis_len <= budget:
    return premise_len, hypothesis_len
  shorter = min(premise_len, hypothesis_len)
  if 2 * shorter <= budget:
    if premise_len > hypothesis_len:
      return budget - hypothesis_len, hypothesis_len
    return premise_len, budget - premise_len
  return (budget + 1) // 2, budget // 2


class Tokenizer:
  """A SentencePiece model with fixed special ids and fixed-length int32 encoding."""

  def __init__(self, model_path: str | os.PathLike):
    """Loads ``model_path``; its special ids must be the fixed ones (module doc)."""
    self.path = storage.path(model_path)
    if not self.path.is_file():
      raise UserError(f"tokenizer model {self.path} does not exist.")
    self._sp = _spm().SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self.path.read_bytes())
    except (OSError, RuntimeError) as e:
      raise UserError(f"tokenizer model {self.path} cannot be loaded: {e}") from e
    found = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
    if found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
      raise UserError(
          f"tokenizer model {self.path} has pad/unk/bos/eos ids {found}; expected "
          f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (train it with train_sentencepiece)."
      )
    self.sep_id = self._sp.piece_to_id(SEP_PIECE)
    if self.sep_id == UNK_ID:
      raise UserError(f"tokenizer model {self.path} has no {SEP_PIECE} piece.")
    self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def pieces(self) -> list[str]:
    """Every piece, by id: what GloVe rows are matched to and heatmap axes are labelled with."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def tokenize(self, texts: str | Sequence[str]) -> list[list[int]]:
    """Piece ids of each text, without specials, padding or truncation."""
    batch = [texts] if isinstance(texts, str) else list(texts)
    return self._sp.encode(batch, out_type=int)

  def encode(
      self, texts: str | Sequence[str], max_len: int, add_bos: bool = False, add_eos: bool = True
  ) -> np.ndarray:
    """Encodes to int32 [N, max_len] ([max_len] for one str), padded with ``PAD_ID``.

    Text longer than the room left by the specials is truncated at the end;
    ``<eos>`` is kept after truncation, so a decoder still learns to stop.
    """
    specials = int(add_bos) + int(add_eos)
    if max_len <= specials:
      raise UserError(f"tokenizer max_len {max_len} leaves no room for text ({specials} specials).")
    pieces = self.tokenize(texts)
    out = np.full((len(pieces), max_len), PAD_ID, np.int32)
    for i, ids in enumerate(pieces):
      row = (
          ([BOS_ID] if add_bos else []) + ids[: max_len - specials] + ([EOS_ID] if add_eos else [])
      )
      out[i, : len(row)] = row
    return out[0] if isinstance(texts, str) else out

  def encode_pair(
      self, premise: str | Sequence[str], hypothesis: str | Sequence[str], max_len: int
  ) -> tuple[np.ndarray, np.ndarray]:
    """Packs ``<bos> premise <sep> hypothesis <eos>`` into ``max_len`` tokens (``pair_lengths``).

    Returns ``(ids, segment_ids)``, int32 [max_len] for one pair or [N, max_len]; segment ids
    as in the module constants, so ``segment_ids > 0`` is also the padding mask.
    """
    single = isinstance(premise, str)
    if single != isinstance(hypothesis, str):
      raise ValueError("encode_pair: premise and hypothesis must both be str or both sequences.")
    premises = self.tokenize(premise)
    hypotheses = self.tokenize(hypothesis)
    if len(premises) != len(hypotheses):
      raise ValueError(f"encode_pair: {len(premises)} premises but {len(hypotheses)} hypotheses.")
    if max_len <= _PAIR_SPECIALS:
      raise UserError(f"tokenizer max_len {max_len} leaves no room for a pair (3 specials).")
    budget = max_len - _PAIR_SPECIALS
    ids = np.full((len(premises), max_len), PAD_ID, np.int32)
    segments = np.zeros((len(premises), max_len), np.int32)
    for i, (p, h) in enumerate(zip(premises, hypotheses)):
      lp, lh = pair_lengths(len(p), len(h), budget)
      first = [BOS_ID] + p[:lp] + [self.sep_id]
      second = h[:lh] + [EOS_ID]
      ids[i, : len(first)] = first
      ids[i, len(first) : len(first) + len(second)] = second
      segments[i, : len(first)] = 1
      segments[i, len(first) : len(first) + len(second)] = 2
    return (ids[0], segments[0]) if single else (ids, segments)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of one id sequence: stops at the first ``<eos>``, skips pad and bos; ids beyond the
    vocabulary (a padded output layer) decode as ``<unk>``."""
    kept: list[int] = []
    for token in np.asarray(ids).reshape(-1).tolist():
      if token == EOS_ID:
        break
      if token in (PAD_ID, BOS_ID):
        continue
      kept.append(token if 0 <= token < self.vocab_size else UNK_ID)
    return self._sp.decode(kept)

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    """``decode`` of each row of an [N, L] array."""
    return [self.decode(row) for row in np.asarray(ids)]
