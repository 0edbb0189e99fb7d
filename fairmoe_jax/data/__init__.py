"""Datasets with sensitive attributes and their input pipelines.

A dataset loader returns ``(info, splits)``: a ``DatasetInfo`` and, per split,
numpy arrays ``image`` uint8 [N, S, S, 3], ``label`` int32 [N] and
``attributes`` int32 [N, m] (``-1`` = missing). ``train_iterator`` and
``eval_batches`` turn a split into model batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fairmoe_jax.data.celeba import load_celeba, load_celeba_tfds
from fairmoe_jax.data.isic import load_isic2019
from fairmoe_jax.data.pipeline import eval_batches, train_iterator
from fairmoe_jax.data.synthetic import load_synthetic, synthetic_info
from fairmoe_jax.data.synthetic_testbed import load_synthetic_testbed, testbed_info
from fairmoe_jax.data.types import DatasetInfo, Splits, check_sensitive

_LOADERS: dict[str, Callable[..., tuple[DatasetInfo, Splits]]] = {
    "synthetic": load_synthetic,
    "synthetic_testbed": load_synthetic_testbed,
    "celeba": load_celeba,
    "celeba_tfds": load_celeba_tfds,
    "isic2019": load_isic2019,
}

# The datasets generated in memory from `data.seed` (no files): their DatasetInfo from the
# image size and the number of classes.
GENERATED_INFO: dict[str, Callable[[int, int], DatasetInfo]] = {
    "synthetic": synthetic_info,
    "synthetic_testbed": testbed_info,
}

# The paper's sensitive attributes (Sec. 6.1) when `data.sensitive` is empty.
DEFAULT_SENSITIVE = {
    "celeba": ("Male", "Chubby", "Goatee"),
    "celeba_tfds": ("Male", "Chubby", "Goatee"),
    "isic2019": ("sex", "age", "site"),
}


def sensitive_names(d: Any) -> tuple[str, ...]:
  """The sensitive attributes a config's `data` section names, or its dataset's default."""
  names = tuple(s.strip() for s in d.sensitive.split(",") if s.strip())
  if d.name in GENERATED_INFO:
    return names or GENERATED_INFO[d.name](d.image_size, d.num_classes).attribute_names
  return names or DEFAULT_SENSITIVE[d.name]


def generated_info(d: Any) -> tuple[DatasetInfo, list[int]]:
  """A generated dataset's DatasetInfo with only the attributes `data.sensitive` names, and
  their columns among the generated ones."""
  info = GENERATED_INFO[d.name](d.image_size, d.num_classes)
  names = check_sensitive(d.name, sensitive_names(d), info.attribute_names)
  columns = [info.attribute_names.index(name) for name in names]
  group_names = tuple(info.group_names[c] for c in columns)
  return dataclasses.replace(info, attribute_names=names, group_names=group_names), columns


def dataset_from_config(d: Any) -> tuple[DatasetInfo, Splits]:
  """Loads the dataset described by a config's `data` section (fairmoe_jax/config.py)."""
  if d.name in GENERATED_INFO:
    info, columns = generated_info(d)
    sizes = {"train": d.train_size, "val": d.val_size, "test": d.test_size}
    cues = {"attribute_cues": True} if d.attribute_cues else {}
    _, splits = _LOADERS[d.name](
        image_size=d.image_size, num_classes=d.num_classes, seed=d.seed, sizes=sizes, **cues
    )
    for split in splits.values():
      split["attributes"] = split["attributes"][:, columns]
    return info, splits
  sensitive = sensitive_names(d)
  common = dict(
      image_size=d.image_size, sensitive=sensitive, max_examples_per_split=d.max_examples_per_split
  )
  if d.name == "celeba":
    # Only in configs that ask for identity folds (configs/celeba.py:split=identity_folds).
    folds = d.get("identity_folds")
    return load_celeba(
        root=d.root,
        target=d.target,
        attr_file=d.attr_file,
        preload=d.preload,
        num_folds=folds.num_folds if folds else 0,
        fold=folds.fold if folds else 0,
        **common,
    )
  if d.name == "celeba_tfds":
    return load_celeba_tfds(data_dir=d.tfds_data_dir, target=d.target, **common)
  return load_isic2019(
      root=d.root,
      missing=d.missing,
      split=d.split,
      split_seed=d.split_seed,
      test_fraction=d.test_fraction,
      val_fraction=d.val_fraction,
      preload=d.preload,
      **common,
  )


def get_dataset(name: str, **kwargs) -> tuple[DatasetInfo, Splits]:
  """Loads dataset ``name``; ``kwargs`` go to its loader (e.g. ``load_synthetic``)."""
  if name not in _LOADERS:
    raise ValueError(f"Unknown dataset {name!r}; known datasets: {sorted(_LOADERS)}.")
  return _LOADERS[name](**kwargs)


__all__ = [
    "DatasetInfo",
    "Splits",
    "eval_batches",
    "dataset_from_config",
    "GENERATED_INFO",
    "get_dataset",
    "load_synthetic",
    "load_synthetic_testbed",
    "train_iterator",
]
