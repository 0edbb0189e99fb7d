"""The built-in spurious-correlation testbed (causal_attn_jax.data.spurious) and models that learn it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from causal_attn_jax import config as config_lib
from causal_attn_jax import models, train
from causal_attn_jax.data import nli, spurious
from trainkit.mesh import make_mesh
from trainkit.train_state import create_train_state, make_train_step

SMALL = spurious.SpuriousPairsSpec(num_train=2000, num_eval=500, num_challenge=500)


def _label_is_entailment(pairs: nli.PairData) -> np.ndarray:
  return pairs.labels == nli.HANS_LABELS.index("entailment")


def test_same_seed_same_pairs_and_another_seed_other_pairs():
  a, b = spurious.generate(SMALL), spurious.generate(SMALL)
  c = spurious.generate(dataclasses.replace(SMALL, seed=1))
  for x, y in zip(a, b):
    assert x.premises == y.premises and x.hypotheses == y.hypotheses
    np.testing.assert_array_equal(x.labels, y.labels)
  assert a[0].premises != c[0].premises


@pytest.mark.parametrize("agreement", [0.9, 0.6])
def test_cue_agrees_with_the_label_as_configured_and_never_in_the_challenge(agreement):
  train_pairs, eval_pairs, challenge = spurious.generate(
      dataclasses.replace(SMALL, cue_agreement=agreement)
  )
  for pairs in (train_pairs, eval_pairs):
    agrees = spurious.overlap_cue(pairs) == _label_is_entailment(pairs)
    assert abs(agrees.mean() - agreement) < 0.06, (agrees.mean(), len(agrees))
    assert abs(_label_is_entailment(pairs).mean() - 0.5) < 0.01  # balanced labels
  # A model of the cue is always wrong on the challenge split.
  assert not (spurious.overlap_cue(challenge) == _label_is_entailment(challenge)).any()
  assert set(challenge.subcases) == {"synonym", "role_swap"}
  assert set(challenge.heuristics) == {"lexical_overlap"}
  assert challenge.label_names == nli.HANS_LABELS


def test_the_label_is_the_relation_not_the_words():
  """Role swaps keep every word and flip the label; no single word marks a synonym pair."""
  train_pairs, _, challenge = spurious.generate(SMALL)
  for p, h, kind in zip(challenge.premises, challenge.hypotheses, challenge.subcases):
    content = [w for w in h.split() if w != "the"]
    if kind == "role_swap":
      assert set(content) <= set(p.split())
      # The premise's subject is the hypothesis' object.
      assert p.split().index(content[2]) < p.split().index(content[0])
    else:
      assert sum(w not in p.split() for w in content) == 1
  # Both surface forms of every concept occur in training premises.
  premise_words = {w for p in train_pairs.premises for w in p.split()}
  hypothesis_words = {w for h in train_pairs.hypotheses for w in h.split()}
  assert hypothesis_words <= premise_words


def _word_ids(pairs: nli.PairData, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """<bos> premise <sep> hypothesis <eos> as word ids (no SentencePiece: the test is the model)."""
  vocab = {
      w: i + 5
      for i, w in enumerate(
          sorted({w for t in pairs.premises + pairs.hypotheses for w in t.split()})
      )
  }
  ids = np.zeros((len(pairs), max_len), np.int32)
  segments = np.zeros_like(ids)
  for row, (p, h) in enumerate(zip(pairs.premises, pairs.hypotheses)):
    tokens = [2] + [vocab[w] for w in p.split()] + [4]
    first = len(tokens)
    tokens += [vocab[w] for w in h.split()] + [3]
    ids[row, : len(tokens)] = tokens
    segments[row, :first] = 1
    segments[row, first : len(tokens)] = 2
  return ids, segments


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "vanilla"])
def test_both_attentions_fit_64_training_pairs(kind):
  pairs = spurious.generate(dataclasses.replace(SMALL, num_train=64))[0]
  ids, segments = _word_ids(pairs, 24)
  batch = {
      "ids": jnp.asarray(ids),
      "segment_ids": jnp.asarray(segments),
      "label": jnp.asarray(pairs.labels),
  }
  config = config_lib.base_config()
  config.model.update(
      attention=kind, dim=32, num_layers=2, num_heads=2, mlp_dim=64, dropout_rate=0.0
  )
  config.constraints.weight = 1.0 if kind == "causal" else 0.0
  spec = models.TransformerSpec.from_config(config.model, max_len=24)
  tx = optax.adam(3e-3)
  graphdef, state = create_train_state(
      lambda: models.PairClassifier(int(ids.max()) + 1, 2, spec, rngs=nnx.Rngs(params=0)),
      tx,
      make_mesh({"data": 1, "expert": 1}),
      seed=0,
  )
  state = state.replace(extra=train.initial_extra(config))
  step = jax.jit(
      make_train_step(
          graphdef, train.make_loss_fn(config), tx, update_extra=train.make_update_extra(config)
      )
  )
  # The causal model's multipliers keep pushing on the fitted model, so one step's accuracy
  # wobbles by a pair or two (60 of 64 at step 150 on one processor, 64 on another), and on
  # some roundings it falls back for some steps after it first fits (down to 32 of 64 in steps
  # 133-154 on jax 0.12 with tests/conftest.py's compile flags, 64 of 64 from step 155 to 300).
  # The mean over the last 100 of 300 steps is what the claim "fits" rests on.
  accuracies = []
  for _ in range(300):
    state, metrics = step(state, batch)
    accuracies.append(metrics["accuracy"])
  late = float(np.mean(accuracies[-100:]))
  assert late >= 0.95, (kind, late)
