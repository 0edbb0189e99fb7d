"""Data for the Causal Transformer: sentence pairs (NLI, paraphrase), parallel text, tokenizer,
fixed-shape batches."""

__all__: list[str] = []  # Modules only: each caller imports the one it uses.
