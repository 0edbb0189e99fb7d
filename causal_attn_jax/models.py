"""The Causal Transformer models (Causal Transformers paper, Sec. 3.2, Fig. 6) and baselines, NNX.

* `PairClassifier`: a pre-norm Transformer encoder over `<bos> premise <sep> hypothesis <eos>`
  (token + segment embeddings, sinusoidal positions), pooled at the BOS token, then a linear
  head (3-way NLI or 2-way paraphrase).
* `Seq2Seq`: pre-norm encoder-decoder for NMT. Encoder self-attention and decoder (causally
  masked) self-attention use the configured kind; cross-attention is plain softmax attention
  ("vanilla"), which the paper does not constrain. Source, target and output embeddings are tied.

Every forward pass also returns, per self-attention layer, a `SelfAttentionRecord` (float32
probabilities, the mask used, valid-token flags) for `constraints.constraint_violations`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_attn_jax.data.tokenizer import NUM_SEGMENT_IDS, PAD_ID
from causal_attn_jax.layers.attention import MultiHeadAttention
from causal_attn_jax.layers.masks import SPARSE_KINDS, causal_mask, padding_mask, sparse_mask
from trainkit.remat import check_remat, checkpointed

_INIT = nnx.initializers.normal(stddev=0.02)  # Embeddings and linear layers.


@dataclasses.dataclass
class SelfAttentionRecord:
  """What the constraint needs from one self-attention layer (a pytree of arrays)."""

  probs: jax.Array  # float32 [B, H, N, N]
  mask: jax.Array  # bool, broadcastable to probs: the full mask the layer used
  valid: jax.Array  # bool [B, N]
  decoder: bool = dataclasses.field(default=False, metadata=dict(static=True))


jax.tree_util.register_dataclass(
    SelfAttentionRecord, data_fields=["probs", "mask", "valid"], meta_fields=["decoder"]
)


def sinusoidal_positions(length: int, dim: int) -> np.ndarray:
  """float32 [length, dim] sinusoidal position encodings (Vaswani et al., 2017)."""
  position = np.arange(length)[:, None]
  div = np.exp(np.arange(0, dim, 2) * (-math.log(10000.0) / dim))
  table = np.zeros((length, dim), np.float32)
  table[:, 0::2] = np.sin(position * div)
  table[:, 1::2] = np.cos(position * div)[:, : dim // 2]
  return table


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
  """Shape of a Transformer stack, shared by both models."""

  dim: int = 64
  num_layers: int = 2
  num_decoder_layers: int = 2
  num_heads: int = 4
  head_dim: int | None = None
  mlp_dim: int = 128
  dropout_rate: float = 0.1
  attention: str = "causal"
  gcn_hops: int = 1
  sinkhorn_iters: int = 0  # Encoder self-attention only (layers/attention.py: sinkhorn_softmax).
  mask_options: tuple[tuple[str, int], ...] = ()
  max_len: int = 512
  # Rematerialisation of each encoder and decoder layer in training (`trainkit.remat`).
  remat: str = "none"

  def __post_init__(self):
    check_remat(self.remat)

  @classmethod
  def from_config(cls, model_config, max_len: int) -> "TransformerSpec":
    return cls(
        dim=model_config.dim,
        num_layers=model_config.num_layers,
        num_decoder_layers=model_config.num_decoder_layers,
        num_heads=model_config.num_heads,
        head_dim=model_config.head_dim or None,
        mlp_dim=model_config.mlp_dim,
        dropout_rate=model_config.dropout_rate,
        attention=model_config.attention,
        gcn_hops=model_config.gcn_hops,
        sinkhorn_iters=model_config.sinkhorn_iters,
        mask_options=(
            ("band_width", model_config.band_width),
            ("dilation", model_config.dilation),
            ("num_random", model_config.num_random),
            ("block_size", model_config.block_size),
            ("seed", model_config.mask_seed),
        ),
        max_len=max_len,
        remat=model_config.remat,
    )


class MLP(nnx.Module):

  def __init__(self, dim: int, mlp_dim: int, dropout_rate: float, *, dtype, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, mlp_dim, kernel_init=_INIT, dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(mlp_dim, dim, kernel_init=_INIT, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, *, train: bool, rngs: nnx.Rngs | None):
    h = jax.nn.relu(self.fc1(x))
    h = self.dropout(h, deterministic=not train, rngs=rngs)
    return self.fc2(h)


def _self_attention(
    spec: TransformerSpec, dtype: Any, rngs: nnx.Rngs, sinkhorn_iters: int = 0
) -> MultiHeadAttention:
  """The configured self-attention (kind, GCN hops, the sparse baselines' mask options)."""
  return MultiHeadAttention(
      spec.dim,
      spec.num_heads,
      kind=spec.attention,
      gcn_hops=spec.gcn_hops,
      head_dim=spec.head_dim,
      sinkhorn_iters=sinkhorn_iters,
      dtype=dtype,
      rngs=rngs,
      **dict(spec.mask_options),
  )


class EncoderLayer(nnx.Module):
  """Pre-norm: x + Drop(SelfAttn(LN(x))), then x + Drop(MLP(LN(x)))."""

  def __init__(self, spec: TransformerSpec, *, dtype, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.attention = _self_attention(spec, dtype, rngs, sinkhorn_iters=spec.sinkhorn_iters)
    self.norm2 = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.mlp = MLP(spec.dim, spec.mlp_dim, spec.dropout_rate, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(spec.dropout_rate)
    self.remat = spec.remat

  def __call__(self, x, mask, *, train: bool, rngs: nnx.Rngs | None):
    # An evaluation has no backward pass to save memory for.
    forward = lambda layer, x, mask, rngs: layer.forward(x, mask, train=train, rngs=rngs)
    return checkpointed(forward, self.remat if train else "none")(self, x, mask, rngs)

  def forward(self, x, mask, *, train: bool, rngs: nnx.Rngs | None):
    """The layer without rematerialisation (what `__call__` checkpoints)."""
    h, probs = self.attention(self.norm1(x), mask=mask)
    x = x + self.dropout(h, deterministic=not train, rngs=rngs)
    h = self.mlp(self.norm2(x), train=train, rngs=rngs)
    return x + self.dropout(h, deterministic=not train, rngs=rngs), probs


class DecoderLayer(nnx.Module):
  """Pre-norm: masked self-attention (configured kind), vanilla cross-attention, MLP."""

  def __init__(self, spec: TransformerSpec, *, dtype, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.self_attention = _self_attention(spec, dtype, rngs)
    self.norm2 = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.cross_attention = MultiHeadAttention(
        spec.dim, spec.num_heads, kind="vanilla", head_dim=spec.head_dim, dtype=dtype, rngs=rngs
    )
    self.norm3 = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.mlp = MLP(spec.dim, spec.mlp_dim, spec.dropout_rate, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(spec.dropout_rate)
    self.remat = spec.remat

  def __call__(self, y, memory, self_mask, cross_mask, *, train, rngs, decode: bool = False):
    # Decoding (never in training) updates the cache, which a checkpoint must not replay.
    policy = self.remat if train and not decode else "none"
    forward = lambda layer, y, memory, self_mask, cross_mask, rngs: layer.forward(
        y, memory, self_mask, cross_mask, train=train, rngs=rngs, decode=decode
    )
    return checkpointed(forward, policy)(self, y, memory, self_mask, cross_mask, rngs)

  def forward(self, y, memory, self_mask, cross_mask, *, train, rngs, decode: bool = False):
    """The layer without rematerialisation (what `__call__` checkpoints)."""
    drop = lambda h: self.dropout(h, deterministic=not train, rngs=rngs)
    h, probs = self.self_attention(self.norm1(y), mask=self_mask, decode=decode)
    y = y + drop(h)
    h, _ = self.cross_attention(self.norm2(y), memory, mask=cross_mask)
    y = y + drop(h)
    y = y + drop(self.mlp(self.norm3(y), train=train, rngs=rngs))
    return y, probs


class Embedder(nnx.Module):
  """Token embedding scaled by sqrt(dim), plus sinusoidal positions (and optional segments)."""

  def __init__(
      self, vocab_size: int, spec: TransformerSpec, *, segments: bool, dtype, rngs: nnx.Rngs
  ):
    self.dim = spec.dim
    self.dtype = dtype
    self.tokens = nnx.Embed(vocab_size, spec.dim, embedding_init=_INIT, rngs=rngs)
    self.segments = (
        nnx.Embed(NUM_SEGMENT_IDS, spec.dim, embedding_init=_INIT, rngs=rngs) if segments else None
    )
    self.positions = nnx.Variable(jnp.asarray(sinusoidal_positions(spec.max_len, spec.dim)))
    self.dropout = nnx.Dropout(spec.dropout_rate)

  def __call__(self, ids, segment_ids=None, *, offset=0, train: bool, rngs):
    x = self.tokens(ids) * math.sqrt(self.dim)
    if self.segments is not None and segment_ids is not None:
      x = x + self.segments(segment_ids)
    n = ids.shape[1]
    x = x + jax.lax.dynamic_slice_in_dim(self.positions[...], offset, n)[None]
    return self.dropout(x.astype(self.dtype), deterministic=not train, rngs=rngs)


def _self_attention_mask(spec: TransformerSpec, valid: jax.Array, *, decoder: bool) -> jax.Array:
  """Padding (and causal, and the baseline's sparse pattern): the mask each layer really uses."""
  n = valid.shape[1]
  mask = padding_mask(valid, valid)
  if decoder:
    mask = mask & causal_mask(n)
  if spec.attention not in SPARSE_KINDS:
    return mask
  return mask & sparse_mask(spec.attention, n, **dict(spec.mask_options))


def _encode(
    embed: Embedder, layers: nnx.List, spec: TransformerSpec, ids, segment_ids, *, train, rngs
):
  """(encoder output before its final norm, valid-token flags, a record per layer)."""
  valid = ids != PAD_ID
  mask = _self_attention_mask(spec, valid, decoder=False)
  x = embed(ids, segment_ids, train=train, rngs=rngs)
  records = []
  for layer in layers:
    x, probs = layer(x, mask, train=train, rngs=rngs)
    records.append(SelfAttentionRecord(probs, mask, valid, decoder=False))
  return x, valid, records


class PairClassifier(nnx.Module):
  """Encoder over a packed sentence pair, BOS pooling, linear head.

  `__call__(ids, segment_ids, *, train, rngs) -> (logits [B, C], [SelfAttentionRecord] per layer)`.
  """

  def __init__(
      self,
      vocab_size: int,
      num_classes: int,
      spec: TransformerSpec,
      *,
      dtype: Any = jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.spec = spec
    self.embed = Embedder(vocab_size, spec, segments=True, dtype=dtype, rngs=rngs)
    self.layers = nnx.List(
        [EncoderLayer(spec, dtype=dtype, rngs=rngs) for _ in range(spec.num_layers)]
    )
    self.norm = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(spec.dim, num_classes, kernel_init=_INIT, rngs=rngs)

  def __call__(self, ids, segment_ids, *, train: bool = False, rngs: nnx.Rngs | None = None):
    x, _, records = _encode(
        self.embed, self.layers, self.spec, ids, segment_ids, train=train, rngs=rngs
    )
    pooled = self.norm(x[:, 0])  # The <bos> token.
    return self.head(pooled.astype(jnp.float32)), records


class Seq2Seq(nnx.Module):
  """Encoder-decoder with tied embeddings; `__call__` is the teacher-forced forward.

  `__call__(src, tgt_in, *, train, rngs) -> (logits [B, T, V], records)`, the encoder's records
  then the decoder's. For decoding: `encode`, `init_cache`, `decode_step`.
  """

  def __init__(
      self, vocab_size: int, spec: TransformerSpec, *, dtype: Any = jnp.float32, rngs: nnx.Rngs
  ):
    self.spec = spec
    self.embed = Embedder(vocab_size, spec, segments=False, dtype=dtype, rngs=rngs)
    self.encoder = nnx.List(
        [EncoderLayer(spec, dtype=dtype, rngs=rngs) for _ in range(spec.num_layers)]
    )
    self.encoder_norm = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)
    self.decoder = nnx.List(
        [DecoderLayer(spec, dtype=dtype, rngs=rngs) for _ in range(spec.num_decoder_layers)]
    )
    self.decoder_norm = nnx.LayerNorm(spec.dim, dtype=dtype, rngs=rngs)

  def encode(self, src, *, train: bool = False, rngs: nnx.Rngs | None = None):
    """(memory [B, S, D], src_valid [B, S], encoder records)."""
    x, valid, records = _encode(
        self.embed, self.encoder, self.spec, src, None, train=train, rngs=rngs
    )
    return self.encoder_norm(x), valid, records

  def _logits(self, y):
    y = self.decoder_norm(y).astype(jnp.float32)
    return self.embed.tokens.attend(y)  # Tied output embedding.

  def __call__(self, src, tgt_in, *, train: bool = False, rngs: nnx.Rngs | None = None):
    memory, src_valid, records = self.encode(src, train=train, rngs=rngs)
    valid = tgt_in != PAD_ID
    self_mask = _self_attention_mask(self.spec, valid, decoder=True)
    cross_mask = padding_mask(valid, src_valid)
    y = self.embed(tgt_in, train=train, rngs=rngs)
    for layer in self.decoder:
      y, probs = layer(y, memory, self_mask, cross_mask, train=train, rngs=rngs)
      records.append(SelfAttentionRecord(probs, self_mask, valid, decoder=True))
    return self._logits(y), records

  def init_cache(self, batch: int, max_len: int) -> None:
    for layer in self.decoder:
      layer.self_attention.init_cache(batch, max_len)

  def decode_step(self, tokens, position, memory, src_valid):
    """Next-token logits [N, V] for tokens [N] at `position`, with the caches of `init_cache`.

    Sets every cache index to `position` first, so the scalar indices can stay out of the cache
    that beam search reorders.
    """
    for layer in self.decoder:
      layer.self_attention.cache_index[...] = jnp.asarray(position, jnp.int32)
    y = self.embed(tokens[:, None], offset=position, train=False, rngs=None)
    cross_mask = src_valid[:, None, None, :]
    for layer in self.decoder:
      y, _ = layer(y, memory, None, cross_mask, train=False, rngs=None, decode=True)
    return self._logits(y)[:, 0]


# --- GloVe initialisation ------------------------------------------------------------------------


def glove_embedding(
    pieces: Sequence[str], glove_path: str, dim: int, *, scale: float = 0.02, seed: int = 0
) -> tuple[np.ndarray, int]:
  """An embedding table [V, dim] whose rows for pieces found in GloVe hold their vectors.

  A piece matches a GloVe word after stripping SentencePiece's "▁" and lower-casing (GloVe is
  uncased). Vectors are truncated or zero-padded to `dim` and rescaled to std `scale`. Returns
  (table, number of matched pieces).
  """
  words = {p.lstrip("▁").lower() for p in pieces} - {""}
  vectors: dict[str, np.ndarray] = {}
  with open(glove_path, encoding="utf-8", errors="replace") as f:  # `word v1 v2 ...` per line.
    for line in f:
      word, _, rest = line.rstrip("\n").partition(" ")
      if word in words and word not in vectors:
        vectors[word] = np.asarray(rest.split(), np.float32)
  rng = np.random.default_rng(seed)
  table = rng.normal(0.0, scale, (len(pieces), dim)).astype(np.float32)
  matched = 0
  if vectors:
    std = float(np.std(np.concatenate(list(vectors.values())))) or 1.0
  for i, piece in enumerate(pieces):
    vector = vectors.get(piece.lstrip("▁").lower())
    if vector is None or not piece.lstrip("▁"):
      continue
    row = np.zeros(dim, np.float32)
    row[: min(dim, len(vector))] = vector[:dim]
    table[i] = row * (scale / std)
    matched += 1
  return table, matched
