"""What a trained causal_attn_jax run needs at inference besides its config and checkpoint.

Training writes it to `<workdir>/run_info.json` (`trainkit.recipe.train`), beside the
SentencePiece model it trained there (`spm.model`, `spm.vocab`, `spm.json`), so that predict and
`causal_attn_jax.load_run` work from the workdir alone, without the data files:

```json
{"package": "causal_attn_jax", "task": "classification",
 "label_names": ["entailment", "neutral", "contradiction"], "tokenizer": "spm.model"}
```

`label_names` name the classifier's outputs, in order (empty for translation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from causal_attn_jax.data.loading import TaskData
from trainkit.errors import UserError
from trainkit.workdir import RUN_INFO_FILE, load_run_info, save_run_info

PACKAGE = "causal_attn_jax"
TOKENIZER_FILE = "spm.model"  # data/tokenizer.py: load_or_train's <workdir>/<name>.model.


@dataclasses.dataclass(frozen=True)
class RunMetadata:
  """The task, label names and tokenizer file of a trained run.

  Attributes:
    task: `classification` (sentence pairs) or `translation`.
    label_names: The classifier's labels, in the order of its outputs; () for translation.
    tokenizer: The SentencePiece model's file name in the workdir.
  """

  task: str
  label_names: tuple[str, ...] = ()
  tokenizer: str = TOKENIZER_FILE

  @classmethod
  def from_data(cls, config: ml_collections.ConfigDict, data: TaskData) -> RunMetadata:
    """The metadata of a run of `config` on `data` (its label names)."""
    return cls(task=config.task, label_names=tuple(data.label_names))

  def to_json(self) -> dict[str, Any]:
    """The content of run_info.json."""
    return {"package": PACKAGE, **dataclasses.asdict(self)}

  @classmethod
  def from_json(cls, saved: dict[str, Any], source: str) -> RunMetadata:
    """Reads `to_json`'s dict; a missing or malformed field is a UserError naming `source`."""
    if saved.get("package", PACKAGE) != PACKAGE:
      raise UserError(f"{source} is a {saved['package']} run's, not a {PACKAGE} run's")
    try:
      return cls(
          task=str(saved["task"]),
          label_names=tuple(str(name) for name in saved["label_names"]),
          tokenizer=str(saved["tokenizer"]),
      )
    except (KeyError, TypeError, ValueError) as e:
      raise UserError(
          f"{source}: not a causal_attn_jax run's metadata ({type(e).__name__}: {e})"
      ) from None

  def save(self, workdir: str) -> None:
    """Writes `<workdir>/run_info.json` (process 0 only)."""
    save_run_info(self.to_json(), workdir)


def load(workdir: str) -> RunMetadata | None:
  """The metadata in `<workdir>/run_info.json`; None for a run trained before it was written."""
  saved = load_run_info(workdir)
  if saved is None:
    return None
  return RunMetadata.from_json(saved, f"{workdir}/{RUN_INFO_FILE}")
