"""Parallel-text readers on the real WMT14 En-De / WMT16 En-Fi samples and malformed files; BLEU."""

import importlib.util
import pathlib

import pytest

from causal_attn_jax.data import loading, translation
from causal_attn_jax.metrics import bleu, corpus_bleu
from conftest import SHARED_DATA
from trainkit.errors import UserError

WMT14 = SHARED_DATA / "translation" / "wmt14_ende_opennmt"
WMT16 = SHARED_DATA / "translation" / "wmt16_enfi_newstest2016"


def _real(directory: pathlib.Path) -> pathlib.Path:
  if not directory.is_dir():
    pytest.skip(f"real translation sample {directory} is absent (see ../shared/data/README.md)")
  return directory


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(UserError) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("split, count", [("train", 10_000), ("val", 3_000)])
def test_wmt14_ende_plain_text(split, count):
  root = _real(WMT14)
  src, tgt = translation.read_parallel(root / f"src-{split}.txt", root / f"tgt-{split}.txt")
  assert len(src) == len(tgt) == count
  if split == "val":
    assert src[0] == "Parliament Does Not Support Amendment Freeing Tymoshenko"
    assert tgt[0] == "Keine befreiende Novelle für Tymoshenko durch das Parlament"
  # The files are Moses-escaped; unescape=True restores the characters.
  assert any("&apos;" in s for s in src)
  raw, _ = translation.read_parallel(
      root / f"src-{split}.txt", root / f"tgt-{split}.txt", unescape=True, report=False
  )
  assert not any("&apos;" in s or "&quot;" in s for s in raw)
  assert sum("'s" in s for s in raw) >= sum("&apos;s" in s for s in src) > 0


def test_wmt16_sgm_equals_plain_text():
  root = _real(WMT16)
  src, ref = translation.read_parallel(
      root / "newstest2016-enfi-src.en.sgm", root / "newstest2016-enfi-ref.fi.sgm"
  )
  plain_src, plain_ref = translation.read_parallel(
      root / "newstest2016-enfi.en", root / "newstest2016-enfi.fi", report=False
  )
  assert len(src) == len(ref) == 3000
  assert src == plain_src and ref == plain_ref
  assert src[0] == "A 9-year-old boy missing at Tampere was found"
  assert any("B&Q" in s for s in src)  # A bare & in the official file is kept.
  segments = translation.read_sgm(root / "newstest2016-enfi-src.en.sgm")
  assert next(iter(segments)) == ("aamulehti.fi.22966", "1")


def _sgm(path: pathlib.Path, docs: dict[str, list[tuple[str, str]]]) -> pathlib.Path:
  lines = ['<srcset setid="t" srclang="any">']
  for doc, segs in docs.items():
    lines += [f'<doc sysid="ref" docid="{doc}" genre="news">', "<p>"]
    lines += [f'<seg id="{seg}">{text}</seg>' for seg, text in segs]
    lines += ["</p>", "</doc>"]
  path.write_text("\n".join(lines + ["</srcset>"]) + "\n", encoding="utf-8")
  return path


def test_sgm_pairs_by_doc_and_seg_id_and_unescapes(tmp_path):
  src = _sgm(
      tmp_path / "s.sgm",
      {"d1": [("1", "a &amp; b &lt;c&gt; &#39;x&#x27;"), ("2", "two")], "d2": [("1", "three")]},
  )
  # The reference lists the documents in another order: pairing is by id, not position.
  ref = _sgm(tmp_path / "r.sgm", {"d2": [("1", "drei")], "d1": [("2", "zwei"), ("1", "eins")]})
  sources, targets = translation.read_parallel(src, ref, report=False)
  assert sources == ["a & b <c> 'x'", "two", "three"]
  assert targets == ["eins", "zwei", "drei"]


def test_sgm_segment_mismatch_is_an_error(tmp_path):
  src = _sgm(tmp_path / "s.sgm", {"d1": [("1", "a"), ("2", "b")]})
  ref = _sgm(tmp_path / "r.sgm", {"d1": [("1", "a"), ("3", "c")]})
  message = _error(translation.read_parallel, src, ref)
  assert str(src) in message and str(ref) in message and "doc d1 seg 2" in message


def test_malformed_sgm_names_line(tmp_path):
  path = tmp_path / "x.sgm"
  path.write_text('<srcset>\n<seg id="1">a</seg>\n', encoding="utf-8")
  assert f"{path}:2: <seg> outside a <doc>" in _error(translation.read_sgm, path)
  _sgm(path, {"d": [("1", "a"), ("1", "b")]})
  assert f"{path}:5: doc d seg 1 already appears on line 4" in _error(translation.read_sgm, path)


