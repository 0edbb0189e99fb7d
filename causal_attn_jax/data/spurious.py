"""A built-in spurious-correlation testbed for sentence-pair models (docs/dataset.md).

The Causal Transformers paper claims that causal attention generalises better when a surface cue
that predicts the label in training stops predicting it (HANS after MNLI, PAWS after QQP); this
generator makes that situation from a seed, with the cue's strength as a config key.

Every pair is a premise "the [adj] S V the [adj] O [while the S' V' ...]" and a hypothesis
"the s v the o" over pseudo-words, and entailment iff s, v, o name the concepts of S, V, O (every
noun and verb concept has two unrelated surface forms). The cue is lexical overlap; the four kinds
of pair (`KINDS`: two agree with the cue, two disagree) are docs/dataset.md's table ("The
spurious-pairs testbed", "What a pair is"). Train and eval pairs agree with the cue with
probability `cue_agreement`; the challenge split holds only the disagreeing kinds (HANS schema:
heuristic "lexical_overlap").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from causal_attn_jax.data import nli

KINDS = ("same", "replaced", "synonym", "role_swap")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class SpuriousPairsSpec:
  """Sizes and the cue strength of the generated task.

  Attributes:
    num_train, num_eval, num_challenge: pairs per split.
    cue_agreement: probability that a train or eval pair's overlap agrees with its label.
    num_nouns, num_verbs, num_adjectives: concepts (each noun and verb has two surface forms).
    modifier_prob: probability that a premise noun gets an adjective.
    distractor_prob: probability that the premise ends with a clause about other words.
    seed: the generator's seed (the same seed always gives the same pairs).
  """

  num_train: int = 4000
  num_eval: int = 1000
  num_challenge: int = 1000
  cue_agreement: float = 0.9
  num_nouns: int = 24
  num_verbs: int = 8
  num_adjectives: int = 12
  modifier_prob: float = 0.0
  distractor_prob: float = 0.5
  seed: int = 0

  def __post_init__(self):
    # Each message starts with the field it is about (causal_attn_jax.config names the key).
    # Replacements and distractors need four nouns and two verbs.
    require_minima(
        self, num_train=1, num_eval=1, num_challenge=1, num_nouns=4, num_verbs=2, num_adjectives=1
    )
    for name in ("cue_agreement", "modifier_prob", "distractor_prob"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def require_minima(spec: Any, **minima: int) -> None:
  """ValueError naming the first field of `spec` below its minimum."""
  for name, least in minima.items():
    if getattr(spec, name) < least:
      raise ValueError(f"{name} must be >= {least}, got {getattr(spec, name)}")


def pseudo_words(rng: np.random.Generator, count: int, taken: set[str]) -> list[str]:
  """`count` new two- or three-syllable pseudo-words: no shared morphology between synonyms."""
  words = []
  while len(words) < count:
    syllables = rng.integers(2, 4)
    word = "".join(
        rng.choice(list(_CONSONANTS)) + rng.choice(list(_VOWELS)) for _ in range(syllables)
    )
    if word not in taken:
      taken.add(word)
      words.append(word)
  return words


@dataclasses.dataclass
class _Lexicon:
  """Two surface forms for every noun and verb concept (module docstring)."""

  nouns: list[tuple[str, str]]
  verbs: list[tuple[str, str]]
  adjectives: list[str]

  @classmethod
  def generate(cls, spec: SpuriousPairsSpec, rng: np.random.Generator) -> "_Lexicon":
    taken = {"the", "while"}
    forms = lambda n: list(zip(pseudo_words(rng, n, taken), pseudo_words(rng, n, taken)))
    return cls(
        nouns=forms(spec.num_nouns),
        verbs=forms(spec.num_verbs),
        adjectives=pseudo_words(rng, spec.num_adjectives, taken),
    )


def _other(rng: np.random.Generator, size: int, exclude: set[int]) -> int:
  choices = [i for i in range(size) if i not in exclude]
  return int(rng.choice(choices))


def _pair(lex: _Lexicon, spec: SpuriousPairsSpec, kind: str, rng: np.random.Generator):
  """(premise, hypothesis, label) of one pair of the given kind."""
  num_nouns, num_verbs = len(lex.nouns), len(lex.verbs)
  s, o = (int(i) for i in rng.choice(num_nouns, size=2, replace=False))
  v = int(rng.integers(num_verbs))
  form = lambda forms: forms[int(rng.integers(2))]
  # The premise's surface form of each role, and the concept table it came from.
  concepts = [(lex.nouns, s), (lex.verbs, v), (lex.nouns, o)]
  chosen = [int(rng.integers(2)) for _ in concepts]
  words = [table[i][f] for (table, i), f in zip(concepts, chosen)]

  def noun_phrase(word: str) -> str:
    if rng.random() < spec.modifier_prob:
      return f"the {rng.choice(lex.adjectives)} {word}"
    return f"the {word}"

  premise = f"{noun_phrase(words[0])} {words[1]} {noun_phrase(words[2])}"
  used_nouns, used_verbs = {s, o}, {v}
  if rng.random() < spec.distractor_prob:
    s2 = _other(rng, num_nouns, used_nouns)
    v2 = _other(rng, num_verbs, used_verbs)
    used_nouns.add(s2)
    used_verbs.add(v2)
    premise += f" while the {form(lex.nouns[s2])} {form(lex.verbs[v2])}"

  hyp = list(words)
  role = int(rng.integers(3))  # which of S, V, O a replacement or synonym changes
  if kind == "same":
    label = "entailment"
  elif kind == "role_swap":
    hyp[0], hyp[2] = hyp[2], hyp[0]
    label = "non-entailment"
  elif kind == "synonym":
    table, i = concepts[role]
    hyp[role] = table[i][1 - chosen[role]]
    label = "entailment"
  elif kind == "replaced":
    # An unrelated concept absent from the premise: partial overlap, like a synonym's.
    if role == 1:
      hyp[1] = form(lex.verbs[_other(rng, num_verbs, used_verbs)])
    else:
      hyp[role] = form(lex.nouns[_other(rng, num_nouns, used_nouns)])
    label = "non-entailment"
  else:
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
  return premise, f"the {hyp[0]} {hyp[1]} the {hyp[2]}", label


def _split(
    lex: _Lexicon, spec: SpuriousPairsSpec, size: int, agreement: float, name: str, rng
) -> nli.PairData:
  entailed = rng.permutation(np.arange(size) % 2 == 0)
  agrees = rng.random(size) < agreement
  rows = []
  for is_entailed, agree in zip(entailed, agrees):
    kind = KINDS[2 * (not agree) + (not is_entailed)]  # The cue agreeing, entailed first.
    premise, hypothesis, label = _pair(lex, spec, kind, rng)
    rows.append((premise, hypothesis, nli.HANS_LABELS.index(label), kind))
  return hans_pairs(rows, KINDS, f"spurious_pairs:{name}(seed={spec.seed})", "lexical_overlap")


def hans_pairs(
    rows: list[tuple[str, str, int, str]],
    kinds: tuple[str, ...],
    source: str,
    heuristic: str,
    **counts: int,
) -> nli.PairData:
  """Generated (premise, hypothesis, label, kind) rows in the HANS schema, the kind as subcase;
  its stats count the labels, the `kinds` and the generator's own `counts`."""
  premises, hypotheses, labels, subcases = (list(column) for column in zip(*rows))
  labels = np.asarray(labels, np.int32)
  stats = {"rows": len(rows), "examples": len(rows)}
  stats.update({f"label_{n}": int((labels == i).sum()) for i, n in enumerate(nli.HANS_LABELS)})
  stats.update({f"kind_{k}": subcases.count(k) for k in kinds}, **counts)
  heuristics = [heuristic] * len(rows)
  return nli.PairData(
      premises, hypotheses, labels, nli.HANS_LABELS, source, heuristics, subcases, stats
  )


def generate(spec: SpuriousPairsSpec) -> tuple[nli.PairData, nli.PairData, nli.PairData]:
  """(train, eval, challenge) pairs; eval is in-distribution, challenge reverses the cue."""
  rng = np.random.default_rng(spec.seed)
  lex = _Lexicon.generate(spec, rng)
  train = _split(lex, spec, spec.num_train, spec.cue_agreement, "train", rng)
  evaluation = _split(lex, spec, spec.num_eval, spec.cue_agreement, "eval", rng)
  challenge = _split(lex, spec, spec.num_challenge, 0.0, "challenge", rng)
  return train, evaluation, challenge


def overlap_cue(pairs: nli.PairData) -> np.ndarray:
  """bool [N]: every hypothesis word occurs in the premise (the cue a shortcut model learns)."""
  return np.array(
      [set(h.split()) <= set(p.split()) for p, h in zip(pairs.premises, pairs.hypotheses)]
  )
