"""Attention layers and masks of the Causal Transformer (paper Sec. 3.2) and its baselines."""
