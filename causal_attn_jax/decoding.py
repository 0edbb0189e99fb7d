"""Autoregressive decoding with a cache: greedy and beam search, jit-compatible.

Both drive a step function

    log_probs, cache = step_fn(cache, tokens, position)

with `tokens` [N] the last token of each of N hypotheses and `log_probs` [N, V]
the next-token log-probabilities; `cache` is any pytree whose leaves have
leading dimension N (e.g. the decoder's key/value caches and the tiled encoder
output). Beam search keeps N = batch * beam rows and reorders the cache rows
when beams are re-ranked.

Beam search follows fairseq's rule: at every step the 2K best extensions of the
K alive beams are ranked; an extension ending in EOS that ranks among the first
K is finished (scored by log-prob / length_penalty), the K best others stay
alive, and a sentence is done once it has K finished hypotheses. With K = 1
this is exactly greedy decoding. The length penalty is GNMT's
((5 + length) / 6) ** alpha, with length counting the EOS.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
_NEG_INF = -1e9


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  return ((5.0 + length) / 6.0) ** alpha


def greedy_search(
    step_fn: StepFn,
    cache: Any,
    *,
    batch_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Argmax decoding. Returns (tokens [B, max_len] after BOS, padded after EOS; log-prob [B])."""

  def body(i, carry):
    tokens, last, score, done, cache = carry
    log_probs, cache = step_fn(cache, last, i)
    best = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
    best_logp = jnp.take_along_axis(log_probs, best[:, None], axis=-1)[:, 0]
    token = jnp.where(done, pad_id, best)
    score = score + jnp.where(done, 0.0, best_logp)
    tokens = tokens.at[:, i].set(token)
    return tokens, token, score, done | (token == eos_id), cache

  init = (
      jnp.full((batch_size, max_len), pad_id, jnp.int32),
      jnp.full((batch_size,), bos_id, jnp.int32),
      jnp.zeros((batch_size,), jnp.float32),
      jnp.zeros((batch_size,), bool),
      cache,
  )
  tokens, _, score, _, _ = jax.lax.fori_loop(0, max_len, body, init)
  return tokens, score


def _gather_beams(tree: Any, index: jax.Array, batch_size: int, beam_size: int) -> Any:
  """Rows [B * K, ...] reordered by beam index [B, K'] -> [B * K', ...]."""
  flat = (jnp.arange(batch_size)[:, None] * beam_size + index).reshape(-1)
  return jax.tree.map(lambda x: x[flat], tree)


def beam_search(
    step_fn: StepFn,
    cache: Any,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    alpha: float = 0.6,
    pad_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Beam search (module docstring). `cache` has B * K rows (each example tiled K times).

  Returns:
    tokens: [B, max_len], the best hypothesis after BOS, padded after its EOS.
    score: [B], its log-prob divided by the length penalty.
  """
  b, k = batch_size, beam_size

  def body(i, carry):
    alive_seq, alive_logp, fin_seq, fin_score, fin_count, cache = carry
    log_probs, cache = step_fn(cache, alive_seq[:, :, i].reshape(-1), i)
    vocab = log_probs.shape[-1]
    candidates = (alive_logp[:, :, None] + log_probs.reshape(b, k, vocab)).reshape(b, k * vocab)
    top_logp, top_index = jax.lax.top_k(candidates, 2 * k)  # [B, 2K], best first.
    parent = top_index // vocab
    token = (top_index % vocab).astype(jnp.int32)
    seqs = jnp.take_along_axis(alive_seq, parent[:, :, None], axis=1)
    seqs = seqs.at[:, :, i + 1].set(token)
    is_eos = token == eos_id
    done = fin_count >= k

    # Finished: EOS extensions ranked among the first K, while the sentence is not done.
    rank = jnp.arange(2 * k)[None, :]
    new_fin = is_eos & (rank < k) & ~done[:, None]
    new_score = jnp.where(new_fin, top_logp / length_penalty(i + 1.0, alpha), _NEG_INF)
    pool_score = jnp.concatenate([fin_score, new_score], axis=1)
    pool_seq = jnp.concatenate([fin_seq, seqs], axis=1)
    fin_score, keep = jax.lax.top_k(pool_score, k)
    fin_seq = jnp.take_along_axis(pool_seq, keep[:, :, None], axis=1)
    fin_count = jnp.minimum(fin_count + new_fin.sum(axis=1), k)

    # Alive: the K best extensions that do not end in EOS.
    alive_candidates = jnp.where(is_eos, _NEG_INF, top_logp)
    alive_logp, pick = jax.lax.top_k(alive_candidates, k)
    alive_seq = jnp.take_along_axis(seqs, pick[:, :, None], axis=1)
    cache = _gather_beams(cache, jnp.take_along_axis(parent, pick, axis=1), b, k)
    return alive_seq, alive_logp, fin_seq, fin_score, fin_count, cache

  alive_seq = jnp.full((b, k, max_len + 1), pad_id, jnp.int32).at[:, :, 0].set(bos_id)
  # Only the first beam is alive at the start, so the K beams do not duplicate it.
  alive_logp = jnp.tile(jnp.array([0.0] + [_NEG_INF] * (k - 1), jnp.float32), (b, 1))
  init = (
      alive_seq,
      alive_logp,
      jnp.full((b, k, max_len + 1), pad_id, jnp.int32),
      jnp.full((b, k), _NEG_INF, jnp.float32),
      jnp.zeros((b,), jnp.int32),
      cache,
  )
  alive_seq, alive_logp, fin_seq, fin_score, _, _ = jax.lax.fori_loop(0, max_len, body, init)
  # Sentences with no finished hypothesis fall back to their best alive beam (no EOS).
  alive_score = alive_logp / length_penalty(float(max_len), alpha)
  use_alive = fin_score[:, 0] <= _NEG_INF / 2
  best_seq = jnp.where(use_alive[:, None], alive_seq[:, 0], fin_seq[:, 0])
  tokens = best_seq[:, 1:]
  # Pad after the first EOS (finished hypotheses already are).
  after_eos = jnp.cumsum(tokens == eos_id, axis=1) - (tokens == eos_id) > 0
  tokens = jnp.where(after_eos, pad_id, tokens)
  return tokens, jnp.where(use_alive, alive_score[:, 0], fin_score[:, 0])
