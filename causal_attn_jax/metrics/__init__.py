"""Evaluation metrics of the Causal Transformer paper: BLEU, accuracy, macro-F1."""

from causal_attn_jax.metrics.bleu import accuracy, corpus_bleu, macro_f1

__all__ = ["accuracy", "corpus_bleu", "macro_f1"]
