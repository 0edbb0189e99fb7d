"""Evaluation metrics of the Causal Transformer paper: BLEU, accuracy, macro-F1, attention sparsity."""

from causal_attn_jax.metrics.bleu import accuracy, corpus_bleu, macro_f1
from causal_attn_jax.metrics.sparsity import attention_sparsity

__all__ = ["accuracy", "attention_sparsity", "corpus_bleu", "macro_f1"]
