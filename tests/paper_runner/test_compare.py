"""`paper_runner.fairmoe.compare` and its table collector `paper_runner.fairmoe.paper_table`: the
table on hand-made runs, early errors, then once end to end through the experiment runner."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.stats

from conftest import ONE_DEVICE_XLA_FLAGS
from fairmoe_jax.config import base_config
from paper_runner import spec
from paper_runner.collect import RunResult, write_tables
from paper_runner.fairmoe import compare, paper_table
from trainkit.errors import UserError


def _report(method: str, accuracy: float, pqd: float, dp: float, *, attributes=("sex", "age")):
  return {
      "accuracy": accuracy,
      "num_examples": 100,
      "loss": 1.0,
      "step": 10,
      "method": method,
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
      "dropped": {"train": 0.3 if method == "fairsmoe" else 0.1, "test": 0.0},
  }


def _run(method, seed, status="ok", report=None, error=None):
  point = {"method": method, "seed": seed}
  return RunResult(point, f"/w/runs/method={method},seed={seed}", status, report, error)


@pytest.fixture
def runs():
  """fairsmoe: three seeds; vanilla_smoe: one seed, one failed, one never run (grid order)."""
  fairsmoe = [
      _run("fairsmoe", s, report=_report("fairsmoe", acc, pqd, dp))
      for s, (acc, pqd, dp) in enumerate(
          [(0.70, 0.80, 0.010), (0.74, 0.85, 0.012), (0.75, 0.83, 0.020)]
      )
  ]
  vanilla = [
      _run("vanilla_smoe", 0, report=_report("vanilla_smoe", 0.6, 0.5, 0.03, attributes=("sex",))),
      _run("vanilla_smoe", 1, "failed", error="exit code 1: RuntimeError: out of memory"),
      _run("vanilla_smoe", 2, "missing", error="no report.json (not run, or interrupted)"),
  ]
  return fairsmoe + vanilla


def _sweep(seeds):
  """The comparison of fairsmoe and vanilla_smoe over `seeds` on a small quickstart dataset."""
  small = {"data.train_size": 128, "data.val_size": 64, "data.test_size": 64}
  return compare.comparison_sweep(
      "configs/quickstart.py:steps=2", small, ["fairsmoe", "vanilla_smoe"], seeds
  )


def _row(markdown: str, label: str) -> str:
  return next(line for line in markdown.splitlines() if line.startswith(f"| {label} | "))


def test_comparison_cells_are_intervals_over_successful_seeds_beside_references(runs):
  markdown, summary = paper_table.comparison(_sweep([0, 1, 2]), runs)
  t = scipy.stats.t.ppf(0.975, 2)  # 95% Student-t interval over 3 seeds.

  def cell(values, scale, decimals):
    values = scale * np.asarray(values)
    half = t * values.std(ddof=1) / np.sqrt(len(values))
    mean = values.mean()
    return f"{mean:.{decimals}f} [{mean - half:.{decimals}f}, {mean + half:.{decimals}f}]"

  fair_row = _row(markdown, "fairsmoe")
  assert cell([0.70, 0.74, 0.75], 100, 1) in fair_row  # Acc. (%).
  assert cell([0.010, 0.012, 0.020], 1, 3) in fair_row  # MF-DP.
  # Experts active (Fig. 5) and the mean gradient cosine over pairs and batches (Fig. 6).
  assert cell([2.80, 2.85, 2.83], 1, 2) in fair_row
  assert cell([0.40, 0.425, 0.415], 1, 3) in fair_row
  assert cell([0.81, 0.86, 0.84], 1, 3) in fair_row  # PQD age.
  assert fair_row.endswith("| 3 |")
  # One seed: the value alone; an attribute the method lacks: a dash.
  expected = (
      "| vanilla_smoe | 60.0 | 0.500 | 0.030 | 2.50 | 0.250 | 0.100 | 0.500 | 0.030 | — | — | 1 |"
  )
  assert expected in markdown
  assert (
      "| Acc. (%) | MF-PQD | MF-DP | Experts active | Grad. cos | Dropped (train) | PQD sex |"
      in (markdown)
  )
  # The readers without a model, scored on the runs' data, and the bar they set.
  assert "| *reference: majority class of the training split (" in markdown
  chance = _row(
      markdown,
      "*reference: chance (4 classes, a uniform guess); mean [95% range] of 2000 seeded draws*",
  )
  assert chance.endswith("| — |") and "[" in chance.split("|")[2]
  # Its claims are on scores, so no control is trained (the results tables' comparisons have them).
  assert "*reference: vanilla SMoE untrained" not in markdown
  assert "*reference: uniform router" not in markdown
  assert "Flag: runs without a result: vanilla_smoe seeds 1 (failed), 2 (missing)." in markdown
  runs_json = json.loads(json.dumps(summary, default=dataclasses.asdict))["record"]["runs"]
  assert [(r["row"], r["seed"], r["status"]) for r in runs_json if r["status"] != "ok"] == [
      ("vanilla_smoe", 1, "failed"),
      ("vanilla_smoe", 2, "missing"),
  ]
  assert runs_json[4]["error"] == "exit code 1: RuntimeError: out of memory"
  accuracy = summary["rows"]["fairsmoe"]["cells"]["accuracy"]
  np.testing.assert_allclose(accuracy.mean, np.mean([0.70, 0.74, 0.75]))
  assert summary["rows"]["vanilla_smoe"]["seeds"] == [0]


def test_a_method_entry_carries_config_overrides():
  base = base_config()
  config = compare.run_config(
      base,
      "fairsmoe@fair.specialization=class_routing@fair.alpha=0.5@fair.dynamic_allocation=false",
      3,
  )
  assert (config.method, config.seed, config.fair.specialization) == (
      "fairsmoe",
      3,
      "class_routing",
  )
  assert config.fair.alpha == 0.5 and config.fair.dynamic_allocation is False
  assert base.fair.specialization == "expert_competence"  # The shared config is not touched.
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
  bad_part = r"--methods: 'fair\.alpha' is not KEY=VALUE.*in 'fairsmoe@fair\.alpha'"
  with pytest.raises(UserError, match=bad_part):
    compare.parse_methods(["fairsmoe@fair.alpha"])
  with pytest.raises(UserError, match="--methods is empty"):
    compare.parse_methods([" ", ""])
  with pytest.raises(UserError, match="--seeds: -1 is negative"):
    compare.parse_seeds(["-1"])
  with pytest.raises(UserError, match="--seeds is empty"):
    compare.parse_seeds([])


def test_the_comparison_is_a_methods_by_seeds_sweep_with_the_paper_table(repo_root):
  methods = ["vanilla_smoe", "fairsmoe@fair.specialization=class_routing"]
  sweep = compare.comparison_sweep(
      "configs/quickstart.py:steps=2", {"batch_size": 32}, methods, [0, 1]
  )
  assert sweep.module == "fairmoe_jax.main"
  assert sweep.tables == ("paper_runner.fairmoe.paper_table:write_comparison",)
  assert list(sweep.grid.items()) == [("method", methods), ("seed", [0, 1])]
  point = spec.grid_points(sweep)[3]
  assert spec.run_name(point) == "method=fairsmoe@fair.specialization=class_routing,seed=1"
  command = spec.run_command(sweep, point, "/w/r")
  # The config file is absolute: the runs start in the repository root, not here.
  assert command[3] == f"--config={os.path.abspath('configs/quickstart.py')}:steps=2"
  assert command[5:] == [
      "--config.batch_size=32",
      "--config.method=fairsmoe",
      "--config.fair.specialization=class_routing",
      "--config.seed=1",
  ]


def test_a_wrong_method_key_stops_the_comparison_before_anything_runs(tmp_path, capsys):
  workdir = tmp_path / "cmp"
  cases = [
      (
          ["vanilla_smoe", "fairsmoe@fair.nonexistent=1"],
          {},
          "--methods: unknown config key 'fair.nonexistent' in 'fairsmoe@fair.nonexistent=1'",
      ),
      (["fairsmoe@fair.alpha=2"], {}, "fair.alpha"),
      (["vanilla_smoe"], {"seed": 3}, "--config.seed is set per run by --seeds"),
      (["vanilla_smoe", "bogus"], {}, "error: --methods: unknown method(s) bogus"),
  ]
  for methods, overrides, message in cases:
    with pytest.raises(SystemExit) as exit_info:
      compare.run(
          base_config(),
          str(workdir),
          methods,
          ["0"],
          config_file="configs/quickstart.py",
          overrides=overrides,
      )
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # One line.
    assert message in line
    assert not workdir.exists()


@pytest.mark.slow
def test_write_comparison_is_a_table_collector_of_the_sweep_it_finds(runs, tmp_path):
  sweep = _sweep([0, 1, 2])
  write_tables(sweep, str(tmp_path), [])  # The runner's sweep.json, written before collectors.
  paths = paper_table.write_comparison(str(tmp_path), runs)
  assert paths == [str(tmp_path / "comparison.md"), str(tmp_path / "comparison.json")]
  markdown, summary = paper_table.comparison(sweep, runs)
  assert (tmp_path / "comparison.md").read_text() == markdown
  written = json.loads((tmp_path / "comparison.json").read_text())
  assert written == json.loads(json.dumps(summary, default=dataclasses.asdict))
  assert written["record"]["runs"][0]["run_dir"] == "/w/runs/method=fairsmoe,seed=0"
  # A report without the fairness fields gives dashes where they go, not a crash.
  odd = [_run("fairsmoe", 0, report={"accuracy": 0.5}), *runs[1:]]
  markdown, _ = paper_table.comparison(sweep, odd)
  assert "| vanilla_smoe | 60.0 | 0.500 | 0.030 | 2.50 |" in markdown


# Stands in for fairmoe_jax.main in the runs of an in-process comparison: a report the paper
# table can read, whose step is the --config.num_train_steps the run was given.
STUB_MAIN = textwrap.dedent("""
    import json, os, sys

    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    os.makedirs(flags["workdir"], exist_ok=True)
    report = {"accuracy": 0.5, "step": int(flags.get("config.num_train_steps", 0)),
              "mf": {"pqd": 0.9, "dp": 0.1}, "attributes": {"sex": {"pqd": 0.9, "dp": 0.1}}}
    with open(os.path.join(flags["workdir"], "report.json"), "w") as f:
      json.dump(report, f)
    """)


@pytest.mark.slow
def test_a_run_trained_with_another_config_is_stale_then_retrained(tmp_path, monkeypatch, capsys):
  """Finished runs are checked against the whole config they were trained with (config.json)."""
  (tmp_path / "stub_fairmoe_main.py").write_text(STUB_MAIN)
  path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
  monkeypatch.setenv("PYTHONPATH", path)
  monkeypatch.setattr(compare, "MAIN_MODULE", "stub_fairmoe_main")
  workdir = tmp_path / "cmp"
  run = workdir / "runs" / "method=vanilla_smoe,seed=0"
  run.mkdir(parents=True)
  trained = compare.run_config(base_config(), "vanilla_smoe", 0)
  trained.num_train_steps = 2
  (run / "config.json").write_text(trained.to_json_best_effort())
  (run / "report.json").write_text(json.dumps(_report("vanilla_smoe", 0.6, 0.5, 0.03)))
  config = base_config()
  config.num_train_steps = 3
  kwargs = dict(config_file="configs/quickstart.py", overrides={"num_train_steps": 3})
  with pytest.raises(SystemExit) as exit_info:
    compare.run(config, str(workdir), ["vanilla_smoe"], ["0"], **kwargs)
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert "num_train_steps: 2 -> 3" in error and "--retrain" in error
  assert compare.run(config, str(workdir), ["vanilla_smoe"], ["0"], retrain=True, **kwargs) == 0
  assert json.loads((run / "report.json").read_text())["step"] == 3
  assert (run.parent / f"{run.name}.stale-1" / "report.json").is_file()
  assert "| vanilla_smoe | 50.0 | 0.900 | 0.100 | — | — | — | 0.900 | 0.100 | 1 |" in (
      capsys.readouterr().out
  )


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
    "--config.plots=false",
]


def _compare(repo_root, workdir, *args):
  env = dict(os.environ)
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device: faster than conftest's eight.
  return subprocess.run(
      [sys.executable, "-m", "paper_runner.fairmoe.compare", *TINY, f"--workdir={workdir}", *args],
      cwd=repo_root,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.slow
def test_compare_end_to_end_then_resume_without_retraining(repo_root, tmp_path):
  variant = "multifair@multifair.weight=0.5"  # A method with an @ setting, end to end.
  args = [f"--methods=vanilla_smoe,{variant}", "--seeds=0"]
  result = _compare(repo_root, tmp_path, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  markdown = (tmp_path / "comparison.md").read_text()
  summary = json.loads((tmp_path / "comparison.json").read_text())
  assert "| vanilla_smoe | " in markdown and f"| {variant} | " in markdown
  assert markdown in result.stdout
  assert [(r["row"], r["status"]) for r in summary["record"]["runs"]] == [
      ("vanilla_smoe", "ok"),
      (variant, "ok"),
  ]
  runs = tmp_path / "runs"
  for method, name in (("vanilla_smoe", "vanilla_smoe"), ("multifair", variant)):
    assert summary["rows"][name]["seeds"] == [0]
    run = runs / f"method={name},seed=0"
    assert json.loads((run / "report.json").read_text())["method"] == method
    # The runs' own flags give the config that compare built and checked.
    assert json.loads((run / "config.json").read_text())["data"]["train_size"] == 128
  assert (
      json.loads((runs / f"method={variant},seed=0" / "config.json").read_text())["multifair"][
          "weight"
      ]
      == 0.5
  )
  assert (tmp_path / "sweep.md").is_file()  # The runner's generic table, beside the paper's.

  reports = sorted(runs.glob("*/report.json"))
  mtimes = [p.stat().st_mtime_ns for p in reports]
  result = _compare(repo_root, tmp_path, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("skipped (report.json exists)") == 2
  assert [p.stat().st_mtime_ns for p in reports] == mtimes
  assert (tmp_path / "comparison.md").read_text() == markdown

  # Asked for other settings, the finished runs are stale: an error before anything trains.
  result = _compare(repo_root, tmp_path, *args, "--config.num_train_steps=3")
  assert result.returncode == 2
  assert "num_train_steps: 2 -> 3" in result.stderr and "--retrain" in result.stderr
  assert [p.stat().st_mtime_ns for p in reports] == mtimes


@pytest.mark.slow
def test_paired_claims_against_vanilla_smoe_decide_on_same_seed_differences():
  """Five seeds whose accuracies share a large seed effect: FairSMoE is 2 points above vanilla
  SMoE on every seed (holds) while its PQD is the same up to noise (undecided). With both rows
  below the reference readers' accuracy, no claim is decided, the accuracy claim included."""
  shared = [0.0, 0.10, -0.08, 0.05, -0.04]
  noise = [0.01, -0.02, 0.015, -0.005, 0.0]

  def verdicts(accuracy):
    runs = []
    for seed, (s, n) in enumerate(zip(shared, noise)):
      fair = _report("fairsmoe", accuracy + 0.02 + s, 0.8 + n, 0.02)
      runs += [_run("fairsmoe", seed, report=fair)]
      runs += [_run("vanilla_smoe", seed, report=_report("vanilla_smoe", accuracy + s, 0.8, 0.03))]
    markdown, summary = paper_table.comparison(_sweep(list(range(5))), runs)
    claims = {claim.metric: (claim, result) for claim, result in summary["claims"]}
    return markdown, {metric: result.verdict for metric, (_, result) in claims.items()}, claims

  markdown, verdict, claims = verdicts(0.90)
  assert verdict == {"accuracy": "holds", "mf.pqd": "undecided", "mf.dp": "holds"}
  assert all(claim.baseline == "vanilla_smoe" for claim, _ in claims.values())
  np.testing.assert_allclose(claims["accuracy"][1].difference.mean, 0.02)
  assert (
      "| fairsmoe higher than vanilla_smoe | Acc. (%) | +2.0 [2.0, 2.0] | 5 | <0.001 | **holds** |"
      in (markdown)
  )
  _, verdict, _ = verdicts(0.30)  # Both rows below the corner-marker reader's 62.5%.
  assert verdict == {
      "accuracy": "untestable: at reference",
      "mf.pqd": "untestable: at reference",
      "mf.dp": "untestable: at reference",
  }
