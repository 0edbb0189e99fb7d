"""FairSMoE in JAX/Flax NNX: multi-attribute fair image classification with sparse MoE.

A trained run from Python (docs/api.md, "Using a trained run from Python"):

    run = fairmoe_jax.load_run(workdir)
    run.predict(["a.png", "b.jpg"]).class_names

`load_run` and its types are imported on first use, so `import fairmoe_jax` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainkit._version import __version__
from trainkit.lazy import lazy_attributes

if TYPE_CHECKING:
  from fairmoe_jax.inference import Predictions, TrainedRun, load_run
  from fairmoe_jax.run_info import Preprocessing, RunMetadata

# Public name -> the module that defines it (imported by __getattr__ on first use: it pulls in
# JAX and the models).
_LAZY = {
    "load_run": "fairmoe_jax.inference",
    "TrainedRun": "fairmoe_jax.inference",
    "Predictions": "fairmoe_jax.inference",
    "RunMetadata": "fairmoe_jax.run_info",
    "Preprocessing": "fairmoe_jax.run_info",
}

__all__ = ["Predictions", "Preprocessing", "RunMetadata", "TrainedRun", "__version__", "load_run"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
