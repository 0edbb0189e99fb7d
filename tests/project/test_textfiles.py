"""Every real-data reader reports a non-UTF-8 byte with file and line, and ignores a BOM."""

from __future__ import annotations

import pytest

from causal_attn_jax.data import nli, translation
from fairmoe_jax.data import celeba
from trainkit.errors import UserError
from trainkit.textfiles import iter_lines, read_text


def test_read_text_and_iter_lines_name_the_line(tmp_path):
  path = tmp_path / "f.txt"
  path.write_bytes(b"\xef\xbb\xbfhead\nok\nbad \xff byte\n")
  with pytest.raises(UserError, match=r"f\.txt:3: not UTF-8 text \(byte 0xff\)"):
    read_text(path, "test")
  lines = iter_lines(path, "test")
  assert next(lines) == (1, "head") and next(lines) == (2, "ok")  # BOM dropped
  with pytest.raises(UserError, match=r"f\.txt:3: not UTF-8"):
    next(lines)
  with pytest.raises(UserError, match="test file .*missing.txt does not exist"):
    read_text(tmp_path / "missing.txt", "test")


def test_every_reader_names_the_line_of_a_bad_byte(tmp_path):
  tsv = tmp_path / "pairs.tsv"
  tsv.write_bytes(b"sentence1\tsentence2\tgold_label\na\tb\tentailment\nc \xfe\td\tneutral\n")
  with pytest.raises(UserError, match=r"pairs\.tsv:3: not UTF-8"):
    nli.read_pairs(str(tsv), task="nli")
  src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
  src.write_bytes(b"one\ntwo \xc3\n")
  tgt.write_text("eins\nzwei\n")
  with pytest.raises(UserError, match=r"src\.txt:2: not UTF-8"):
    translation.read_parallel(str(src), str(tgt))
  partition = tmp_path / "list_eval_partition.txt"
  partition.write_bytes(b"000001.jpg 0\n000002.jpg\xff 1\n")
  with pytest.raises(UserError, match=r"list_eval_partition\.txt:2: not UTF-8"):
    celeba.read_partition(partition)
