"""What a trained causal_attn_jax run needs at inference besides its config and checkpoint
(`<workdir>/run_info.json`, beside the SentencePiece model), so that it needs no data file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from trainkit.run_info import RunMetadataFile

PACKAGE = "causal_attn_jax"
TOKENIZER_FILE = "spm.model"  # data/tokenizer.py: load_or_train's <workdir>/<name>.model.


@dataclasses.dataclass(frozen=True)
class RunMetadata(RunMetadataFile):
  """The task, label names and tokenizer file of a trained run.

  Attributes:
    task: `classification` (sentence pairs) or `translation`.
    label_names: The classifier's labels, in the order of its outputs; () for translation.
    tokenizer: The SentencePiece model's file name in the workdir.
  """

  PACKAGE: ClassVar[str] = PACKAGE

  task: str
  label_names: tuple[str, ...] = ()
  tokenizer: str = TOKENIZER_FILE

  @classmethod
  def from_fields(cls, saved: dict[str, Any]) -> RunMetadata:
    """The metadata of `to_json`'s dict (`RunMetadataFile.from_json` names the file on error)."""
    return cls(
        task=str(saved["task"]),
        label_names=tuple(str(name) for name in saved["label_names"]),
        tokenizer=str(saved["tokenizer"]),
    )
