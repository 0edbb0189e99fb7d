"""Sentence-pair readers on the real SNLI/MNLI/HANS samples and on malformed files; accuracy/F1."""

import pathlib
import re
import warnings

import numpy as np
import pytest

from causal_attn_jax.data import nli
from causal_attn_jax.metrics import accuracy, macro_f1
from conftest import SHARED_DATA
from trainkit.errors import UserError

NLI_DIR = SHARED_DATA / "nli"


def _real(name: str) -> pathlib.Path:
  path = NLI_DIR / name
  if not path.is_file():
    pytest.skip(f"real NLI sample {path} is absent (see ../shared/data/README.md)")
  return path


def _write(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(UserError) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert "\n" not in message, message
  return message


def test_mnli_dev_matched_counts():
  data = nli.read_pairs(_real("mnli_dev_matched.tsv"), task="nli", report=False)
  assert len(data) == 9815
  assert data.label_names == nli.NLI_LABELS
  assert data.labels.dtype == np.int32
  assert np.bincount(data.labels).tolist() == [3479, 3123, 3213]
  assert data.stats["skipped_no_consensus"] == 0
  assert data.premises[0] == "The new rights are nice enough"
  # Whitespace around a sentence is stripped (the file has a trailing space here).
  assert data.hypotheses[0] == "Everyone really likes the newest benefits"
  assert data.labels[0] == nli.NLI_LABELS.index("neutral")
  assert data.heuristics is None


@pytest.mark.parametrize(
    "name, rows, skipped, counts",
    [
        ("snli_1.0_dev.jsonl", 1289, 16, [433, 421, 419]),
        ("snli_1.0_test.jsonl", 1277, 23, [405, 429, 420]),
    ],
)
def test_snli_skips_and_counts_no_consensus(name, rows, skipped, counts):
  data = nli.read_pairs(_real(name), task="nli", report=False)
  assert data.stats["rows"] == rows
  assert data.stats["skipped_no_consensus"] == skipped
  assert len(data) == rows - skipped
  assert np.bincount(data.labels, minlength=3).tolist() == counts
  assert len(data.premises) == len(data.hypotheses) == len(data)


def test_hans_sample_keeps_heuristics():
  data = nli.read_pairs(_real("hans_format_sample.txt"), task="nli", report=False)
  assert len(data) == 4
  assert data.label_names == nli.HANS_LABELS
  assert data.labels.tolist() == [1, 1, 1, 1]  # All non-entailment.
  assert data.heuristics == ["lexical_overlap"] * 4
  assert data.subcases == ["ln_subject/object_swap"] * 4
  assert data.premises[0] == "The president advised the doctor ."
  assert data.hypotheses[0] == "The doctor advised the president ."
  assert "paraphrase" in _error(
      nli.read_pairs, NLI_DIR / "hans_format_sample.txt", task="paraphrase"
  )


def test_nli_to_hans_collapses_neutral_and_contradiction():
  assert nli.nli_to_hans(np.array([0, 1, 2, 0])).tolist() == [0, 1, 1, 0]


def test_qqp_and_paws_tsv(tmp_path):
  qqp = _write(
      tmp_path / "train.tsv",
      [
          "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
          "0\t1\t2\tHow?\tWhy?\t0",
          "1\t3\t4\tA b?\tA  b ?\t1",
      ],
  )
  data = nli.read_pairs(qqp, task="paraphrase", report=False)
  assert data.label_names == nli.PARAPHRASE_LABELS
  assert data.labels.tolist() == [0, 1]
  assert data.premises == ["How?", "A b?"]
  paws = _write(
      tmp_path / "dev.tsv",
      ["id\tsentence1\tsentence2\tlabel", "1\tA cat .\tThe cat .\t1", "2\tx\ty\t0"],
  )
  assert nli.read_pairs(paws, task="paraphrase", report=False).labels.tolist() == [1, 0]


def test_glue_mnli_header_and_no_consensus_in_tsv(tmp_path):
  # GLUE's MNLI has label1 ... and gold_label; quotes are not special.
  path = _write(
      tmp_path / "dev_matched.tsv",
      [
          "index\tsentence1\tsentence2\tlabel1\tgold_label",
          'a\t"He said\tok\tneutral\tneutral',
          "b\tp\th\t-\t-",
          "c\tp\th\tentailment\tentailment",
      ],
  )
  data = nli.read_pairs(path, task="nli", report=False)
  assert data.premises == ['"He said', "p"]
  assert data.labels.tolist() == [1, 0]
  assert data.stats["skipped_no_consensus"] == 1


def test_tsv_lines_end_only_at_newline(tmp_path):
  path = tmp_path / "x.tsv"
  text = "premise\thypothesis\tgold_label\r\na\rb\tc\u2028d\tneutral\r\n"
  path.write_bytes(text.encode("utf-8"))
  data = nli.read_pairs(path, task="nli", report=False)
  assert data.premises == ["a\rb"] and data.hypotheses == ["c\u2028d"]


def test_malformed_tsv_names_file_and_line(tmp_path):
  path = _write(tmp_path / "bad.tsv", ["premise\thypothesis\tgold_label", "a\tb\tneutral", "a\tb"])
  message = _error(nli.read_pairs, path, task="nli")
  assert f"{path}:3:" in message and "3 tab-separated fields" in message


def test_unknown_label_is_an_error_not_a_drop(tmp_path):
  path = _write(tmp_path / "bad.tsv", ["premise\thypothesis\tgold_label", "a\tb\tneutrl"])
  message = _error(nli.read_pairs, path, task="nli")
  assert re.search(rf"{re.escape(str(path))}:2: field gold_label .*'neutrl'", message)
  qqp = _write(tmp_path / "qqp.tsv", ["question1\tquestion2\tis_duplicate", "a\tb\t1", "a\tb\t2"])
  assert f"{qqp}:3: field is_duplicate" in _error(nli.read_pairs, qqp, task="paraphrase")


def test_missing_column_lists_header(tmp_path):
  path = _write(tmp_path / "x.tsv", ["premise\tgold_label", "a\tneutral"])
  message = _error(nli.read_pairs, path, task="nli")
  assert f"{path}:1:" in message and "hypothesis" in message.replace("sentence2", "hypothesis")


def test_malformed_jsonl(tmp_path):
  good = '{"sentence1": "a", "sentence2": "b", "gold_label": "entailment"}'
  path = _write(tmp_path / "x.jsonl", [good, "{not json"])
  assert f"{path}:2:" in _error(nli.read_pairs, path, task="nli")
  path = _write(tmp_path / "y.jsonl", [good, '{"sentence1": "a", "gold_label": "neutral"}'])
  message = _error(nli.read_pairs, path, task="nli")
  assert f"{path}:2:" in message and "sentence2" in message
  path = _write(tmp_path / "z.jsonl", [good, good.replace("entailment", "Entailment")])
  assert f"{path}:2: field gold_label" in _error(nli.read_pairs, path, task="nli")


def test_bad_task_and_missing_file(tmp_path):
  assert "task" in _error(nli.read_pairs, tmp_path / "x.tsv", task="sts")
  assert "does not exist" in _error(nli.read_pairs, tmp_path / "x.tsv", task="nli")


@pytest.mark.parametrize("name, split", [("snli", "validation"), ("glue/mnli", "train")])
def test_tfds_not_prepared_is_a_user_error(tmp_path, name, split):
  pytest.importorskip("tensorflow_datasets")
  message = _error(nli.load_tfds_pairs, name, split=split, data_dir=tmp_path)
  assert "not prepared" in message and str(tmp_path) in message
  assert not any(tmp_path.rglob("*.tfrecord*"))  # Nothing was downloaded or built.


def test_tfds_unknown_dataset():
  assert "not supported" in _error(nli.load_tfds_pairs, "glue/sst2", split="train", data_dir="/x")


def test_accuracy():
  assert accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75


def test_macro_f1_by_hand():
  labels = np.array([0, 0, 1, 1, 2, 2])
  predictions = np.array([0, 1, 1, 1, 2, 0])
  # Class 0: TP 1, FP 1, FN 1 -> 1/2; class 1: TP 2, FP 1, FN 0 -> 4/5; class 2: TP 1, FN 1 -> 2/3.
  expected = (1 / 2 + 4 / 5 + 2 / 3) / 3
  assert macro_f1(labels, predictions, 3) == pytest.approx(expected)
  # A class that never occurs and is never predicted counts with F1 0.
  assert macro_f1(labels, predictions, 4) == pytest.approx(expected * 3 / 4)


def test_macro_f1_matches_sklearn():
  metrics = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(0)
  labels, predictions = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
  predictions[predictions == 2] = 1  # Class 2 never predicted.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for n in (3, 4):
      expected = metrics.f1_score(labels, predictions, average="macro", labels=list(range(n)))
      assert macro_f1(labels, predictions, n) == pytest.approx(expected)


def test_a_file_without_rows_is_one_error_naming_it(tmp_path, capsys):
  """A file without rows is one error naming it, not 0 pairs read, '1 pairs carved' from them and
  an error that blames the tokenizer."""
  header_only = _write(tmp_path / "train.tsv", ["premise\thypothesis\tgold_label"])
  assert _error(nli.read_pairs, header_only, task="nli") == (
      f"{header_only}: the file has no rows below its header, so there are no pairs to read."
  )
  blank = _write(tmp_path / "train.jsonl", ["", "  "])
  assert _error(nli.read_pairs, blank, task="nli") == (
      f"{blank}: the file has no JSON lines, so there are no pairs to read."
  )
  no_consensus = _write(tmp_path / "dev.tsv", ["premise\thypothesis\tgold_label", "a\tb\t-"])
  assert "none of its 1 rows is an example (1 have label '-'" in _error(
      nli.read_pairs, no_consensus, task="nli"
  )
  # Through the loader: the error comes before an eval set is carved or a tokenizer trained.
  from causal_attn_jax import config as causal_config
  from causal_attn_jax.data import loading

  config = causal_config.base_config()
  config.data.train_file = str(header_only)
  capsys.readouterr()
  with pytest.raises(UserError, match=re.escape(f"{header_only}: the file has no rows")):
    loading.load_classification(config, str(tmp_path / "w"))
  assert "carved" not in capsys.readouterr().out
