"""Multi-head attention for the Causal Transformer and its baselines, in one code path.

kind="causal" is the paper's causal self-attention (Sec. 3.2, Eq. 4): the softmax attention
matrix A = softmax(X Wq (X Wk)^T / sqrt(d_k)) of each head is used as the adjacency matrix of a
GCN feature updater instead of weighting values,

    gcn_hops=1 (literal Eq. 4):    sigma(A sigma(X Wv0) Wv1)
    gcn_hops=2 (Kipf & Welling):   sigma(A sigma(A X Wv0) Wv1)

The paper motivates the GCN by "a two-step inference path" through the Markov blanket, yet Eq. 4
propagates through A only once (its "2-layer GCN" has two weight matrices but one adjacency
product); gcn_hops=2 is the usual two-layer GCN that does propagate twice. sigma is ReLU, the
activation of the Kipf & Welling GCN that the paper's "two-layer GCN" refers to.

The other kinds are the baselines: "vanilla" = softmax(Q K^T / sqrt(d_k)) V, and the sparse
kinds of Fig. 2 ("band", "dilated", "random", "block") = vanilla with their pattern ANDed into
the mask. All kinds end with the multi-head output projection W_O (docs/design.md says why).

Every call also returns the attention probabilities in float32, which the Markov-blanket
constraint (`causal_attn_jax.constraints`) needs; logits and softmax are always computed in
float32 whatever the compute dtype, because the constraint sums expm1 of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from causal_attn_jax.layers.masks import ATTENTION_KINDS, SPARSE_KINDS, sparse_mask

# Same scale as the timm/DeiT linear layers used elsewhere in the repository.
_LINEAR_INIT = nnx.initializers.normal(stddev=0.02)
# The GCN weights keep Kipf & Welling's Glorot initialisation; per-head Wv1 is [H, dv, dv].
_GCN_INIT = nnx.initializers.glorot_uniform()
_GCN_HIDDEN_INIT = nnx.initializers.glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
_MASK_OPTIONS = ("band_width", "dilation", "num_random", "block_size", "seed")


def masked_softmax(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Softmax over the last axis in float32 (float64 stays float64), masked entries exactly 0.

  A fully masked row (a padded query, or a sparse pattern that a causal mask empties) gets all
  zeros rather than a uniform row, so it leaks nothing from masked keys and adds nothing to the
  column sums of the Markov-blanket constraint.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  return jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)


def sinkhorn_softmax(logits: jax.Array, mask: jax.Array | None, iters: int) -> jax.Array:
  """Attention whose columns also sum to about 1: Sinkhorn in the log domain, rows last.

  Definition 1 of the Causal Transformers paper takes attention with unit rows and unit columns; a
  softmax gives only the rows. `iters` alternations of column and row normalisation (Sinkformer's
  construction) approach the doubly stochastic matrix with the same pattern; rows stay exactly
  normalised, so the result is still a valid adjacency for the GCN. Not for decoders: under a
  causal mask the only doubly stochastic matrix is the identity.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  # A finite stand-in for -inf: masked entries are reset to it after every normalisation, so the
  # log-sum-exp of a fully masked row or column stays finite.
  neg = jnp.asarray(-1e9, logits.dtype)
  if mask is not None:
    logits = jnp.where(mask, logits, neg)
  for _ in range(iters):
    logits = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    logits = logits - jax.nn.logsumexp(logits, axis=-2, keepdims=True)
    if mask is not None:
      logits = jnp.where(mask, logits, neg)
  return masked_softmax(logits, mask)


