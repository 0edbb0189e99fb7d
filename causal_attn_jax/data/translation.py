"""Parallel text for NMT from plain text, WMT ``.sgm`` or tfds ``wmt*_translate``.

``read_parallel`` reads:

* plain text (any extension but ``.sgm``): line i of the source translates line i of the
  target. Unequal line counts are an error (dropping or padding would misalign every later
  pair). Lines are split on ``\\n`` only: U+2028, U+0085 or a form feed occur inside real WMT
  sentences. ``unescape=True`` undoes the XML escaping of Moses-tokenised corpora (e.g. the
  OpenNMT WMT14 En-De files);
* WMT SGML (both ``.sgm``): segments paired by (doc id, seg id), not by position, and XML
  entities unescaped; a bare ``&`` (newstest's "B&Q") is kept, as the official files are not
  valid XML.
"""

from __future__ import annotations

import bisect
import os
import pathlib
import re

from causal_attn_jax.data.nli import as_text
from trainkit import tfds_data
from trainkit.errors import UserError
from trainkit.textfiles import read_text, report_counts

SGM_SUFFIX = ".sgm"
_TFDS_NAME = re.compile(r"^wmt\d\d_translate/([a-z]{2})-([a-z]{2})$")
_ENTITY = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|amp|lt|gt|quot|apos);")
_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}
# One match per <doc ...>, </doc> or <seg ...>text</seg>, in file order.
_SGM_TOKEN = re.compile(
    r"(?P<doc><doc\b(?P<doc_attrs>[^>]*)>)|(?P<end></doc\s*>)"
    r"|<seg\b(?P<seg_attrs>[^>]*)>(?P<text>.*?)</seg\s*>",
    re.IGNORECASE | re.DOTALL,
)
_ATTR = r"\b{}\s*=\s*(?:\"([^\"]*)\"|'([^']*)'|([^\s>]+))"


def unescape_entities(text: str) -> str:
  """Replaces the XML entities (named and numeric) in ``text``; a bare ``&`` stays.

  Only the five XML names: ``html.unescape`` also rewrites ``&copy`` in "&copyright".
  """

  def replace(match: re.Match[str]) -> str:
    name = match.group(1)
    if name[0] != "#":
      return _NAMED[name]
    try:
      return chr(int(name[2:], 16) if name[1] in "xX" else int(name[1:]))
    except (ValueError, OverflowError):
      return match.group(0)

  return _ENTITY.sub(replace, text)


def read_lines(path: str | os.PathLike, *, unescape: bool = False) -> list[str]:
  """One stripped sentence per line (split on ``\\n`` only; ``\\r\\n`` accepted)."""
  path = pathlib.Path(path)
  text = read_text(path, "text")
  lines = text.split("\n")
  if lines and lines[-1] == "":
    lines.pop()  # The newline ending the last line.
  lines = [line.strip() for line in lines]
  return [unescape_entities(line) for line in lines] if unescape else lines


def _attribute(attrs: str, name: str) -> str | None:
  match = re.search(_ATTR.format(name), attrs, re.IGNORECASE)
  return next(group for group in match.groups() if group is not None) if match else None


def read_sgm(path: str | os.PathLike) -> dict[tuple[str, str], str]:
  """Reads a WMT ``.sgm`` file into {(doc id, seg id): unescaped text} in file order; a
  malformed or repeated segment is a UserError naming file and line."""
  path = pathlib.Path(path)
  text = read_text(path, "sgm")
  newlines = [i for i, c in enumerate(text) if c == "\n"]

  def line_of(offset: int) -> int:
    return bisect.bisect_left(newlines, offset) + 1

  segments: dict[tuple[str, str], str] = {}
  where_of: dict[tuple[str, str], int] = {}
  doc: str | None = None
  doc_line = 0
  for match in _SGM_TOKEN.finditer(text):
    line = line_of(match.start())
    if match.group("doc"):
      if doc is not None:
        raise UserError(f"{path}:{line}: <doc> opened before the <doc> of line {doc_line} closed.")
      doc = _attribute(match.group("doc_attrs"), "docid")
      if doc is None:
        raise UserError(f"{path}:{line}: <doc> has no docid attribute.")
      doc_line = line
    elif match.group("end"):
      if doc is None:
        raise UserError(f"{path}:{line}: </doc> without an open <doc>.")
      doc = None
    else:
      if doc is None:
        raise UserError(f"{path}:{line}: <seg> outside a <doc>.")
      seg = _attribute(match.group("seg_attrs"), "id")
      if seg is None:
        raise UserError(f"{path}:{line}: <seg> has no id attribute.")
      key = (doc, seg)
      if key in segments:
        raise UserError(
            f"{path}:{line}: doc {doc} seg {seg} already appears on line {where_of[key]}."
        )
      segments[key] = unescape_entities(match.group("text").strip())
      where_of[key] = line
  if doc is not None:
    raise UserError(f"{path}:{doc_line}: <doc docid={doc!r}> is never closed.")
  return segments


