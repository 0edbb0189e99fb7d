"""SentencePiece training on real sentences, resume, pair packing, and numpy batching."""

import numpy as np
import pytest

from causal_attn_jax.data import batching, translation
from causal_attn_jax.data import tokenizer as tok_lib
from conftest import SHARED_DATA, small_disk
from trainkit.errors import UserError, is_out_of_space

pytest.importorskip("sentencepiece")

WMT14_VAL = SHARED_DATA / "translation" / "wmt14_ende_opennmt" / "src-val.txt"
VOCAB = 200


@pytest.fixture(scope="module")
def sentences() -> list[str]:
  if not WMT14_VAL.is_file():
    pytest.skip(f"real sentences {WMT14_VAL} are absent (see ../shared/data/README.md)")
  return translation.read_lines(WMT14_VAL, unescape=True)[:300]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("workdir")


@pytest.fixture(scope="module")
def tokenizer(sentences, workdir) -> tok_lib.Tokenizer:
  return tok_lib.load_or_train(workdir, sentences, VOCAB, character_coverage=1.0)


def test_trained_model_has_fixed_specials(tokenizer, workdir):
  assert (workdir / "spm.model").is_file() and (workdir / "spm.json").is_file()
  assert not [p for p in workdir.iterdir() if p.name.startswith(".")]  # No temp files left.
  assert tokenizer.vocab_size == VOCAB
  assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
  assert tokenizer.sep_id == 4


def test_round_trip(tokenizer, sentences):
  ids = tokenizer.encode(sentences, 400, add_bos=True, add_eos=True)
  assert ids.dtype == np.int32 and ids.shape == (len(sentences), 400)
  assert (ids[:, 0] == tok_lib.BOS_ID).all()
  assert tokenizer.decode_batch(ids) == sentences
  one = tokenizer.encode(sentences[0], 400)
  assert one.shape == (400,) and tokenizer.decode(one) == sentences[0]


def test_encode_truncates_and_keeps_eos(tokenizer, sentences):
  ids = tokenizer.encode(sentences[1], 8, add_bos=True)
  assert ids[0] == tok_lib.BOS_ID and ids[-1] == tok_lib.EOS_ID and (ids != 0).all()
  assert tokenizer.tokenize(sentences[1])[0][:6] == ids[1:7].tolist()
  with pytest.raises(UserError):
    tokenizer.encode("x", 2, add_bos=True)


def test_decode_stops_at_eos_and_skips_pad(tokenizer):
  hello = tokenizer.tokenize("the house")[0]
  ids = [tok_lib.BOS_ID, *hello, tok_lib.EOS_ID, *hello, 0, 0]
  assert tokenizer.decode(ids) == "the house"
  assert tokenizer.decode([0, *hello, 0]) == "the house"
  assert "⁇" in tokenizer.decode([VOCAB + 5])  # Out of range -> <unk>, no crash.


def test_resume_reuses_model_without_reading_texts(tokenizer, workdir):
  before = (workdir / "spm.model").stat().st_mtime_ns

  def never():
    raise AssertionError("texts must not be read when resuming")
    yield  # pylint: disable=unreachable

  again = tok_lib.load_or_train(workdir, never(), VOCAB, character_coverage=1.0)
  assert (workdir / "spm.model").stat().st_mtime_ns == before
  assert again.encode("the house", 16).tolist() == tokenizer.encode("the house", 16).tolist()


def test_resume_with_other_settings_is_an_error(tokenizer, workdir):
  with pytest.raises(UserError, match=r"spm.model has vocab_size 200 but 300 was requested"):
    tok_lib.load_or_train(workdir, [], 300, character_coverage=1.0)
  with pytest.raises(UserError, match=r"model_type='unigram'.*model_type='bpe'"):
    tok_lib.load_or_train(workdir, [], VOCAB, model_type="bpe", character_coverage=1.0)


def test_bpe_and_training_errors(sentences, tmp_path):
  bpe = tok_lib.load_or_train(tmp_path / "bpe", sentences[:100], 150, model_type="bpe")
  assert bpe.vocab_size == 150 and bpe.sep_id == 4
  with pytest.raises(UserError, match="no non-empty training text"):
    tok_lib.train_sentencepiece(["", " "], tmp_path / "empty", vocab_size=100)
  with pytest.raises(UserError, match="failed"):
    tok_lib.train_sentencepiece(["a b"], tmp_path / "tiny", vocab_size=100)
  assert not list(tmp_path.glob(".*"))
  with pytest.raises(UserError, match="model_type"):
    tok_lib.train_sentencepiece(sentences, tmp_path / "x", vocab_size=100, model_type="word2")


