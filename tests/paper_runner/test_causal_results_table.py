"""The causal_attn_jax quick results table, directly and through its script."""

import json
import subprocess
import sys

import numpy as np
import scipy.stats

from paper_runner.causal import results_table


def _report(accuracy: float, keys: float) -> dict:
  return {
      "accuracy": accuracy,
      "challenge": {
          "accuracy": accuracy / 2,
          "by_heuristic": {"lexical_overlap": {"entailment": 0.25, "non-entailment": None}},
      },
      "attention": {"effective_keys": {"l0": keys, "l1": keys + 2}, "top1_mass": {"l0": 0.5}},
      "constraints": {"nodes_within": 0.9},
  }


def test_a_row_per_name_with_each_column_s_mean_and_interval_over_seeds():
  groups = {"vanilla": [_report(0.6, 3.0), _report(0.8, 5.0)], "causal": [_report(0.5, 1.0)]}
  header, _, vanilla, causal = results_table.format_table(groups).splitlines()
  assert header == (
      "| run | accuracy | challenge | challenge entailment | effective keys | top-1 mass |"
      " nodes within | seeds |"
  )
  # Mean and 95% Student-t interval over the two seeds: mean ± t(0.975, 1) * std / sqrt(2).
  half = scipy.stats.t.ppf(0.975, 1) * np.std([0.6, 0.8], ddof=1) / np.sqrt(2)
  accuracy = f"{0.7:.3f} [{0.7 - half:.3f}, {0.7 + half:.3f}]"
  challenge = f"{0.35:.3f} [{0.35 - half / 2:.3f}, {0.35 + half / 2:.3f}]"
  assert vanilla.startswith(f"| vanilla | {accuracy} | {challenge} | 0.250 [0.250, 0.250] |")
  assert vanilla.endswith("| 2 |")
  assert causal.startswith("| causal | 0.500 | 0.250 |") and causal.endswith("| 1 |")


def test_script_prints_the_same_table(tmp_path, repo_root):
  for name, report in (("vanilla_s0", _report(0.6, 3.0)), ("vanilla_s1", _report(0.8, 5.0))):
    (tmp_path / name).mkdir()
    (tmp_path / name / "report.json").write_text(json.dumps(report))
  result = subprocess.run(
      [
          sys.executable,
          "scripts/tabulate_causal.py",
          str(tmp_path / "vanilla_s0"),
          str(tmp_path / "vanilla_s1"),
          str(tmp_path / "absent_s0"),
      ],
      cwd=repo_root,
      capture_output=True,
      text=True,
      check=True,
  )
  groups = {"vanilla": [_report(0.6, 3.0), _report(0.8, 5.0)]}
  assert result.stdout == results_table.format_table(groups)
  assert "skipping" in result.stderr and "absent_s0" in result.stderr


def test_the_constraint_report_says_whether_the_constraint_is_met():
  from causal_attn_jax import report

  result = {
      "rows_within": np.array([0.97, 0.40]),
      "cols_within": np.array([0.93, 0.60]),
      "nodes_within": np.array([0.95, 0.50]),
      "violation": np.array([0.001, 0.2]),
  }
  multipliers = np.array([[[0.5, 0.1]], [[2.0, 3.0]]])  # [layers, heads, terms]
  r = report._constraint_report(result, ["enc0", "enc1"], multipliers, trained=True)
  assert r["per_layer"]["enc0"]["met"] and not r["per_layer"]["enc1"]["met"]
  assert r["met"] is False
  assert r["per_layer"]["enc1"]["violation"] == 0.2
  assert r["per_layer"]["enc1"]["multiplier"] == r["mean_multiplier"]["enc1"] == 2.5
  assert r["summary"].startswith("Markov-blanket constraint NOT met")
  assert "not met in enc1" in r["summary"]
  result["nodes_within"] = np.array([0.95, 0.91])
  assert report._constraint_report(result, ["enc0", "enc1"], multipliers, True)["met"] is True
  measured = report._constraint_report(result, ["enc0", "enc1"], multipliers, trained=False)
  assert "not trained with the constraint (measured only)" in measured["summary"]
