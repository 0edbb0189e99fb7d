"""Boolean attention masks: padding, causal, and the sparse patterns of the paper's Fig. 2.

Every mask is True where a query may attend to a key, shape [B | 1, 1, Nq, Nk], so masks combine
with `&` and broadcast over heads. The sparse patterns are built once on the host with numpy:
constants under `jax.jit`, the same `seed` giving the same random pattern.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# "causal" = the paper's GCN updater (Eq. 4) with the Markov-blanket constraint; the others are
# baselines that share its code path: dense softmax attention and the sparse patterns of Fig. 2.
ATTENTION_KINDS = ("causal", "vanilla", "band", "dilated", "random", "block")
SPARSE_KINDS = ("band", "dilated", "random", "block")


def padding_mask(valid_q: jax.Array, valid_k: jax.Array) -> jax.Array:
  """[B, Nq], [B, Nk] bool -> [B, 1, Nq, Nk]: both the query and the key are real tokens.

  Padded query rows are masked too: all-zero attention, nothing in the constraint's column sums.
  """
  valid_q = jnp.asarray(valid_q, bool)
  valid_k = jnp.asarray(valid_k, bool)
  return valid_q[:, None, :, None] & valid_k[:, None, None, :]


def causal_mask(n: int) -> jax.Array:
  """[1, 1, n, n]: query i sees keys j <= i (itself included, so no row is empty)."""
  return jnp.asarray(np.tril(np.ones((n, n), bool)))[None, None]


def sparse_mask(
    kind: str,
    n: int,
    *,
    band_width: int = 2,
    dilation: int = 2,
    num_random: int = 3,
    block_size: int = 4,
    seed: int = 0,
) -> jax.Array:
  """[1, 1, n, n] pattern of a sparse-attention baseline (paper Fig. 2).

  kind:
    "band": |i - j| <= band_width (sliding window).
    "dilated": |i - j| <= band_width * dilation and (i - j) % dilation == 0, i.e. a window of
      band_width taps on each side spaced `dilation` apart (Longformer's dilated window).
    "random": `num_random` distinct keys drawn uniformly (a fixed draw from `seed`).
    "block": local blocks, i // block_size == j // block_size.

  Every pattern contains the diagonal, so no row is empty once ANDed with a causal or padding
  mask.
  """
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  if kind == "band":
    if band_width < 0:
      raise ValueError(f"band_width must be >= 0, got {band_width}")
    pattern = np.abs(i - j) <= band_width
  elif kind == "dilated":
    if dilation < 1 or band_width < 0:
      raise ValueError(f"need dilation >= 1 and band_width >= 0, got {dilation}, {band_width}")
    pattern = (np.abs(i - j) <= band_width * dilation) & ((i - j) % dilation == 0)
  elif kind == "random":
    if num_random < 0:
      raise ValueError(f"num_random must be >= 0, got {num_random}")
    rng = np.random.default_rng(seed)
    pattern = np.eye(n, dtype=bool)
    k = min(num_random, n)
    for row in range(n):
      pattern[row, rng.choice(n, size=k, replace=False)] = True
  elif kind == "block":
    if block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {block_size}")
    pattern = (i // block_size) == (j // block_size)
  else:
    raise ValueError(f"unknown sparse attention kind {kind!r}; expected one of {SPARSE_KINDS}")
  return jnp.asarray(pattern)[None, None]
