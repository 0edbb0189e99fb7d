"""Datasets with sensitive attributes and their input pipelines.

A dataset loader returns ``(info, splits)``: a ``DatasetInfo`` and, per split,
numpy arrays ``image`` uint8 [N, S, S, 3], ``label`` int32 [N] and
``attributes`` int32 [N, m] (``-1`` = missing). ``train_iterator`` and
``eval_batches`` turn a split into model batches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fairmoe_jax.data.augment import AugmentConfig
from fairmoe_jax.data.pipeline import eval_batches, num_eval_batches, train_iterator
from fairmoe_jax.data.synthetic import load_synthetic
from fairmoe_jax.data.types import DatasetInfo

Splits = dict[str, dict[str, np.ndarray]]

_LOADERS: dict[str, Callable[..., tuple[DatasetInfo, Splits]]] = {
    "synthetic": load_synthetic,
}


def get_dataset(name: str, **kwargs) -> tuple[DatasetInfo, Splits]:
  """Loads dataset ``name``; ``kwargs`` go to its loader (e.g. ``load_synthetic``)."""
  if name not in _LOADERS:
    raise ValueError(f"Unknown dataset {name!r}; known datasets: {sorted(_LOADERS)}.")
  return _LOADERS[name](**kwargs)


__all__ = [
    "AugmentConfig",
    "DatasetInfo",
    "Splits",
    "eval_batches",
    "get_dataset",
    "load_synthetic",
    "num_eval_batches",
    "train_iterator",
]