def _and(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
  return b if a is None else (a if b is None else a & b)


class MultiHeadAttention(nnx.Module):
  """Multi-head attention; kind "causal" is the GCN updater of Eq. 4, the rest are baselines.

  Args:
    dim: model width D of the inputs and of the output.
    gcn_hops: 1 = literal Eq. 4, 2 = Kipf two-layer GCN (propagates through A twice; needs
      self-attention). Only used by kind "causal".
    head_dim: per-head width d_k = d_v; default D // H.
    dtype: compute dtype; logits, softmax and the returned probabilities stay float32.
    sinkhorn_iters: > 0 replaces the softmax by `sinkhorn_softmax` with this many iterations
      (columns about normalised, Definition 1); 0 = softmax. Not for causal masks.
    **mask_options: `masks.sparse_mask`'s options for the sparse kinds; ignored by the others,
      so that one config can drive all of them.
  """

  def __init__(
      self,
      dim: int,
      num_heads: int,
      *,
      kind: str = "vanilla",
      gcn_hops: int = 1,
      head_dim: int | None = None,
      dtype: Any = jnp.float32,
      sinkhorn_iters: int = 0,
      rngs: nnx.Rngs,
      **mask_options: int,
  ):
    if kind not in ATTENTION_KINDS:
      raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    if gcn_hops not in (1, 2):
      raise ValueError(f"gcn_hops must be 1 or 2, got {gcn_hops}")
    unknown = set(mask_options) - set(_MASK_OPTIONS)
    if unknown:
      raise TypeError(f"unknown mask options {sorted(unknown)}; expected some of {_MASK_OPTIONS}")
    if head_dim is None:
      if dim % num_heads:
        raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
      head_dim = dim // num_heads
    self.dim = dim
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.kind = kind
    self.gcn_hops = gcn_hops
    self.dtype = dtype
    if sinkhorn_iters < 0:
      raise ValueError(f"sinkhorn_iters must be >= 0, got {sinkhorn_iters}")
    self.sinkhorn_iters = sinkhorn_iters
    self.mask_options = dict(mask_options)
    inner = num_heads * head_dim

    def linear(din: int, dout: int, **kw: Any) -> nnx.Linear:
      kw.setdefault("kernel_init", _LINEAR_INIT)
      return nnx.Linear(din, dout, dtype=dtype, rngs=rngs, **kw)

    self.query = linear(dim, inner)
    self.key = linear(dim, inner)
    if kind == "causal":
      # Eq. 4 has no biases: Wv0 [D, H * dv] and per-head Wv1 [H, dv, dv].
      self.gcn_in = linear(dim, inner, use_bias=False, kernel_init=_GCN_INIT)
      self.gcn_hidden = nnx.Param(
          _GCN_HIDDEN_INIT(rngs.params(), (num_heads, head_dim, head_dim), jnp.float32)
      )
    else:
      self.value = linear(dim, inner)
    self.out = linear(inner, dim)

  def init_cache(self, batch: int, max_len: int) -> None:
    """Creates an empty KV cache for `decode=True` (decoder self-attention only).

    Holds the keys and the per-token GCN inputs of the positions decoded so far (sigma(X Wv0)
    for gcn_hops=1, X Wv0 for gcn_hops=2; V for the baselines), plus, for gcn_hops=2, the first
    hop's outputs sigma(A X Wv0): under a causal mask a position's first-hop output depends only
    on earlier positions, so it never changes once computed and can be cached like V.
    """
    shape = (batch, max_len, self.num_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, self.dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, self.dtype))
    if self.kind == "causal" and self.gcn_hops == 2:
      self.cached_hidden = nnx.Cache(jnp.zeros(shape, self.dtype))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

  def _sparse_mask(self, n: int) -> jax.Array:
    return sparse_mask(self.kind, n, **self.mask_options)

  def _values(self, x: jax.Array) -> jax.Array:
    """Per-token value features [B, N, H, dv]: what A mixes (first hop for "causal")."""
    batch, n, _ = x.shape
    if self.kind != "causal":
      v = self.value(x)
    else:
      v = jax.nn.relu(self.gcn_in(x)) if self.gcn_hops == 1 else self.gcn_in(x)
    return v.reshape(batch, n, self.num_heads, self.head_dim)

  def __call__(
      self,
      x_q: jax.Array,
      x_kv: jax.Array | None = None,
      *,
      mask: jax.Array | None = None,
      decode: bool = False,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends from x_q [B, Nq, D] to x_kv [B, Nk, D] (default x_q: self-attention).

    Args:
      mask: bool, broadcastable to [B, H, Nq, Nk], True = may attend (padding and, in the
        decoder, causal). Sparse kinds AND their pattern into it. With decode=True it is over
        the cache, [B, 1, Nq | 1, max_len] (e.g. key padding); the causal part is added here.
      decode: autoregressive decoding with the cache from `init_cache`: x_q holds the next Nq
        positions (1 per step, or a longer prefill chunk), which attend causally to the cached
        positions and to themselves.

    Returns:
      (out [B, Nq, D] in the compute dtype, probs float32 [B, H, Nq, Nk]); with decode=True,
      Nk = max_len and the not-yet-decoded positions have probability 0.
    """
    self_attention = x_kv is None
    x_q = x_q.astype(self.dtype)
    x_kv = x_q if self_attention else x_kv.astype(self.dtype)
    batch, n_q, _ = x_q.shape
    n_k = x_kv.shape[1]
    heads, head_dim = self.num_heads, self.head_dim
    if self.kind == "causal" and self.gcn_hops == 2 and not self_attention:
      raise ValueError("gcn_hops=2 propagates through A twice and needs self-attention")

    q = self.query(x_q).reshape(batch, n_q, heads, head_dim)
    k = self.key(x_kv).reshape(batch, n_k, heads, head_dim)
    v = self._values(x_kv)

    if decode:
      if not self_attention:
        raise ValueError("decode=True is for the decoder self-attention only")
      if not hasattr(self, "cache_index"):
        raise ValueError("decode=True needs init_cache(batch, max_len) first")
      index = self.cache_index[...]
      max_len = self.cached_key.shape[1]
      k = jax.lax.dynamic_update_slice(self.cached_key[...], k, (0, index, 0, 0))
      v = jax.lax.dynamic_update_slice(self.cached_value[...], v, (0, index, 0, 0))
      self.cached_key[...] = k
      self.cached_value[...] = v
      q_pos = index + jnp.arange(n_q)
      step_mask = (jnp.arange(max_len)[None, :] <= q_pos[:, None])[None, None]
      if self.kind in SPARSE_KINDS:
        rows = jax.lax.dynamic_slice(
            self._sparse_mask(max_len), (0, 0, index, 0), (1, 1, n_q, max_len)
        )
        step_mask = step_mask & rows
      mask = _and(step_mask, mask)
    elif self.kind in SPARSE_KINDS:
      n = max(n_q, n_k)
      mask = _and(self._sparse_mask(n)[:, :, :n_q, :n_k], mask)

    # Logits and softmax in float32: the constraint sums expm1 of these probabilities.
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if self.sinkhorn_iters and not decode:
      probs = sinkhorn_softmax(logits * (head_dim**-0.5), mask, self.sinkhorn_iters)
    else:
      probs = masked_softmax(logits * (head_dim**-0.5), mask)
    adjacency = probs.astype(self.dtype)

    h = jnp.einsum("bhqk,bkhd->bqhd", adjacency, v)
    if self.kind == "causal":
      if self.gcn_hops == 2:
        # First hop sigma(A X Wv0), then propagate its outputs through A again.
        h = jax.nn.relu(h)
        if decode:
          h = jax.lax.dynamic_update_slice(self.cached_hidden[...], h, (0, index, 0, 0))
          self.cached_hidden[...] = h
        h = jnp.einsum("bhqk,bkhd->bqhd", adjacency, h)
      w1 = self.gcn_hidden[...].astype(self.dtype)
      h = jax.nn.relu(jnp.einsum("bqhd,hde->bqhe", h, w1))

    if decode:
      self.cache_index[...] = index + n_q
    # No dropout here: the models drop the output in their residual branch, never A.
    return self.out(h.reshape(batch, n_q, heads * head_dim)), probs
