"""What a trained fairmoe_jax run needs at inference besides its config and checkpoint.

Training writes `<workdir>/run_info.json` (`trainkit.recipe.train`), so that predict, export
and `fairmoe_jax.load_run` need no dataset: the class, attribute and group names and the
evaluation pipeline's preprocessing (`Preprocessing`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import ml_collections

from fairmoe_jax.data.types import DatasetInfo
from trainkit.errors import UserError
from trainkit.run_info import RunMetadataFile

PACKAGE = "fairmoe_jax"
# augment.normalize: p / 127.5 - 1 = (p / 255 - 0.5) / 0.5 for every channel.
NORMALIZE_MEAN = (0.5, 0.5, 0.5)
NORMALIZE_STD = (0.5, 0.5, 0.5)
RESIZE = "short side to image_size (bicubic), centred square crop"


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How an image becomes the model's input (the evaluation pipeline's steps): `resize` to the
  square `image_size`, then pixels scaled to [0, 1] less `mean`, divided by `std`, per channel."""

  image_size: int
  resize: str = RESIZE
  mean: tuple[float, ...] = NORMALIZE_MEAN
  std: tuple[float, ...] = NORMALIZE_STD


@dataclasses.dataclass(frozen=True)
class RunMetadata(RunMetadataFile):
  """The dataset's names (classes in the order of the model's outputs, attributes in the order of
  FairSMoE's attribute branches) and the preprocessing a trained run was trained with."""

  PACKAGE: ClassVar[str] = PACKAGE

  dataset: str
  class_names: tuple[str, ...]
  attribute_names: tuple[str, ...]
  group_names: tuple[tuple[str, ...], ...]
  preprocessing: Preprocessing

  @classmethod
  def from_dataset(cls, info: DatasetInfo, config: ml_collections.ConfigDict) -> RunMetadata:
    """The metadata of a run of `config` on the dataset `info` describes."""
    return cls(
        dataset=info.name,
        class_names=tuple(info.class_names),
        attribute_names=tuple(info.attribute_names),
        group_names=tuple(tuple(g) for g in info.group_names),
        preprocessing=Preprocessing(image_size=int(config.data.image_size)),
    )

  def dataset_info(self) -> DatasetInfo:
    """A DatasetInfo with the run's names: what building the model needs of the dataset."""
    return DatasetInfo(
        name=self.dataset,
        num_classes=len(self.class_names),
        class_names=self.class_names,
        attribute_names=self.attribute_names,
        group_names=self.group_names,
        image_size=self.preprocessing.image_size,
    )

  @classmethod
  def from_fields(cls, saved: dict[str, Any]) -> RunMetadata:
    """The metadata of `to_json`'s dict (`RunMetadataFile.from_json` names the file on error)."""
    preprocessing = dict(saved["preprocessing"])
    return cls(
        dataset=str(saved["dataset"]),
        class_names=tuple(saved["class_names"]),
        attribute_names=tuple(saved["attribute_names"]),
        group_names=tuple(tuple(g) for g in saved["group_names"]),
        preprocessing=Preprocessing(
            image_size=int(preprocessing["image_size"]),
            resize=str(preprocessing["resize"]),
            mean=tuple(preprocessing["mean"]),
            std=tuple(preprocessing["std"]),
        ),
    )

  def check(self, source: str) -> None:
    """Raises UserError when the run's preprocessing is not what this version's pipeline does."""
    ours = Preprocessing(image_size=self.preprocessing.image_size)
    if self.preprocessing != ours:
      raise UserError(
          f"{source}: the run's preprocessing {self.preprocessing} is not this version's "
          f"({ours})"
      )
