"""Generated tables in a markdown document, between `<!-- table:NAME -->` and
`<!-- /table:NAME -->` lines; a document is refused unless every marker has its partner, no
table is marked twice and nothing nests (else `--write` could replace up to a later marker)."""

from __future__ import annotations

import collections
import re
from typing import Callable

from trainkit.errors import UserError

_MARKER_LINE = re.compile(r"^<!-- (?P<end>/?)table:(?P<name>[A-Za-z0-9_]+) -->$", re.M)


# One table's place in a document: its body is `text[body_start:body_end]`.
MarkedTable = collections.namedtuple("MarkedTable", "name body_start body_end")


def marked_tables(text: str, path: str) -> list[MarkedTable]:
  """The document's marked tables in order; one error naming the line of a bad marker."""
  tables: list[MarkedTable] = []
  first_line: dict[str, int] = {}
  open_table: tuple[str, int, int] | None = None  # name, line, body start
  for match in _MARKER_LINE.finditer(text):
    name, line = match["name"], text.count("\n", 0, match.start()) + 1
    if not match["end"]:
      if open_table is not None:
        raise UserError(
            f"{path}:{line}: table {name} starts inside table {open_table[0]}, whose start "
            f"marker (line {open_table[1]}) has no '<!-- /table:{open_table[0]} -->' before it"
        )
      if name in first_line:
        raise UserError(
            f"{path}:{line}: table {name} is marked a second time (first at line "
            f"{first_line[name]}); each table has one place"
        )
      first_line[name] = line
      open_table = (name, line, match.end() + 1)
    elif open_table is None or open_table[0] != name:
      raise UserError(
          f"{path}:{line}: '<!-- /table:{name} -->' ends a table that was not started "
          f"(no '<!-- table:{name} -->' line before it)"
      )
    else:
      tables.append(MarkedTable(name, open_table[2], match.start()))
      open_table = None
  if open_table is not None:
    raise UserError(
        f"{path}:{open_table[1]}: table {open_table[0]} has no end marker "
        f"'<!-- /table:{open_table[0]} -->' after it"
    )
  return tables


def replace_tables(text: str, path: str, render: Callable[[str], str]) -> str:
  """`text` with each marked table's body replaced by `render(name)`."""
  pieces, position = [], 0
  for table in marked_tables(text, path):
    pieces += [text[position : table.body_start], render(table.name)]
    position = table.body_end
  return "".join(pieces) + text[position:]


def read_doc(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read the document ({e})") from None
