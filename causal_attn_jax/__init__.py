"""Causal Transformer in JAX/Flax NNX (issue 5 fills this package in)."""
