"""The run's working directory: created, checked for writing, and given the run's config."""
from __future__ import annotations

import os
import tempfile

import ml_collections

from trainkit.errors import UserError


def prepare_workdir(workdir: str | None) -> str:
  """Creates `workdir` if needed and checks it is writable; returns its absolute path."""
  if not workdir:
    raise UserError("--workdir is required")
  workdir = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test_"):
      pass
  except OSError as e:
    raise UserError(f"workdir '{workdir}' is not writable: {e.strerror or e}") from None
  return workdir


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
