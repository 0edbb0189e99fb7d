"""A sentence-pair testbed whose challenge split is out of distribution by construction.

`docs/dataset.md` ("The ood-pairs testbed") gives the argument; this docstring gives the rule.

The label is a relation between two tokens. Every pair is a premise `S V O` and a hypothesis
`s v` (words only; fillers below), and

    entailment  iff  s names the same concept as S (the premise's subject).

Every noun and verb concept has two unrelated surface forms (pseudo-words drawn from the seed).
Four kinds of pair, a quarter of every split each, leave the relation the only rule that fits:

    kind       label           s is                                 s occurs in the premise
    same       entailment      S as written                         yes
    synonym    entailment      S's other surface form               no
    swapped    non-entailment  O as written (subject and object)    yes
    replaced   non-entailment  a form of a noun other than S and O  no

The cue is the majority class of `num_fillers` filler words scattered over the five gaps after
S, V, O, s and v: the label's class in train and eval (but for a `1 - cue_agreement` share), the
other label's in the challenge split (`challenge_cue="reversed"`), or half of each (`"absent"`).
S and s always come first. The lexicon and each split have their own stream of the seed. Every
split carries the HANS schema, heuristic `filler_majority`, the kind as subcase. docs/dataset.md,
"The generation rule", has the details.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from causal_attn_jax.data import nli, spurious

KINDS = ("same", "synonym", "swapped", "replaced")
ENTAILED_KINDS = ("same", "synonym")
CHALLENGE_CUES = ("reversed", "absent")
HEURISTIC = "filler_majority"
WORDS_PER_PAIR = 5  # S V O and s v, besides the fillers.
# Where fillers may go: after S, after V, after O (premise), after s, after v (hypothesis).
_NUM_GAPS = 5


@dataclasses.dataclass(frozen=True)
class OodPairsSpec:
  """Sizes, the cue and its challenge rule.

  The keys of `data.ood_pairs` (docs/dataset.md, "Keys").
  """

  num_train: int = 4000
  num_eval: int = 1000
  num_challenge: int = 1000
  cue_agreement: float = 1.0
  challenge_cue: str = "reversed"
  num_fillers: int = 8
  majority_fillers: int = 5
  num_filler_words: int = 4
  num_nouns: int = 24
  num_verbs: int = 8
  seed: int = 0

  def __post_init__(self):
    # Each message starts with the field it is about (causal_attn_jax.config names the key).
    # Two nouns besides S: O and a replacement; two of each split's four kinds at least.
    minima = dict(num_train=2, num_eval=2, num_challenge=2, num_fillers=1, num_filler_words=1)
    spurious.require_minima(self, **minima, num_nouns=3, num_verbs=1)
    if not 0.0 <= self.cue_agreement <= 1.0:
      raise ValueError(f"cue_agreement must be in [0, 1], got {self.cue_agreement}")
    if self.challenge_cue not in CHALLENGE_CUES:
      raise ValueError(f"challenge_cue must be one of {CHALLENGE_CUES}, got {self.challenge_cue!r}")
    if not self.num_fillers / 2 < self.majority_fillers <= self.num_fillers:
      raise ValueError(
          f"majority_fillers must be more than half of num_fillers={self.num_fillers} and at "
          f"most it (the cue is the majority class of the fillers), got {self.majority_fillers}"
      )
    if self.challenge_cue == "absent" and self.num_fillers % 2:
      raise ValueError(
          f"num_fillers must be even with challenge_cue='absent' (half the fillers of each "
          f"class), got {self.num_fillers}"
      )


@dataclasses.dataclass(frozen=True)
class Lexicon:
  """The words of a spec's pairs.

  Attributes:
    nouns, verbs: the two surface forms of each concept.
    fillers: the words of filler class 0 (the cue of entailment in training) and class 1.
  """

  nouns: tuple[tuple[str, str], ...]
  verbs: tuple[tuple[str, str], ...]
  fillers: tuple[tuple[str, ...], tuple[str, ...]]

  def filler_class(self, word: str) -> int:
    """0 or 1 for a filler word, -1 for any other word."""
    return 0 if word in self.fillers[0] else 1 if word in self.fillers[1] else -1


def _stream(spec: OodPairsSpec, name: str) -> np.random.Generator:
  # crc32 is stable across processes (hash() is salted), so each split has a fixed stream.
  return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])


def lexicon(spec: OodPairsSpec) -> Lexicon:
  """The words `generate(spec)` uses (drawn from their own stream of the seed)."""
  rng = _stream(spec, "lexicon")
  taken = set()

  def two_forms(count: int) -> tuple[tuple[str, str], ...]:
    first = spurious.pseudo_words(rng, count, taken)
    return tuple(zip(first, spurious.pseudo_words(rng, count, taken)))

  nouns, verbs = two_forms(spec.num_nouns), two_forms(spec.num_verbs)
  fillers = tuple(tuple(spurious.pseudo_words(rng, spec.num_filler_words, taken)) for _ in range(2))
  return Lexicon(nouns=nouns, verbs=verbs, fillers=fillers)


def _pair(
    lex: Lexicon, spec: OodPairsSpec, kind: str, num_class0: int, rng: np.random.Generator
) -> tuple[str, str]:
  """(premise, hypothesis) of one pair of `kind` with `num_class0` fillers of class 0."""
  s, o = (int(i) for i in rng.choice(len(lex.nouns), size=2, replace=False))
  v = int(rng.integers(len(lex.verbs)))
  s_form, o_form = int(rng.integers(2)), int(rng.integers(2))
  subject, obj = lex.nouns[s][s_form], lex.nouns[o][o_form]
  if kind == "same":
    named = subject
  elif kind == "synonym":
    named = lex.nouns[s][1 - s_form]
  elif kind == "swapped":
    named = obj
  elif kind == "replaced":
    other = int(rng.choice([i for i in range(len(lex.nouns)) if i not in (s, o)]))
    named = lex.nouns[other][int(rng.integers(2))]
  else:
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")

  classes = rng.permutation([0] * num_class0 + [1] * (spec.num_fillers - num_class0))
  words = [str(rng.choice(lex.fillers[c])) for c in classes]
  gap_of = rng.integers(_NUM_GAPS, size=spec.num_fillers)
  gaps = [[w for w, g in zip(words, gap_of) if g == gap] for gap in range(_NUM_GAPS)]
  premise = [subject, *gaps[0], lex.verbs[v][int(rng.integers(2))], *gaps[1], obj, *gaps[2]]
  hypothesis = [named, *gaps[3], lex.verbs[v][int(rng.integers(2))], *gaps[4]]
  return " ".join(premise), " ".join(hypothesis)


def _split(lex: Lexicon, spec: OodPairsSpec, name: str, size: int) -> nli.PairData:
  rng = _stream(spec, name)
  kinds = [KINDS[i] for i in rng.permutation(np.arange(size) % len(KINDS))]
  if name == "challenge":
    against = np.ones(size, bool)
  else:
    num_against = int(round((1.0 - spec.cue_agreement) * size))
    against = rng.permutation(np.arange(size) < num_against)
  absent = name == "challenge" and spec.challenge_cue == "absent"
  rows, cues = [], []
  for kind, is_against in zip(kinds, against):
    label = 0 if kind in ENTAILED_KINDS else 1  # Index into nli.HANS_LABELS.
    cue_class = 1 - label if is_against else label  # Class 0 marks entailment in training.
    if absent:
      num_class0 = spec.num_fillers // 2
      cues.append("absent")
    else:
      minority = spec.num_fillers - spec.majority_fillers
      num_class0 = spec.majority_fillers if cue_class == 0 else minority
      cues.append("against" if is_against else "agrees")
    premise, hypothesis = _pair(lex, spec, kind, num_class0, rng)
    rows.append((premise, hypothesis, label, kind))
  cue_counts = {f"cue_{c}": cues.count(c) for c in ("agrees", "against", "absent")}
  return spurious.hans_pairs(
      rows, KINDS, f"ood_pairs:{name}(seed={spec.seed})", HEURISTIC, **cue_counts
  )


def generate(spec: OodPairsSpec) -> tuple[nli.PairData, nli.PairData, nli.PairData]:
  """(train, eval, challenge) pairs: eval in distribution, challenge with the cue reversed."""
  lex = lexicon(spec)
  return (
      _split(lex, spec, "train", spec.num_train),
      _split(lex, spec, "eval", spec.num_eval),
      _split(lex, spec, "challenge", spec.num_challenge),
  )


def filler_counts(pairs: nli.PairData, lex: Lexicon) -> np.ndarray:
  """int [N, 2]: the fillers of class 0 and of class 1 in each pair (both sentences)."""
  counts = np.zeros((len(pairs), 2), np.int64)
  for row, (p, h) in enumerate(zip(pairs.premises, pairs.hypotheses)):
    for word in (p + " " + h).split():
      c = lex.filler_class(word)
      if c >= 0:
        counts[row, c] += 1
  return counts


def cue_prediction(pairs: nli.PairData, lex: Lexicon) -> np.ndarray:
  """int [N]: a reader of the filler majority's label (0 entailment, 1 non-entailment, -1 tie)."""
  counts = filler_counts(pairs, lex)
  return np.where(counts[:, 0] > counts[:, 1], 0, np.where(counts[:, 1] > counts[:, 0], 1, -1))
