"""The run's working directory: created, checked for writing, and given the run's config."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

import jax
import ml_collections

from trainkit.errors import UserError

_log = logging.getLogger(__name__)


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


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
  return flat


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `config.json`; warns about keys that differ from the one a previous run left.

  Only process 0 writes (the workdir is shared in a multi-process run).
  """
  if jax.process_index() != 0:
    return
  path = os.path.join(workdir, "config.json")
  text = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
  if os.path.exists(path):
    with open(path) as f:
      try:
        before = _flatten(json.load(f))
      except json.JSONDecodeError:
        before = {}
    after = _flatten(json.loads(text))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if before and changed:
      _log.warning(
          "config differs from the previous run in this workdir (%s): %s",
          path,
          ", ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed),
      )
  with open(path, "w") as f:
    f.write(text)
