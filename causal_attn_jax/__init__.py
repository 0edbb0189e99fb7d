"""The Causal Transformer in JAX/Flax NNX: attention as a GCN adjacency under a Markov-blanket
constraint, for sentence-pair classification and translation."""

from trainkit._version import __version__

__all__ = ["__version__"]
