"""Attention layers and masks of the Causal Transformer (paper Sec. 3.2) and its baselines."""

__all__: list[str] = []  # Modules only: each caller imports the one it uses.
