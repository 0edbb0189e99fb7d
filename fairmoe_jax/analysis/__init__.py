"""Analysis of finished runs: PNG plots of one run (`write_plots`).

Kept out of `fairmoe_jax/__init__.py` so training never imports matplotlib.
"""

from fairmoe_jax.analysis.plots import write_plots

__all__ = ["write_plots"]