def test_unequal_line_counts_name_both_files(tmp_path):
  src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
  src.write_text("a\nb\nc\n", encoding="utf-8")
  tgt.write_text("x\ny\n", encoding="utf-8")
  message = _error(translation.read_parallel, src, tgt)
  assert f"{src} has 3 lines" in message and f"{tgt} has 2" in message


def test_plain_text_splits_only_on_newline(tmp_path):
  src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
  src.write_text("a\u2028b\r\nc\x0cd\n", encoding="utf-8")
  tgt.write_text("x\ny", encoding="utf-8")  # No final newline.
  sources, targets = translation.read_parallel(src, tgt, report=False)
  assert sources == ["a\u2028b", "c\x0cd"] and targets == ["x", "y"]


def test_mixed_formats_are_an_error(tmp_path):
  src = _sgm(tmp_path / "s.sgm", {"d": [("1", "a")]})
  (tmp_path / "t.txt").write_text("a\n", encoding="utf-8")
  assert ".sgm" in _error(translation.read_parallel, src, tmp_path / "t.txt")


def test_tfds_translation_not_prepared(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  message = _error(
      translation.load_tfds_translation,
      "wmt14_translate/de-en",
      split="validation",
      data_dir=tmp_path,
      source_lang="en",
      target_lang="de",
  )
  assert "not prepared" in message and str(tmp_path) in message
  assert "two languages" in _error(
      translation.load_tfds_translation,
      "wmt16_translate/ro-en",
      split="test",
      data_dir=tmp_path,
      source_lang="en",
      target_lang="fi",
  )


def test_bleu_identical_is_100():
  corpus = ["The cat sat on the mat .", "A 9-year-old boy missing at Tampere was found"]
  assert corpus_bleu(corpus, corpus) == pytest.approx(100.0)


def test_bleu_matches_sacrebleu():
  sacrebleu = pytest.importorskip("sacrebleu")
  hypotheses = ["The cat is on the mat.", "He read the book, quickly!", "Hello world"]
  references = ["The cat sat on the mat.", "He read the book quickly.", "Hello, world"]
  expected = sacrebleu.corpus_bleu(hypotheses, [references]).score
  assert corpus_bleu(hypotheses, references) == pytest.approx(expected)
  assert 0 < expected < 100
  with pytest.raises(ValueError):
    corpus_bleu(hypotheses, references[:2])


def test_bleu_detokenizes_moses_tokenized_references():
  references = ["I don 't think it 's over , he said .", "We can 't ( and won 't ) stop ."]
  untokenized = ["I don't think it's over, he said.", "We can't (and won't) stop."]
  assert bleu.looks_tokenized(references) and not bleu.looks_tokenized(untokenized)
  assert bleu.detokenize(references, "en") == untokenized
  # sacrebleu's 13a splits punctuation but not clitics: scored against the tokenised references,
  # the right (untokenised) translation loses BLEU; detokenised, it is 100.
  assert corpus_bleu(untokenized, references) < 70.0
  assert corpus_bleu(untokenized, bleu.detokenize(references, "en")) == pytest.approx(100.0)
  assert "tok:13a" in bleu.bleu_signature()


def test_shared_samples_tokenisation_is_detected():
  ende = _real(WMT14)
  assert bleu.looks_tokenized((ende / "tgt-val.txt").read_text().splitlines()[:200])
  fi = _real(WMT16) / "newstest2016-enfi.fi"
  assert not bleu.looks_tokenized(fi.read_text().splitlines()[:200])


@pytest.mark.parametrize("reverse", [False, True])
def test_reverse_swaps_file_inputs(repo_root, reverse):
  ENDE = _real(WMT14)
  spec = importlib.util.spec_from_file_location(
      "wmt14_ende", repo_root / "configs" / "wmt14_ende.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(f"size=small,reverse={reverse}")
  config.data.update(
      train_source=str(ENDE / "src-train.txt"),
      train_target=str(ENDE / "tgt-train.txt"),
      eval_source=str(ENDE / "src-val.txt"),
      eval_target=str(ENDE / "tgt-val.txt"),
      max_train_examples=5,
      max_eval_examples=5,
  )
  (train_src, train_tgt), (eval_src, eval_tgt) = loading.load_parallel(config)
  english = (ENDE / "src-val.txt").read_text().splitlines()[:5]
  german = (ENDE / "tgt-val.txt").read_text().splitlines()[:5]
  assert (eval_src, eval_tgt) == ((german, english) if reverse else (english, german))
  assert len(train_src) == len(train_tgt) == 5
