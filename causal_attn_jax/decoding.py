"""Autoregressive decoding with a cache: beam search, jit-compatible.

It drives `log_probs [N, V], cache = step_fn(cache, tokens [N], position)`, `cache` any pytree
with leading dimension N = batch * beam rows, reordered on re-ranking.

Beam search follows fairseq's rule: the 2K best extensions of the K alive beams are ranked; one
ending in EOS among the first K is finished (scored by log-prob / length_penalty), the K best
others stay alive, and a sentence is done with K finished hypotheses (K = 1 is greedy). The
length penalty is GNMT's ((5 + length) / 6) ** alpha, length counting the EOS.

`decode_tokens` is the one place that ties the searches to `models.Seq2Seq`.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections

from causal_attn_jax import models
from causal_attn_jax.data import tokenizer as tokenizer_lib

StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
_NEG_INF = -1e9


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  return ((5.0 + length) / 6.0) ** alpha


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

  Returns (tokens [B, max_len] of the best hypothesis after BOS, padded after its EOS; score [B],
  its log-prob / length penalty).
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
    # The cache's B * K rows reordered to follow the alive beams' parents.
    rows = (jnp.arange(b)[:, None] * k + jnp.take_along_axis(parent, pick, axis=1)).reshape(-1)
    cache = jax.tree.map(lambda x: x[rows], cache)
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


# --- Seq2Seq --------------------------------------------------------------------------------------

# translate(params, model_state, src [B, S]) -> tokens [B, nmt.max_decode_len]
TranslateFn = Callable[[Any, Any, jax.Array], jax.Array]


def decode_tokens(
    model: models.Seq2Seq, src: jax.Array, *, beam_size: int, max_len: int, alpha: float = 0.6
) -> jax.Array:
  """Translations [B, max_len] of src [B, S] (traceable; call it under jit).

  Encodes once, tiles the encoder output per beam and decodes with the KV caches; the scalar
  cache indices stay out of the cache that beam search reorders, rebuilt from the position.
  """
  batch = src.shape[0]
  beam = beam_size
  index_filter = nnx.All(nnx.Cache, nnx.PathContains("cache_index"))
  memory, src_valid, _ = model.encode(src)
  model.init_cache(batch * beam, max_len)
  memory, src_valid = jnp.repeat(memory, beam, 0), jnp.repeat(src_valid, beam, 0)
  cache_graph, indices, kv, rest = nnx.split(model, index_filter, nnx.Cache, ...)

  def step_fn(cache, tokens, position):
    kv, memory, src_valid = cache
    # Fresh index Variables of this trace (the ones split above belong to the outer trace).
    position_state = jax.tree.map(lambda _: jnp.asarray(position, jnp.int32), indices)
    m = nnx.merge(cache_graph, position_state, kv, rest)
    logits = m.decode_step(tokens, position, memory, src_valid)
    _, _, kv, _ = nnx.split(m, index_filter, nnx.Cache, ...)
    return jax.nn.log_softmax(logits.astype(jnp.float32)), (kv, memory, src_valid)

  tokens, _ = beam_search(
      step_fn,
      (kv, memory, src_valid),
      batch_size=batch,
      beam_size=beam,
      max_len=max_len,
      bos_id=tokenizer_lib.BOS_ID,
      eos_id=tokenizer_lib.EOS_ID,
      alpha=alpha,
  )
  return tokens


def make_translate_fn(graphdef: nnx.GraphDef, config: ml_collections.ConfigDict) -> TranslateFn:
  """Jitted `translate(params, model_state, src [B, S]) -> tokens [B, nmt.max_decode_len]`."""

  @jax.jit
  def translate(params, model_state, src):
    model = nnx.merge(graphdef, params, model_state)
    return decode_tokens(
        model,
        src,
        beam_size=config.nmt.beam_size,
        max_len=config.nmt.max_decode_len,
        alpha=config.nmt.alpha,
    )

  return translate