def _read_sgm_pair(source: pathlib.Path, target: pathlib.Path) -> tuple[list[str], list[str]]:
  src = read_sgm(source)
  tgt = read_sgm(target)
  only_src = [key for key in src if key not in tgt]
  only_tgt = [key for key in tgt if key not in src]
  if only_src or only_tgt:
    example = (
        f"doc {only_src[0][0]} seg {only_src[0][1]} is only in {source}"
        if only_src
        else f"doc {only_tgt[0][0]} seg {only_tgt[0][1]} is only in {target}"
    )
    raise UserError(
        f"{source} ({len(src)} segments) and {target} ({len(tgt)} segments) do not hold the "
        f"same (doc id, seg id): {len(only_src)} only in the source, {len(only_tgt)} only in "
        f"the target; e.g. {example}."
    )
  keys = list(src)
  return [src[key] for key in keys], [tgt[key] for key in keys]


def read_parallel(
    source_path: str | os.PathLike,
    target_path: str | os.PathLike,
    *,
    unescape: bool = False,
    report: bool = True,
) -> tuple[list[str], list[str]]:
  """``(sources, targets)``, aligned, from two files of one format (module doc).

  ``report`` prints and logs the pair and empty-line counts; a missing file, mixed formats or
  misaligned files are a UserError naming both files.
  """
  source, target = pathlib.Path(source_path), pathlib.Path(target_path)
  is_sgm = (source.suffix.lower() == SGM_SUFFIX, target.suffix.lower() == SGM_SUFFIX)
  if is_sgm[0] != is_sgm[1]:
    raise UserError(
        f"{source} and {target}: one is .sgm and the other is not; give both in the same format."
    )
  if all(is_sgm):
    sources, targets = _read_sgm_pair(source, target)
  else:
    sources = read_lines(source, unescape=unescape)
    targets = read_lines(target, unescape=unescape)
    if len(sources) != len(targets):
      raise UserError(
          f"parallel files have different line counts: {source} has {len(sources)} lines, "
          f"{target} has {len(targets)}."
      )
  if report:
    empty = sum(not s or not t for s, t in zip(sources, targets))
    report_counts(
        f"parallel {source} | {target}", dict(pairs=len(sources), pairs_with_empty_side=empty)
    )
  return sources, targets


def load_tfds_translation(
    name: str,
    *,
    split: str,
    data_dir: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    max_examples: int = 0,
) -> tuple[list[str], list[str]]:
  """Reads ``wmt14_translate/de-en``, ``wmt16_translate/ro-en`` (any ``wmtNN_translate/xx-yy``).

  Already prepared in ``data_dir`` (never downloaded). The direction (``source_lang``,
  ``target_lang``) is explicit because tfds names the config ``de-en`` whatever the direction.
  """
  match = _TFDS_NAME.match(name)
  if not match:
    raise UserError(
        f"tfds translation dataset {name!r} is not supported; expected "
        "wmtNN_translate/xx-yy, e.g. wmt14_translate/de-en or wmt16_translate/ro-en."
    )
  languages = set(match.groups())
  if {source_lang, target_lang} != languages or source_lang == target_lang:
    raise UserError(
        f"tfds {name}: source_lang={source_lang!r} and target_lang={target_lang!r} must be "
        f"the two languages {' and '.join(sorted(languages))}."
    )
  builder = tfds_data.tfds_builder(name, data_dir, "causal", split)
  sources: list[str] = []
  targets: list[str] = []
  for example in tfds_data.tfds_map(builder, split, max_examples):
    sources.append(as_text(example[source_lang]))
    targets.append(as_text(example[target_lang]))
  return sources, targets