def test_encode_pair_layout(tokenizer):
  premise, hypothesis = tokenizer.tokenize(["the house", "a man"])
  ids, segments = tokenizer.encode_pair("the house", "a man", 32)
  n1, n2 = len(premise) + 2, len(hypothesis) + 1
  assert ids[:n1].tolist() == [tok_lib.BOS_ID, *premise, tokenizer.sep_id]
  assert ids[n1 : n1 + n2].tolist() == [*hypothesis, tok_lib.EOS_ID]
  assert (ids[n1 + n2 :] == 0).all()
  assert segments.tolist() == [1] * n1 + [2] * n2 + [0] * (32 - n1 - n2)
  batch_ids, batch_segments = tokenizer.encode_pair(["the house"] * 2, ["a man"] * 2, 32)
  assert batch_ids.shape == (2, 32) and (batch_ids[1] == ids).all()
  assert (batch_segments[0] == segments).all()


def test_encode_pair_truncates_longer_first(tokenizer, sentences):
  long, short = sentences[1], "a man"
  short_ids = tokenizer.tokenize(short)[0]
  ids, segments = tokenizer.encode_pair(long, short, 20)
  assert (ids != 0).all() and ids[-1] == tok_lib.EOS_ID
  # The short hypothesis is kept whole; the long premise gives up its tail.
  assert ids[segments == 2].tolist() == [*short_ids, tok_lib.EOS_ID]
  ids, segments = tokenizer.encode_pair(short, long, 20)
  assert ids[1 : 1 + len(short_ids)].tolist() == short_ids
  assert (segments == 2).sum() == 20 - len(short_ids) - 2


def test_pair_lengths_equals_token_by_token_longest_first():
  for lp in range(12):
    for lh in range(12):
      for budget in range(12):
        a, b = lp, lh
        while a + b > budget:
          if a > b:
            a -= 1
          else:
            b -= 1
        assert tok_lib.pair_lengths(lp, lh, budget) == (a, b), (lp, lh, budget)


def test_sequence_lengths_count_up_to_the_last_real_token():
  ids = np.array([[5, 6, 0], [8, 0, 0], [0, 0, 0], [0, 7, 0]], np.int32)
  assert batching.sequence_lengths(ids).tolist() == [2, 1, 0, 2]


def test_bucketed_batches_are_deterministic_and_grouped():
  lengths = np.random.default_rng(0).integers(1, 100, 1000)
  a = batching.bucketed_batches(lengths, 16, seed=3, epoch=1, pool_batches=10)
  b = batching.bucketed_batches(lengths, 16, seed=3, epoch=1, pool_batches=10)
  c = batching.bucketed_batches(lengths, 16, seed=3, epoch=2, pool_batches=10)
  assert all((x == y).all() for x, y in zip(a, b)) and len(a) == len(b) == 1000 // 16
  assert any((x != y).any() for x, y in zip(a, c))
  flat = np.concatenate(a)
  assert len(set(flat.tolist())) == len(flat) == 16 * (1000 // 16)
  spread = np.mean([np.ptp(lengths[x]) for x in a])
  unbucketed = batching.bucketed_batches(lengths, 16, seed=3, pool_batches=1)
  assert spread < np.mean([np.ptp(lengths[x]) for x in unbucketed]) / 3


def test_eval_batches_fixed_shape_with_mask():
  arrays = {"ids": np.arange(20, dtype=np.int32).reshape(10, 2) + 1, "label": np.arange(10)}
  batches = list(batching.eval_batches(arrays, 4))
  assert len(batches) == 3
  assert all(b["ids"].shape == (4, 2) and b["mask"].shape == (4,) for b in batches)
  assert batches[-1]["mask"].tolist() == [True, True, False, False]
  assert (batches[-1]["ids"][2:] == 0).all()
  labels = np.concatenate([b["label"][b["mask"]] for b in batches])
  assert labels.tolist() == list(range(10))


def test_a_full_disk_while_the_tokenizer_is_written_leaves_no_partial_files(sentences, tmp_path):
  # The model (about 240 kB at VOCAB pieces) cannot fit a 200 kB disk beside its vocabulary.
  with small_disk(tmp_path, 1) as disk:
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (1024 * 1024 - 200 * 1024))
    workdir = disk / "run"
    with pytest.raises(OSError) as error:
      tok_lib.load_or_train(workdir, sentences, VOCAB, character_coverage=1.0)
    assert is_out_of_space(error.value) and error.value.filename.startswith(str(workdir / "spm."))
    # Nothing half-written for the rerun to trip over: no model, vocabulary or temporary.
    assert sorted(p.name for p in workdir.iterdir()) in ([], ["spm.vocab"])
    if (workdir / "spm.vocab").exists():  # Written whole before the model failed.
      assert len((workdir / "spm.vocab").read_text().splitlines()) == VOCAB
    filler.unlink()
    tokenizer = tok_lib.load_or_train(workdir, sentences, VOCAB, character_coverage=1.0)
    assert tokenizer.vocab_size == VOCAB
