"""Causal Transformer end to end: `python -m causal_attn_jax.main` on the MNLI/HANS samples, a bad
data path, and a tiny translation run through `train_and_evaluate` (BLEU in the report)."""

import csv
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from causal_attn_jax import inference, train
from conftest import (
    CAUSAL_TINY_ARGS,
    ENDE,
    ENDE_TINY_DATA,
    ENDE_TINY_MODEL,
    ONE_DEVICE_XLA_FLAGS,
    REPO_ROOT,
    SHARED_DATA,
)
from trainkit.errors import USER_ERROR_EXIT_CODE
from trainkit.metric_writers import read_metrics

NLI = SHARED_DATA / "nli"

TINY = CAUSAL_TINY_ARGS
# The tiny MNLI/HANS run the tests below share (each copies its workdir before writing into it).
TRAINED = [
    *TINY,
    f"--config.data.train_file={NLI / 'mnli_dev_matched.tsv'}",
    f"--config.data.challenge_file={NLI / 'hans_format_sample.txt'}",
    "--config.checkpoint_every_steps=2",
]


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device, as on a user's laptop.
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _run(repo_root, workdir, *args, config="configs/mnli_hans.py:size=small,steps=4"):
  return subprocess.run(
      [
          sys.executable,
          "-m",
          "causal_attn_jax.main",
          f"--config={repo_root / config}",
          f"--workdir={workdir}",
          *args,
      ],
      cwd=repo_root,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The finished process and its workdir: one tiny run trained with TRAINED."""
  if not NLI.is_dir():
    pytest.skip("needs ../shared/data/nli")
  workdir = tmp_path_factory.mktemp("trained")
  return _run(REPO_ROOT, workdir, *TRAINED), workdir


def _copy(trained, tmp_path):
  result, workdir = trained
  assert result.returncode == 0, result.stderr
  return shutil.copytree(workdir, tmp_path, dirs_exist_ok=True)


def test_mnli_hans_cli_trains_evaluates_and_reports(repo_root, tmp_path, trained):
  result = trained[0]
  _copy(trained, tmp_path)
  report = json.loads((tmp_path / "report.json").read_text())
  assert 0.0 <= report["accuracy"] <= 1.0 and 0.0 <= report["macro_f1"] <= 1.0
  assert report["num_examples"] == 64 and report["attention"]["kind"] == "causal"
  # Sparsity per self-attention layer: a row over n real keys has 1 <= exp(entropy) <= n.
  assert set(report["attention"]["effective_keys"]) == {"enc0"}
  assert 1.0 <= report["attention"]["effective_keys"]["enc0"] <= 24.0
  assert 1.0 / 24 <= report["attention"]["top1_mass"]["enc0"] <= 1.0
  challenge = report["challenge"]
  assert 0.0 <= challenge["accuracy"] <= 1.0
  assert set(challenge["by_heuristic"]) == {"lexical_overlap"}
  assert set(challenge["by_heuristic"]["lexical_overlap"]) == {"entailment", "non-entailment"}
  assert set(report["constraints"]) >= {"rows_within", "cols_within", "nodes_within", "per_layer"}
  assert 0.0 <= report["constraints"]["rows_within"] <= 1.0
  assert all((tmp_path / p).is_file() for p in report["plots"]) and report["plots"]
  assert (tmp_path / "spm.model").is_file()
  metrics = read_metrics(str(tmp_path))
  assert [m["step"] for m in metrics] == [2, 4]
  assert (
      "constraints/enc0/rows_within" in metrics[0] and "constraints/enc0/multiplier" in metrics[0]
  )
  # Throughput: tokens are the max_len=24 positions of every pair; FLOPs from the compiled step.
  assert metrics[-1]["tokens_per_second"] == pytest.approx(metrics[-1]["examples_per_second"] * 24)
  assert metrics[-1]["model_tflops_per_second_per_device"] > 0
  # The run ends with its summary table (report.format_summary); one PNG per layer and example.
  assert "Causal Transformer report: classification, causal attention" in result.stdout
  assert "Challenge split: accuracy" in result.stdout and "lexical_overlap" in result.stdout
  assert report["constraints"]["summary"] in result.stdout
  assert report["plots"] == ["plots/attention_enc0_ex0.png"]

  # --mode=predict on sentence pairs: one row per pair, in order; the same pair in two batches
  # (eval_batch_size=32) gets the same probabilities, so padding and batching do not leak.
  pairs = [("A man is sleeping.", "Nobody sleeps."), ("The cat sat.", "A cat sat down.")]
  pairs = pairs + [(f"Sentence {i}.", f"Other {i}.") for i in range(38)] + pairs[:1]
  tsv = tmp_path / "pairs.tsv"
  tsv.write_text("# premise\thypothesis\n" + "".join(f"{p}\t{h}\n" for p, h in pairs))
  result = _run(repo_root, tmp_path, *TRAINED, "--mode=predict", f"--config.predict.input={tsv}")
  assert result.returncode == 0, result.stderr
  with open(tmp_path / "predict" / "predictions.tsv", newline="") as f:
    rows = list(csv.DictReader(f, delimiter="\t"))
  assert [(r["premise"], r["hypothesis"]) for r in rows] == pairs
  labels = ("entailment", "neutral", "contradiction")
  for row in rows:
    probs = {label: float(row[f"prob_{label}"]) for label in labels}
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    assert row["prediction"] == max(probs, key=probs.get)
  assert {k: v for k, v in rows[0].items()} == {k: v for k, v in rows[-1].items()}
  tsv.write_text("only one field\n")
  result = _run(repo_root, tmp_path, *TRAINED, "--mode=predict", f"--config.predict.input={tsv}")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert (
      result.stderr.strip()
      == f"error: {tsv}:1: expected 2 tab-separated fields (premise, hypothesis), got 1"
  )


def test_bad_data_path_is_one_line_error(repo_root, tmp_path):
  result = _run(repo_root, tmp_path, "--config.data.train_file=/nonexistent/train.tsv")
  assert result.returncode == USER_ERROR_EXIT_CODE
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "data.train_file" in lines[0] and "/nonexistent/train.tsv" in lines[0]


@pytest.mark.skipif(not ENDE.is_dir(), reason="needs ../shared/data/translation")
def test_tiny_translation_run_reports_bleu(repo_root, tmp_path, capfd):
  import importlib.util

  spec = importlib.util.spec_from_file_location("wmt14_ende", repo_root / "configs/wmt14_ende.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("size=small,steps=4")
  config.update_from_flattened_dict(
      {
          **ENDE_TINY_DATA,
          **ENDE_TINY_MODEL,
          "log_every_steps": 1,
          "eval_every_steps": 0,
          "checkpoint_every_steps": 4,
          "plots.num_examples": 0,
          "mesh.data": 1,
          # Dual ascent from step 0 (the small default waits until step 500).
          "constraints.dual_start_step": 0,
          "constraints.dual_ramp_steps": 0,
      }
  )
  from causal_attn_jax import config as config_lib

  config_lib.validate(config, num_devices=jax.device_count())
  report = train.train_and_evaluate(config, str(tmp_path))
  assert report["num_sentences"] == 16 and 0.0 <= report["bleu"] <= 100.0
  assert set(report["constraints"]["per_layer"]) == {"enc0", "dec0"}
  saved = json.loads((tmp_path / "report.json").read_text())
  assert saved["bleu"] == report["bleu"]
  # The decoder (no slack) starts out of bounds: its multipliers grow step after step.
  multipliers = [m["constraints/dec0/multiplier"] for m in read_metrics(str(tmp_path))]
  assert multipliers[0] > 0 and all(b > a for a, b in zip(multipliers, multipliers[1:]))
  # Not met at this budget, and the console says why: the multipliers were still rising.
  assert not report["constraints"]["met"]
  [why, *_] = report["constraints"]["notes"]
  assert why.startswith("Not met at this budget: the multipliers were still rising at the last")
  assert why in capfd.readouterr().out

  # --mode=predict on eval sentences (the escape-free ones, as the file reader leaves them)
  # translates them as the evaluation's beam search did.
  from causal_attn_jax import decoding, tasks
  from trainkit.checkpoint import restore_trained

  data, run = train._setup(config, str(tmp_path), training=False)
  state, _ = restore_trained(run.checkpointer, run.state)
  translate = decoding.make_translate_fn(run.graphdef, config)
  hypotheses = tasks.translate_ids(config, data, state, translate, run.mesh, data.eval["src"][:16])
  lines = (ENDE / "src-val.txt").read_text().splitlines()[:16]
  chosen = [i for i, line in enumerate(lines) if "&" not in line and line.strip()][:3]
  sources = tmp_path / "sources.txt"
  sources.write_text("".join(lines[i] + "\n" for i in chosen))
  config.predict.input = str(sources)
  path = inference.predict_checkpoint(config, str(tmp_path))
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f, delimiter="\t"))
  assert [r["source"] for r in rows] == [lines[i] for i in chosen]
  assert [r["translation"] for r in rows] == [hypotheses[i] for i in chosen]


CAUSAL_CONFIGS = ["snli.py", "mnli_hans.py", "qqp_paws.py", "wmt14_ende.py", "wmt16_enro.py"]


def _load_config(repo_root, name, arg=None):
  import importlib.util

  spec = importlib.util.spec_from_file_location(name[:-3], repo_root / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("name", CAUSAL_CONFIGS)
def test_causal_config_files_validate_once_data_is_given(repo_root, name, tmp_path):
  from causal_attn_jax import config as config_lib
  from trainkit.errors import ConfigError

  assert "python -m causal_attn_jax.main" in (repo_root / "configs" / name).read_text()
  sample = tmp_path / "sample.txt"
  sample.write_text("x\n")
  for arg in ("size=full", "size=small,attention=band,gcn_hops=2"):
    config = _load_config(repo_root, name, arg)
    key = "data.train_file" if config.task == "classification" else "data.train_source"
    # Data paths have no default: the bare config names the key that is missing.
    with pytest.raises(ConfigError, match=f"{key}': is required"):
      config_lib.validate(config, num_devices=8)
    for key in ("train_file", "train_source", "train_target", "eval_source", "eval_target"):
      config.data[key] = str(sample)
    config_lib.validate(config, num_devices=8)
  full = _load_config(repo_root, name, "size=full")
  if full.task == "translation":  # Paper Sec. 4.2.
    assert (full.model.dim, full.model.num_layers, full.model.num_heads) == (512, 6, 8)
    assert full.model.head_dim == 64
  assert _load_config(repo_root, name, "attention=vanilla").constraints.weight == 0


def test_rejected_resume_leaves_config_json_as_trained(repo_root, tmp_path, trained):
  saved = (_copy(trained, tmp_path) / "config.json").read_text()
  result = _run(repo_root, tmp_path, *TRAINED, "--config.model.mlp_dim=32")
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr
  assert "config.json" in result.stderr
  assert (tmp_path / "config.json").read_text() == saved
  assert not (tmp_path / "config_history").exists()

  # --mode=eval never retrains a deleted tokenizer (it would change the vocabulary).
  (tmp_path / "spm.model").unlink()
  result = _run(repo_root, tmp_path, *TRAINED, "--mode=eval")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "spm.model is missing" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "spm.model").exists()
  # Nor does a resumed training run (it would train on with another vocabulary).
  result = _run(repo_root, tmp_path, *TRAINED)
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "spm.model is missing" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "spm.model").exists()


def test_eval_without_checkpoint_and_early_errors_leave_no_workdir(repo_root, tmp_path):
  workdir = tmp_path / "never_trained"
  result = _run(
      repo_root,
      workdir,
      *TINY,
      f"--config.data.train_file={NLI / 'mnli_dev_matched.tsv'}",
      "--mode=eval",
  )
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "no checkpoint in" in result.stderr and not workdir.exists()
  # A data error found after the workdir was made (a malformed row) removes the empty workdir.
  bad = tmp_path / "bad.tsv"
  bad.write_text("not\ta\tvalid\theader\n1\t2\n")
  result = _run(repo_root, workdir, *TINY, f"--config.data.train_file={bad}")
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-2000:]
  assert "bad.tsv" in result.stderr.strip().splitlines()[-1]
  assert not workdir.exists()


def test_corrupt_final_checkpoint_is_moved_aside_rewritten_and_reported(
    repo_root, tmp_path, trained
):
  _copy(trained, tmp_path)
  for root, _, files in os.walk(tmp_path / "checkpoints" / "4"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  result = _run(repo_root, tmp_path, *TRAINED)
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["step"] == 4
  assert report["checkpoint_fallback"]["skipped"][0].startswith("step 4:")
  assert (tmp_path / "checkpoints" / "corrupt" / "4").is_dir()
  # The final state was saved again: evaluation scores step 4, with nothing skipped.
  result = _run(repo_root, tmp_path, *TRAINED, "--mode=eval")
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["step"] == 4 and "checkpoint_fallback" not in report
