"""Beam search (causal_attn_jax.decoding) on hand-made next-token models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from causal_attn_jax.decoding import beam_search, length_penalty

PAD, BOS, EOS = 0, 2, 3
A, B = 4, 5
VOCAB = 6


def _model(tables: np.ndarray):
  """A model whose next-token distribution depends on the first generated token (kept in the
  cache, so beams must carry their own cache rows) and on the last token.

  tables: [VOCAB (first token), VOCAB (last token), VOCAB] log-probs; row BOS of the first
  index is used at position 0.
  """
  tables = jnp.asarray(tables, jnp.float32)

  def step(cache, tokens, i):
    first = jnp.where(i == 1, tokens, cache["first"])
    first_for_lookup = jnp.where(i == 0, BOS, first)
    return tables[first_for_lookup, tokens], {"first": first}

  return step


def _log(p):
  return np.log(np.maximum(p, 1e-9))


def _planted_tables():
  tables = np.full((VOCAB, VOCAB, VOCAB), 1e-9)
  tables[BOS, BOS, [A, B]] = [0.6, 0.4]  # Greedy takes A first ...
  tables[A, :, [EOS, A, B]] = np.array([0.3, 0.35, 0.35])[:, None]  # ... A rarely ends well,
  tables[B, :, [EOS, A, B]] = np.array([0.9, 0.05, 0.05])[:, None]  # B then EOS is best: 0.36.
  return _log(tables)


def _cache(n):
  return {"first": jnp.full((n,), -1, jnp.int32)}


@functools.partial(jax.jit, static_argnames=("beam", "max_len", "alpha"))
def _beam(tables, beam, max_len, alpha):
  return beam_search(
      _model(tables),
      _cache(2 * beam),
      batch_size=2,
      beam_size=beam,
      max_len=max_len,
      bos_id=BOS,
      eos_id=EOS,
      alpha=alpha,
  )


def _greedy(tables, max_len):
  """Argmax decoding of `_model(tables)` in numpy, padded after EOS: the oracle of beam 1."""
  tokens, score = np.full((2, max_len), PAD), np.zeros(2)
  first = last = BOS
  for i in range(max_len):
    token = int(np.argmax(tables[first, last]))
    tokens[:, i], score = token, score + tables[first, last, token]
    first, last = (token if i == 0 else first), token
    if token == EOS:
      break
  return tokens, score


def test_beam_search_finds_the_planted_best_sequence_that_greedy_misses():
  tables = _planted_tables()
  greedy_tokens, _ = _greedy(tables, 4)
  assert greedy_tokens[0].tolist() == [A, A, A, A]  # Never reaches the best sequence.
  tokens, score = _beam(tables, 2, 4, 0.0)
  assert tokens[0].tolist() == [B, EOS, PAD, PAD]
  np.testing.assert_allclose(score[0], np.log(0.4 * 0.9), rtol=1e-5)
  tokens_lp, score_lp = _beam(tables, 2, 4, 0.6)
  assert tokens_lp[0].tolist() == [B, EOS, PAD, PAD]
  np.testing.assert_allclose(score_lp[0], np.log(0.36) / length_penalty(2.0, 0.6), rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_of_one_equals_greedy(seed):
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.full(VOCAB, 0.5), size=(VOCAB, VOCAB))
  tables = _log(probs)
  greedy_tokens, greedy_score = _greedy(tables, 6)
  beam_tokens, beam_score = _beam(tables, 1, 6, 0.0)
  np.testing.assert_array_equal(beam_tokens, greedy_tokens)
  finished = np.asarray((greedy_tokens == EOS).any(axis=1))
  np.testing.assert_allclose(
      np.asarray(beam_score)[finished], np.asarray(greedy_score)[finished], rtol=1e-5
  )


def test_beam_of_one_pads_after_eos():
  tables = np.full((VOCAB, VOCAB, VOCAB), 1e-9)
  tables[BOS, BOS, A] = 1.0
  tables[A, :, EOS] = 1.0
  tokens, score = _beam(_log(tables), 1, 4, 0.0)
  assert tokens[0].tolist() == [A, EOS, PAD, PAD]
  np.testing.assert_allclose(score, 0.0, atol=1e-6)
