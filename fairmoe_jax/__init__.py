"""FairSMoE in JAX/Flax NNX: multi-attribute fair image classification with sparse MoE."""

from trainkit._version import __version__

__all__ = ["__version__"]
