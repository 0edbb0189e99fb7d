"""Training kit shared by fairmoe_jax and causal_attn_jax: mesh, optimiser, checkpoints, loop, logging."""

from trainkit._version import __version__

__all__ = ["__version__"]
