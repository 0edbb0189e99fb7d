"""The version of the `fairmoe-jax` distribution; setup.py and the three packages read it."""

__version__ = "0.1.0"
