"""Data for the Causal Transformer: sentence pairs (NLI, paraphrase), parallel text, tokenizer,
fixed-shape batches."""
