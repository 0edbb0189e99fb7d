"""`<workdir>/run_info.json`, `{"package": PACKAGE, <fields>}`: a frozen dataclass that a
package's metadata subclasses (`fairmoe_jax.run_info`) with its fields, `PACKAGE` and
`from_fields`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from trainkit import storage
from trainkit.errors import UserError
from trainkit.workdir import CONFIG_FILE, RUN_INFO_FILE, read_json_object

_Metadata = TypeVar("_Metadata", bound="RunMetadataFile")


class RunMetadataFile:
  """A run's metadata (a frozen dataclass subclass) as run_info.json reads and writes it."""

  PACKAGE: ClassVar[str]

  @classmethod
  def from_fields(cls: type[_Metadata], saved: dict[str, Any]) -> _Metadata:
    """The metadata of `to_json`'s dict; a missing or malformed field raises KeyError,
    TypeError or ValueError (`from_json` names the file)."""
    raise NotImplementedError

  def check(self, source: str) -> None:
    """Raises UserError naming `source` when this version cannot use the metadata read."""
    del source

  def to_json(self) -> dict[str, Any]:
    return {"package": self.PACKAGE, **dataclasses.asdict(self)}

  @classmethod
  def from_json(cls: type[_Metadata], saved: dict[str, Any], source: str) -> _Metadata:
    """Reads `to_json`'s dict; a missing or malformed field is a UserError naming `source`."""
    if saved.get("package", cls.PACKAGE) != cls.PACKAGE:
      raise UserError(f"{source} is a {saved['package']} run's, not a {cls.PACKAGE} run's")
    try:
      metadata = cls.from_fields(saved)
    except (KeyError, TypeError, ValueError) as e:
      raise UserError(
          f"{source}: not a {cls.PACKAGE} run's metadata ({type(e).__name__}: {e})"
      ) from None
    metadata.check(source)
    return metadata

  @classmethod
  def load(cls: type[_Metadata], workdir: str) -> _Metadata:
    """The metadata in `<workdir>/run_info.json`; a UserError names the file when it is
    missing, unreadable or not this package's."""
    path = storage.join(workdir, RUN_INFO_FILE)
    missing = (
        f"training writes it beside {CONFIG_FILE} with what inference reads (class or label "
        "names); restore it from a copy of the workdir, or train again"
    )
    return cls.from_json(read_json_object(path, missing), path)
