"""Dataset metadata shared by every dataset loader."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from trainkit.errors import UserError

SPLITS = ("train", "val", "test")
# Per split, parallel arrays: ``image`` (or ``path``), ``label``, ``attributes``.
Splits = dict[str, dict[str, np.ndarray]]


def check_sensitive(dataset: str, names: Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
  """``names`` as a tuple when they are distinct names among ``known``, else one UserError
  naming `data.sensitive`."""
  if isinstance(names, str) or set(names) - set(known) or len(set(names)) != len(names):
    raise UserError(
        f"data.sensitive={names!r} for {dataset}: expected distinct names among "
        f"{', '.join(known)}."
    )
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Static description of a multi-attribute fairness dataset.

  Attributes:
    attribute_names: The sensitive attributes, in the column order of ``attributes`` (-1 there
      means "missing").
    group_names: For each attribute, its groups' names; group ``g`` of attribute ``j`` is
      ``attributes[:, j] == g``.
    load_stats: What the loader counted reading real files (rows dropped or unmatched), so a
      run's record shows how much of the data it used.
  """

  name: str
  num_classes: int
  class_names: tuple[str, ...]
  attribute_names: tuple[str, ...]
  group_names: tuple[tuple[str, ...], ...]
  image_size: int
  load_stats: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    if len(self.class_names) != self.num_classes:
      raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes.")
    if len(self.group_names) != len(self.attribute_names):
      raise ValueError(
          f"{len(self.group_names)} group-name lists for "
          f"{len(self.attribute_names)} attributes."
      )

  @property
  def num_attributes(self) -> int:
    return len(self.attribute_names)

  @property
  def group_sizes(self) -> tuple[int, ...]:
    """Cardinality of each sensitive attribute."""
    return tuple(len(names) for names in self.group_names)
