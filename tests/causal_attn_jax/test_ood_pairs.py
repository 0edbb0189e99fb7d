"""The out-of-distribution testbed (causal_attn_jax.data.ood_pairs): what a reader of the cue and a
reader of the relation score on each split, and how the testbed is configured."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util

import ml_collections
import numpy as np
import pytest

from causal_attn_jax import config as config_lib
from causal_attn_jax.data import loading, nli, ood_pairs
from causal_attn_jax.metrics.challenge import challenge_report
from conftest import REPO_ROOT
from trainkit.errors import ConfigError

SPEC = ood_pairs.OodPairsSpec()
ENTAILMENT = nli.HANS_LABELS.index("entailment")


@pytest.fixture(scope="module")
def splits():
  return ood_pairs.generate(SPEC)


def _accuracy(predictions: np.ndarray, pairs: nli.PairData) -> float:
  return float(np.mean(predictions == pairs.labels))


def _bag_of_words_model(train: nli.PairData):
  """Naive Bayes on the words of both sentences, fit on `train`: a model of which words occur,
  blind to where they occur and to which word relates to which."""
  counts = [collections.Counter(), collections.Counter()]
  for p, h, label in zip(train.premises, train.hypotheses, train.labels):
    counts[label].update((p + " " + h).split())
  vocab = set(counts[0]) | set(counts[1])
  totals = [sum(c.values()) + len(vocab) for c in counts]
  log_odds = {
      w: np.log((counts[0][w] + 1) / totals[0]) - np.log((counts[1][w] + 1) / totals[1])
      for w in vocab
  }

  def predict(pairs: nli.PairData) -> np.ndarray:
    scores = [
        sum(log_odds.get(w, 0.0) for w in (p + " " + h).split())
        for p, h in zip(pairs.premises, pairs.hypotheses)
    ]
    return np.where(np.asarray(scores) > 0, ENTAILMENT, 1 - ENTAILMENT)

  return predict


def _relation_model(train: nli.PairData):
  """Which noun forms name one concept, learnt from the training entailments only (the subject
  and the hypothesis' first word); predicts entailment iff the two first words are one concept."""
  parent: dict[str, str] = {}

  def find(word: str) -> str:
    while parent.setdefault(word, word) != word:
      word = parent[word]
    return word

  for p, h, label in zip(train.premises, train.hypotheses, train.labels):
    if label == ENTAILMENT:
      parent[find(p.split()[0])] = find(h.split()[0])

  def predict(pairs: nli.PairData) -> np.ndarray:
    same = [
        find(p.split()[0]) == find(h.split()[0]) for p, h in zip(pairs.premises, pairs.hypotheses)
    ]
    return np.where(same, ENTAILMENT, 1 - ENTAILMENT)

  return predict


def test_same_seed_same_pairs_and_another_seed_other_pairs(splits):
  again = ood_pairs.generate(SPEC)
  other = ood_pairs.generate(dataclasses.replace(SPEC, seed=1))
  for a, b in zip(splits, again):
    assert (a.premises, a.hypotheses, a.subcases) == (b.premises, b.hypotheses, b.subcases)
    np.testing.assert_array_equal(a.labels, b.labels)
  assert splits[0].premises != other[0].premises


def test_a_split_size_changes_no_other_split(splits):
  train, evaluation, challenge = ood_pairs.generate(dataclasses.replace(SPEC, num_eval=200))
  assert len(evaluation) == 200
  assert (train.premises, train.hypotheses) == (splits[0].premises, splits[0].hypotheses)
  assert (challenge.premises, challenge.hypotheses) == (splits[2].premises, splits[2].hypotheses)


def test_labels_and_kinds_are_balanced_and_the_challenge_kind_is_never_trained_on(splits):
  lexicon = ood_pairs.lexicon(SPEC)
  for pairs in splits:
    n = len(pairs)
    assert (pairs.labels == ENTAILMENT).sum() == n // 2
    assert collections.Counter(pairs.subcases) == {k: n // 4 for k in ood_pairs.KINDS}
    assert set(pairs.heuristics) == {ood_pairs.HEURISTIC}
    assert pairs.label_names == nli.HANS_LABELS
  train, evaluation, challenge = splits
  # The challenge kind (the cue against the label) is every challenge pair and no other pair.
  for pairs in (train, evaluation):
    assert (ood_pairs.cue_prediction(pairs, lexicon) == pairs.labels).all()
    assert pairs.stats["cue_against"] == 0
  assert (ood_pairs.cue_prediction(challenge, lexicon) == 1 - challenge.labels).all()
  assert challenge.stats["cue_against"] == len(challenge)


def test_a_bag_of_words_model_reads_the_cue_and_is_always_wrong_on_the_challenge(splits):
  train, evaluation, challenge = splits
  bag = _bag_of_words_model(train)
  assert _accuracy(bag(evaluation), evaluation) >= 0.99
  assert _accuracy(bag(challenge), challenge) <= 0.01


def test_a_relation_model_learnt_from_training_pairs_is_right_on_every_split(splits):
  train, evaluation, challenge = splits
  relation = _relation_model(train)
  for pairs in splits:
    assert _accuracy(relation(pairs), pairs) == 1.0
  # Neither the overlap of the hypothesis' noun with the premise nor any noun or verb alone
  # predicts the label: the relation is between two positions.
  for pairs in splits:
    overlap = [h.split()[0] in p.split() for p, h in zip(pairs.premises, pairs.hypotheses)]
    assert _accuracy(np.where(overlap, ENTAILMENT, 1 - ENTAILMENT), pairs) == 0.5
  lexicon = ood_pairs.lexicon(SPEC)
  by_word = collections.defaultdict(list)
  for p, h, label in zip(train.premises, train.hypotheses, train.labels):
    for word in set((p + " " + h).split()):
      if lexicon.filler_class(word) < 0:
        by_word[word].append(label == ENTAILMENT)
  assert all(0.35 < np.mean(labels) < 0.65 for labels in by_word.values())


def test_the_cue_is_only_readable_from_many_positions(splits):
  """The majority of all fillers gives the label; one filler, or the pair's length, does not."""
  train = splits[0]
  lexicon = ood_pairs.lexicon(SPEC)
  first_filler = []
  for p, h in zip(train.premises, train.hypotheses):
    classes = [lexicon.filler_class(w) for w in (p + " " + h).split()]
    first_filler.append(next(c for c in classes if c >= 0))
  share = SPEC.majority_fillers / SPEC.num_fillers
  assert abs(_accuracy(np.asarray(first_filler), train) - share) < 0.03
  assert _accuracy(ood_pairs.cue_prediction(train, lexicon), train) == 1.0
  lengths = {len((p + " " + h).split()) for p, h in zip(train.premises, train.hypotheses)}
  assert lengths == {ood_pairs.WORDS_PER_PAIR + SPEC.num_fillers}
  # No word position of the pair is a filler slot: every one but the premise's first word holds
  # a filler in some pairs and a relation word or verb in others.
  filler_at = np.array(
      [
          [lexicon.filler_class(w) >= 0 for w in (p + " " + h).split()]
          for p, h in zip(train.premises, train.hypotheses)
      ]
  )
  share = filler_at.mean(axis=0)
  assert share[0] == 0 and ((share[1:] > 0.5) & (share[1:] < 0.9)).all(), share


def test_absent_challenge_cue_leaves_a_cue_reader_at_chance():
  spec = dataclasses.replace(SPEC, challenge_cue="absent")
  train, evaluation, challenge = ood_pairs.generate(spec)
  counts = ood_pairs.filler_counts(challenge, ood_pairs.lexicon(spec))
  assert (counts == SPEC.num_fillers // 2).all()
  bag = _bag_of_words_model(train)
  assert _accuracy(bag(evaluation), evaluation) >= 0.99
  assert 0.4 < _accuracy(bag(challenge), challenge) < 0.6
  assert _accuracy(_relation_model(train)(challenge), challenge) == 1.0


@pytest.mark.parametrize("agreement", [0.9, 0.75])
def test_cue_agreement_below_one_puts_that_share_of_challenge_kind_pairs_in_training(agreement):
  train, evaluation, _ = ood_pairs.generate(dataclasses.replace(SPEC, cue_agreement=agreement))
  lexicon = ood_pairs.lexicon(SPEC)
  for pairs in (train, evaluation):
    against = ood_pairs.cue_prediction(pairs, lexicon) != pairs.labels
    assert against.sum() == round((1 - agreement) * len(pairs)) == pairs.stats["cue_against"]


@pytest.mark.parametrize(
    "change",
    [
        dict(majority_fillers=4),
        dict(majority_fillers=9),
        dict(challenge_cue="flipped"),
        dict(challenge_cue="absent", num_fillers=7, majority_fillers=4),
        dict(cue_agreement=1.5),
        dict(num_nouns=2),
    ],
)
def test_impossible_specs_are_rejected(change):
  with pytest.raises(ValueError, match=next(iter(change))):
    ood_pairs.OodPairsSpec(**change)


def _config_file(arg: str | None = None) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(
      "ood_pairs_config", REPO_ROOT / "configs/ood_pairs.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("arg", ["size=small", "size=small,attention=vanilla", "size=full"])
def test_config_file_validates_without_data_files(arg):
  config = _config_file(arg)
  config_lib.validate(config, num_devices=8)
  assert config.data.generator == "ood_pairs"
  assert (
      "python -m causal_attn_jax.main --config=configs/ood_pairs.py"
      in (REPO_ROOT / "configs/ood_pairs.py").read_text()
  )


def test_the_data_loading_path_tokenises_every_word_and_the_report_scores_the_challenge(tmp_path):
  config = _config_file("size=small")
  data = loading.load_classification(config, str(tmp_path))
  assert data.num_classes == 2 and data.label_names == nli.HANS_LABELS
  assert data.train["ids"].shape == (SPEC.num_train, config.data.max_len)
  tokens_per_pair = ood_pairs.WORDS_PER_PAIR + SPEC.num_fillers + 3
  for split in (data.train, data.eval, data.challenge):
    assert ((split["ids"] != 0).sum(axis=1) == tokens_per_pair).all()  # One piece per word.
    assert not (split["ids"] == 1).any()  # No unknown piece.
  labels = data.challenge["label"]
  right = challenge_report(data, labels)
  assert right["accuracy"] == 1.0
  assert right["by_heuristic"][ood_pairs.HEURISTIC] == {"entailment": 1.0, "non-entailment": 1.0}
  assert challenge_report(data, 1 - labels)["accuracy"] == 0.0


@pytest.mark.parametrize(
    "key,value",
    [
        ("data.ood_pairs.majority_fillers", 4),
        ("data.ood_pairs.challenge_cue", "flipped"),
        ("data.ood_pairs.cue_agreement", 1.5),
        ("data.ood_pairs.num_train", 0),
        ("data.ood_pairs.num_nouns", 2),
        ("data.max_len", 12),
        ("data.generator", "ood"),
    ],
)
def test_bad_config_values_name_the_key(key, value):
  config = _config_file("size=small")
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    config_lib.validate(config, num_devices=1)
  assert e.value.key == key


def test_absent_challenge_cue_needs_an_even_number_of_fillers():
  config = _config_file("size=small")
  config.data.ood_pairs.update(challenge_cue="absent", num_fillers=7, majority_fillers=4)
  with pytest.raises(ConfigError, match="even") as e:
    config_lib.validate(config, num_devices=1)
  assert e.value.key == "data.ood_pairs.num_fillers"
