"""`fairmoe_jax.compare`: the summary and markdown on hand-made runs, then once end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fairmoe_jax import compare
from trainkit.errors import UserError


def _write_report(directory, accuracy: float, pqd: float, dp: float, *, attributes=("sex", "age")):
  directory.mkdir(parents=True)
  report = {
      "accuracy": accuracy,
      "num_examples": 100,
      "loss": 1.0,
      "step": 10,
      "method": directory.parent.name,
      "attributes": {
          a: {
              "pqd": pqd + 0.01 * i,
              "dp": dp,
              "eopp": 0.0,
              "eodds": 0.0,
              "groups": {},
              "empty_groups": [],
          }
          for i, a in enumerate(attributes)
      },
      "mf": {"pqd": pqd, "dp": dp, "eopp": 0.0, "eodds": 0.0},
      "experts_active": {"choices": {"moe_block3": 2.0 + pqd}},
      "gradient_cosine": {"sex|age": [0.5, pqd - 0.5]},
  }
  (directory / "report.json").write_text(json.dumps(report))
  return str(directory)


@pytest.fixture
def runs(tmp_path):
  """fairsmoe: three seeds; vanilla_smoe: one seed, one failed, one never run."""
  fairsmoe = [
      _write_report(tmp_path / "fairsmoe" / f"seed{s}", acc, pqd, dp)
      for s, (acc, pqd, dp) in enumerate(
          [(0.70, 0.80, 0.010), (0.74, 0.85, 0.012), (0.75, 0.83, 0.020)]
      )
  ]
  failed = tmp_path / "vanilla_smoe" / "seed1"
  failed.mkdir(parents=True)
  (failed / "error.txt").write_text(
      "RuntimeError: out of memory\n\nTraceback (most recent call last): ..."
  )
  vanilla = [
      _write_report(tmp_path / "vanilla_smoe" / "seed0", 0.60, 0.50, 0.030, attributes=("sex",)),
      str(failed),
      str(tmp_path / "vanilla_smoe" / "seed2"),
  ]
  return {"fairsmoe": fairsmoe, "vanilla_smoe": vanilla}


def test_summarise_mean_and_sample_std_over_successful_seeds(runs):
  summary = compare.summarise(runs)
  fair = summary["methods"]["fairsmoe"]
  assert fair["num_seeds"] == 3 and fair["seeds"] == [0, 1, 2]
  for key, values in {
      "accuracy": [0.70, 0.74, 0.75],
      "mf_pqd": [0.80, 0.85, 0.83],
      "mf_dp": [0.010, 0.012, 0.020],
  }.items():
    assert fair[key]["values"] == values
    np.testing.assert_allclose(fair[key]["mean"], np.mean(values))
    np.testing.assert_allclose(fair[key]["std"], np.std(values, ddof=1))
  np.testing.assert_allclose(fair["pqd"]["age"]["mean"], np.mean([0.81, 0.86, 0.84]))

  vanilla = summary["methods"]["vanilla_smoe"]
  assert vanilla["num_seeds"] == 1
  assert vanilla["accuracy"] == {"mean": 0.60, "std": None, "values": [0.60]}
  assert summary["attributes"] == ["sex", "age"]
  assert [(f["seed"], f["status"]) for f in summary["failed"]] == [(1, "failed"), (2, "missing")]
  assert summary["failed"][0]["error"] == "RuntimeError: out of memory"
  assert {r["status"] for r in vanilla["runs"]} == {"ok", "failed", "missing"}
  json.dumps(summary)  # comparison.json must be writable as is.


def test_format_markdown_scales_and_lists_failures(runs):
  markdown = compare.format_markdown(compare.summarise(runs))
  acc, dp = [0.70, 0.74, 0.75], [0.010, 0.012, 0.020]
  fair_row = next(line for line in markdown.splitlines() if line.startswith("| fairsmoe | "))
  assert f"{100 * np.mean(acc):.2f} ± {100 * np.std(acc, ddof=1):.2f}" in fair_row
  assert f"{1e3 * np.mean(dp):.2f} ± {1e3 * np.std(dp, ddof=1):.2f}" in fair_row  # DP x 1e-3.
  assert fair_row.endswith("| 3 |")
  # Experts active (Fig. 5) and the mean gradient cosine over pairs and batches (Fig. 6).
  active, cosine = np.array([2.80, 2.85, 2.83]), np.array([0.40, 0.425, 0.415])
  assert f"{active.mean():.2f} ± {active.std(ddof=1):.2f}" in fair_row
  assert f"{cosine.mean():.3f} ± {cosine.std(ddof=1):.3f}" in fair_row
  # One seed: the value alone; an attribute the method lacks: a dash.
  assert "| vanilla_smoe | 60.00 | 0.5000 | 30.00 | 2.50 | 0.250 | 1 |" in markdown
  assert "| vanilla_smoe | 0.5000 | 0.0300 | — | — |" in markdown
  assert "| Method | sex PQD | sex DP | age PQD | age DP |" in markdown
  assert "vanilla_smoe seed 1 (failed" in markdown and "out of memory" in markdown
  assert "vanilla_smoe seed 2 (missing" in markdown


def test_a_method_entry_carries_config_overrides():
  from fairmoe_jax import config as fairmoe_config

  base = fairmoe_config.base_config()
  config = compare.run_config(
      base, "fairsmoe@fair.specialization=class_routing@fair.alpha=0.5@fair.dynamic_allocation=false", 3
  )
  assert (config.method, config.seed, config.fair.specialization) == ("fairsmoe", 3, "class_routing")
  assert config.fair.alpha == 0.5 and config.fair.dynamic_allocation is False
  assert base.fair.specialization == "attribute_routing"  # The shared config is not touched.
  with pytest.raises(UserError, match="unknown config key 'fair.nope'"):
    compare.run_config(base, "fairsmoe@fair.nope=1", 0)
  with pytest.raises(UserError, match="fair.specialization"):  # Validated like any config.
    compare.run_config(base, "fairsmoe@fair.specialization=other", 0)


def test_bad_methods_and_seeds_are_user_errors():
  with pytest.raises(UserError, match="unknown method.*nope.*fairsmoe"):
    compare.parse_methods(["fairsmoe", "nope"])
  with pytest.raises(UserError, match="not an integer"):
    compare.parse_seeds(["0", "x"])
  assert compare.parse_methods(["muffin", "muffin", "fairsmoe"]) == ["muffin", "fairsmoe"]
  assert compare.parse_seeds(["2", "0", "2"]) == [2, 0]


TINY = [
    "--config=configs/quickstart.py:steps=2",
    "--config.data.train_size=128",
    "--config.data.val_size=64",
    "--config.data.test_size=64",
    "--config.eval_every_steps=0",
    "--config.batch_size=32",
    "--config.eval_batch_size=64",
    "--config.model.depth=1",
    "--config.model.dim=32",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.analysis_batches=0",
]


def _compare(repo_root, workdir, *args):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # One CPU device: faster than conftest's eight fake ones.
  return subprocess.run(
      [sys.executable, "-m", "fairmoe_jax.compare", *TINY, f"--workdir={workdir}", *args],
      cwd=repo_root,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def test_compare_end_to_end_then_resume_without_retraining(repo_root, tmp_path):
  args = ["--methods=vanilla_smoe,multifair", "--seeds=0"]
  result = _compare(repo_root, tmp_path, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  markdown = (tmp_path / "comparison.md").read_text()
  summary = json.loads((tmp_path / "comparison.json").read_text())
  assert "| vanilla_smoe | " in markdown and "| multifair | " in markdown
  assert markdown in result.stdout
  assert list(summary["methods"]) == ["vanilla_smoe", "multifair"]
  assert summary["failed"] == []
  for method in ("vanilla_smoe", "multifair"):
    assert summary["methods"][method]["num_seeds"] == 1
    report = json.loads((tmp_path / method / "seed0" / "report.json").read_text())
    assert report["method"] == method

  reports = sorted(tmp_path.glob("*/seed0/report.json"))
  mtimes = [p.stat().st_mtime_ns for p in reports]
  result = _compare(repo_root, tmp_path, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("not retrained") == 2
  assert [p.stat().st_mtime_ns for p in reports] == mtimes

  # Asked for other settings, the finished runs are stale: an error before anything trains.
  result = _compare(repo_root, tmp_path, *args, "--config.num_train_steps=3")
  assert result.returncode == 2
  assert "num_train_steps: 2 -> 3" in result.stderr and "--retrain" in result.stderr
  assert [p.stat().st_mtime_ns for p in reports] == mtimes
  result = _compare(repo_root, tmp_path, *args, "--config.num_train_steps=3", "--retrain")
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((tmp_path / "multifair" / "seed0" / "report.json").read_text())["step"] == 3
  assert (tmp_path / "multifair" / "seed0.stale-1" / "report.json").is_file()


def test_unknown_method_is_one_line_error(repo_root, tmp_path):
  result = _compare(repo_root, tmp_path, "--methods=vanilla_smoe,bogus")
  assert result.returncode == 2
  assert (
      result.stderr.strip().splitlines()[-1].startswith("error: --methods: unknown method(s) bogus")
  )
  assert not (tmp_path / "vanilla_smoe").exists()
