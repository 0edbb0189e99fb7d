"""The Causal Transformer in JAX/Flax NNX: attention as a GCN adjacency under a Markov-blanket
constraint, for sentence-pair classification and translation.

A trained run from Python (docs/api.md, "Using a trained run from Python"):

    run = causal_attn_jax.load_run(workdir)
    run.predict_pairs([("A man is sleeping.", "Nobody sleeps.")]).labels  # or run.translate([...])

`load_run` and its types are imported on first use, so `import causal_attn_jax` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainkit._version import __version__
from trainkit.lazy import lazy_attributes

if TYPE_CHECKING:
  from causal_attn_jax.inference import PairPredictions, TrainedRun, load_run
  from causal_attn_jax.run_info import RunMetadata

# Public name -> the module that defines it (imported by __getattr__ on first use: it pulls in
# JAX and the models).
_LAZY = {
    "load_run": "causal_attn_jax.inference",
    "TrainedRun": "causal_attn_jax.inference",
    "PairPredictions": "causal_attn_jax.inference",
    "RunMetadata": "causal_attn_jax.run_info",
}

__all__ = ["PairPredictions", "RunMetadata", "TrainedRun", "__version__", "load_run"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
