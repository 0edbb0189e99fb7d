"""Data for the Causal Transformer: sentence pairs (NLI, paraphrase), parallel text, tokenizer,
fixed-shape batches."""

from causal_attn_jax.data.batching import (
    bucketed_batches,
    eval_batches,
    num_eval_batches,
    pad_to_length,
    padding_mask,
    train_batches,
)
from causal_attn_jax.data.nli import (
    HANS_LABELS,
    NLI_LABELS,
    PARAPHRASE_LABELS,
    PairData,
    load_tfds_pairs,
    nli_to_hans,
    read_pairs,
)
from causal_attn_jax.data.tokenizer import Tokenizer, load_or_train, train_sentencepiece
from causal_attn_jax.data.translation import load_tfds_translation, read_parallel, read_sgm

__all__ = [
    "HANS_LABELS",
    "NLI_LABELS",
    "PARAPHRASE_LABELS",
    "PairData",
    "Tokenizer",
    "bucketed_batches",
    "eval_batches",
    "load_or_train",
    "load_tfds_pairs",
    "load_tfds_translation",
    "nli_to_hans",
    "num_eval_batches",
    "pad_to_length",
    "padding_mask",
    "read_pairs",
    "read_parallel",
    "read_sgm",
    "train_batches",
    "train_sentencepiece",
]
