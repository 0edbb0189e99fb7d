"""Attention layers and masks of the Causal Transformer (paper Sec. 3.2) and its baselines."""

from causal_attn_jax.layers.attention import MultiHeadAttention, masked_softmax, sinkhorn_softmax
from causal_attn_jax.layers.masks import (
    ATTENTION_KINDS,
    SPARSE_KINDS,
    causal_mask,
    padding_mask,
    sparse_mask,
)

__all__ = [
    "ATTENTION_KINDS",
    "SPARSE_KINDS",
    "MultiHeadAttention",
    "causal_mask",
    "masked_softmax",
    "padding_mask",
    "sinkhorn_softmax",
    "sparse_mask",
]
