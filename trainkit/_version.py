"""The version of the `fairmoe-jax` distribution (fairmoe_jax, causal_attn_jax and trainkit).

The one place the version is written: setup.py reads it from this file and the three packages
re-export it as `__version__`.
"""

__version__ = "0.1.0"
