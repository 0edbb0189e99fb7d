"""The papers at their scale: a spec's `scale=paper` sweep, its estimate from the recorded
preflight, its SLURM array lines, and --reproduce's tolerances from the recorded spread."""

import importlib.util
import json
import math
import os
import shlex

import pytest

from paper_runner import paper_scale, table_reproduce, table_spec
from paper_runner.commands import write_commands
from paper_runner.spec import REPO_ROOT, grid_points, load_sweep, run_settings
from paper_runner.table_parts import FAIR_COMPARISON
from trainkit.errors import UserError
from trainkit.preflight.calibration import CALIBRATION

with open(os.path.join(REPO_ROOT, paper_scale.PREFLIGHT)) as f:
  CELLS = json.load(f)["cells"]
TABLE_1_AND_2 = os.path.join("results", "fair_cv_celeba.py")


def _hours(name, target):
  """A cell's device-hours re-priced from the utilisation it was compiled at to today's, the
  collectives' time kept."""
  cell = CELLS[f"{name}@{target}"]
  collectives = cell["step_s"] - cell["roofline_s"] / cell["utilization"]
  step = cell["roofline_s"] / CALIBRATION["gpu"].utilization + collectives
  return cell["device_hours"] * step / cell["step_s"]


def test_the_paper_scale_estimate_sums_the_recorded_preflight_cells_and_the_equal_budgets():
  for target in ("h100x1", "h100x8"):
    h = {
        m: _hours(f"{m}/deit_s", target)
        for m in ("fairsmoe", "vanilla_smoe", "muffin", "multifair")
    }
    # 7 rows x 5 seeds: FairSMoE and its two ablations, vanilla SMoE with and without L_Psi.
    table = 5 * (3 * h["fairsmoe"] + 2 * h["vanilla_smoe"] + h["muffin"] + h["multifair"])
    search = 12 * (h["fairsmoe"] + h["vanilla_smoe"] + h["muffin"] + h["multifair"])
    lines = paper_scale.paper_estimate(TABLE_1_AND_2, "method", "paper", target, CELLS)
    assert f"the table: 35 runs, {table:,.0f} device-hours" in lines[1]
    assert f"48 runs, {search:,.0f} device-hours" in lines[2]
    assert f"total: 83 runs, {table + search:,.0f} device-hours" in lines[3]
  # The README's and docs/reproducing.md's figures: 379, 967 and 1,202 H100-hours.
  assert "total: 83 runs, 1,202 device-hours" in lines[3]
  # The range: the roofline bound at the band's utilisations (no collectives on one GPU).
  mnli = os.path.join("results", "mnli_hans.py")
  lines = paper_scale.paper_estimate(mnli, "model.attention", "paper", "h100x1", CELLS)
  cell = CELLS["causal/mnli@h100x1"]
  # One GPU, no collectives: the hours scale as the utilisation compiled at over today's.
  estimate, fast, slow = (
      10 * cell["device_hours"] * cell["utilization"] / u for u in (0.36, 0.59, 0.30)
  )
  assert (
      f"the table: 10 runs, {estimate:,.0f} device-hours ({fast:,.0f}-{slow:,.0f} over" in lines[1]
  )
  assert "the table: 10 runs, 207 device-hours" in lines[1]
  assert "total: 34 runs, 705 device-hours" in lines[3]
  with pytest.raises(UserError, match="no preflight cell causal/mnli@h200x1"):
    paper_scale.paper_estimate(mnli, "model.attention", "paper", "h200x1", CELLS)
  with pytest.raises(UserError, match="spurious_pairs.py takes no argument"):
    paper_scale.paper_estimate("results/spurious_pairs.py", "model.attention", "paper", "h100x1")
  with pytest.raises(UserError, match="--scale=small: the preflight compiled the paper's runs"):
    paper_scale.paper_estimate(mnli, "model.attention", "small", "h100x1", CELLS)


def test_a_paper_scale_spec_writes_an_array_of_the_paper_s_runs(tmp_path):
  path = os.path.join(REPO_ROOT, TABLE_1_AND_2)
  small, sweep = load_sweep(path), load_sweep(f"{path}:scale=paper,data=/datasets")
  with open(write_commands(sweep, str(tmp_path))) as f:
    lines = f.read().splitlines()
  runs = lines[lines.index(next(l for l in lines if l.startswith("cd "))) + 1 :]
  assert len(runs) == len(grid_points(sweep)) == 35 and len(grid_points(small)) == 35
  words = [shlex.split(line) for line in runs]
  assert all(w[:3] == ["python", "-m", "fairmoe_jax.main"] for w in words)
  # The paper's config (full size, 500 epochs, official split), its data, five seeds, no folds.
  assert all(
      "--config=configs/celeba.py" in w and "--config.data.root=/datasets/celeba" in w
      for w in words
  )
  assert not any("identity_folds" in line or "../shared" in line for line in runs)
  assert {(w[-2], w[-1]) for w in words} == {
      (f"--config.seed={s}", f"--config.method={m}") for s in range(5) for m in FAIR_COMPARISON
  }
  with pytest.raises(UserError, match="scale"):
    load_sweep(f"{path}:scale=huge")


def test_reproduce_judges_each_value_by_its_own_recorded_spread():
  values = [0.50, 0.54, 0.46, 0.52, 0.48]  # s.d. 0.0316
  runs = [
      {"metrics": {"acc": v, "keys": 10.0 + i, "flat": 1.0}, "examples": 400}
      for i, v in enumerate(values)
  ]
  limits = table_reproduce.tolerances(runs[0], runs)
  z = 2.3940  # Normal quantile at 1 - 0.05 / (2 x 3 values).
  assert limits["acc"][0] == pytest.approx(z * math.sqrt(2) * 0.0316228, rel=1e-4)
  assert limits["keys"][0] == pytest.approx(z * math.sqrt(2) * 1.5811388, rel=1e-4)
  assert limits["flat"] == (0.0, "5 seeds' s.d.")  # Every seed alike: exact.
  recorded = runs[0]["metrics"]
  within = {"acc": 0.50 + 0.10, "keys": 10.0 - 5.0, "flat": 1.0}
  ok, lines, _ = table_reproduce.compare(recorded, within, limits)
  assert ok and "0.107 (5 seeds' s.d.)" in lines[1]
  beyond = dict(within, acc=0.50 + 0.11)
  assert not table_reproduce.compare(recorded, beyond, limits)[0]
  # One seed: the binomial error of the run's n examples.
  (acc, why), _, _ = table_reproduce.tolerances(runs[0], runs[:1]).values()
  assert why == "binomial, n=400" and acc == pytest.approx(z * math.sqrt(2 * 0.25 / 400), rel=1e-4)


def test_a_spec_without_a_paper_scale_refuses_one_instead_of_running_its_small_sweep():
  # The testbed tables have no paper scale; `del arg` once made them run the CPU sample's sweep.
  for name in ("fair_comparison_testbed", "spurious_tuning_gcn"):
    with pytest.raises(UserError, match=f"{name}.py takes no argument: ':scale=paper'"):
      load_sweep(f"results/{name}.py:scale=paper")
  assert load_sweep("results/fair_comparison_testbed.py").grid  # Without one, as before.


def test_every_method_with_a_loss_weight_gets_fairsmoe_s_search_as_a_table_of_its_own():
  from paper_runner import table_spec  # pylint: disable=g-import-not-at-top

  methods, runs = paper_scale.PAPER_SEARCH["fairmoe_jax.main"]
  fairsmoe = table_spec.load_table("lambda_tuning:scale=paper,data=/d")
  assert fairsmoe.name == "lambda_tuning_paper"
  for method in methods:
    spec = table_spec.load_table(f"lambda_tuning:method={method},scale=paper,data=/d")
    points = grid_points(spec.sweep)
    assert len(points) == runs and len(spec.row_values) == len(fairsmoe.row_values)
    assert spec.name == f"lambda_tuning_{method}_paper"  # Its record's name: each value given.
    settings = [run_settings(spec.sweep, p) for p in points]
    assert {s.get("method", "fairsmoe") for s in settings} == {method}
    # Four distinct settings of the method's own weights, each on three paired seeds.
    weights = "multifair." if method == "multifair" else "fair.lambda_"
    tried = {tuple(sorted((k, v) for k, v in s.items() if k.startswith(weights))) for s in settings}
    assert len(tried) == 4 and all(len(t) == 2 for t in tried), tried
    assert spec.select == "validation.mf.pqd" and spec.split == "validation"
  assert table_spec.load_table("lambda_tuning:method=muffin").name == "lambda_tuning_muffin"
  # The CPU table as recorded: FairSMoE by the config's default, no method override.
  recorded = table_spec.load_table("lambda_tuning").sweep
  assert "method" not in recorded.overrides and "method" not in recorded.grid
  with pytest.raises(UserError, match="config key 'method': 'dense': one of fairsmoe"):
    table_spec.load_table("lambda_tuning:method=dense")


@pytest.mark.parametrize("scale", ["small", "paper"])
@pytest.mark.parametrize("task", ["mnli", "wmt14"])
def test_both_attentions_search_on_validation_from_their_config_s_own_setting(task, scale):
  from paper_runner import table_spec  # pylint: disable=g-import-not-at-top

  _, runs = paper_scale.PAPER_SEARCH["causal_attn_jax.main"]
  file = {"mnli": "mnli_hans.py", "wmt14": "wmt14_ende.py"}[task]
  module = importlib.util.module_from_spec(
      importlib.util.spec_from_file_location(task, os.path.join(REPO_ROOT, "configs", file))
  )
  module.__spec__.loader.exec_module(module)
  config = module.get_config("size=small" if scale == "small" else None)
  schedule = ("constraints.step_size", "constraints.dual_start_step", "constraints.dual_ramp_steps")
  for attention, keys in (("causal", schedule), ("vanilla", ("optimizer.learning_rate",))):
    arg = f"task={task},attention={attention},scale={scale},data=/d"
    spec = table_spec.load_table(f"attention_tuning:{arg}")
    points = grid_points(spec.sweep)
    assert len(points) == runs and spec.split == "validation"
    settings = [run_settings(spec.sweep, p) for p in points]
    assert {s["model.attention"] for s in settings} == {attention}
    # The first row is what the config trains with; the other three differ from it.
    tried = [tuple(float(s[k]) for k in keys) for s in settings]
    assert tried[0] == tuple(float(config[k]) for k in keys), (tried[0], attention)
    assert len(set(tried)) == 4
    # Chosen on a split the claim tables do not report: never HANS, never newstest2014.
    evaluated = " ".join(str(v) for k, v in settings[0].items() if k.startswith("data.eval"))
    assert "newstest2014" not in evaluated and spec.select in ("accuracy", "bleu")
    if scale == "paper" and task == "wmt14":
      assert settings[0]["data.eval_source"] == "/d/wmt14/newstest2013.en"
  with pytest.raises(UserError, match="config key 'attention': 'band': one of causal"):
    table_spec.load_table("attention_tuning:attention=band")


@pytest.mark.parametrize(
    "name", ["fair_cv_celeba", "fair_comparison_celeba", "mnli_hans", "ende_small"]
)
def test_a_paper_scale_table_loads_without_the_sample_s_folds_choices_and_leaks(name):
  from paper_runner import table_spec  # pylint: disable=g-import-not-at-top

  small, paper = table_spec.load_table(name), table_spec.load_table(f"{name}:scale=paper,data=/d")
  assert paper.name == f"{name}_paper" and paper.cross_validation is None
  assert not paper.selection_leaks and {t.settings for t in paper.tuning} == {0}
  assert paper.title.endswith("at paper scale") and paper.claims == small.claims
  # Five paired seeds per row, on the paper's data under the root given.
  assert len(grid_points(paper.sweep)) == 5 * len(paper.row_values)
  assert any(str(v).startswith("/d/") for v in paper.sweep.overrides.values())
  if name == "ende_small":  # newstest2014 is Table 2's test set; the raw corpus has no escapes.
    assert paper.split == "test" and paper.sweep.overrides["data.unescape"] is False
    assert small.split == "validation" and small.sweep.overrides["data.unescape"] is True


def _search_record(records, name, spec, best):
  """A paper-scale record of FairSMoE's lambda search (the CPU record's runs), `best` highest on
  validation MF-PQD at equal accuracy."""
  with open(os.path.join(REPO_ROOT, "results", "records", "lambda_tuning.json")) as f:
    record = json.load(f)
  for run in record["runs"]:
    run["metrics"].update({"validation.mf.pqd": 0.9 if run["row"] == best else 0.5})
    run["metrics"]["validation.accuracy"] = 0.8
  (records / f"{name}.json").write_text(json.dumps(dict(record, spec=spec)))


def test_a_comparison_at_paper_scale_trains_each_rows_recorded_search_choice(tmp_path, monkeypatch):
  records = tmp_path / "records"
  records.mkdir()
  monkeypatch.setattr(table_spec, "RECORDS_DIR", str(records))
  data = "scale=paper,data=/data"
  untuned = load_sweep(f"{TABLE_1_AND_2}:{data}")
  _search_record(
      records,
      "lambda_tuning_muffin_paper",
      f"results/lambda_tuning.py:method=muffin,{data}",
      "0.1@fair.lambda_dp=0.5",
  )
  # FairSMoE's search recorded without a method (its default): its readings and ablations too.
  _search_record(
      records, "lambda_tuning_paper", f"results/lambda_tuning.py:{data}", "0.5@fair.lambda_dp=0.5"
  )
  sweep = load_sweep(f"{TABLE_1_AND_2}:{data}")
  assert grid_points(sweep) == grid_points(untuned)  # The rows keep their names and runs.
  lambdas = {}
  for point in grid_points(sweep):
    settings = run_settings(sweep, point)
    assert settings == {**run_settings(untuned, point), **settings}  # Only added keys.
    lambdas[point["method"]] = (settings.get("fair.lambda_pqd"), settings.get("fair.lambda_dp"))
  assert lambdas["muffin"] == ("0.1", "0.5")
  for method in ("fairsmoe", "fairsmoe_no_fgr", "fairsmoe_no_fem"):
    assert lambdas[method] == ("0.5", "0.5")
  for method in ("vanilla_smoe_psi", "vanilla_smoe", "multifair"):  # No search recorded, or none.
    assert lambdas[method] == (None, None)
  tuning = {t.row: t for t in table_spec.load_table(f"fair_cv_celeba:{data}").tuning}
  assert (
      tuning["muffin"].settings == 4 and "lambda_tuning_muffin_paper.json" in tuning["muffin"].what
  )
  assert "fair.lambda_pqd=0.1@fair.lambda_dp=0.5" in tuning["muffin"].what
  assert tuning["multifair"] == table_spec.Tuning("multifair", 0, "the paper's settings")
  # The search itself trains its own grid, not its recorded choice.
  search = load_sweep(f"results/lambda_tuning.py:method=muffin,{data}")
  assert not search.row_settings


def test_the_causal_comparison_takes_each_attentions_recorded_search_choice(tmp_path, monkeypatch):
  records = tmp_path / "records"
  records.mkdir()
  monkeypatch.setattr(table_spec, "RECORDS_DIR", str(records))
  data, name = "scale=paper,data=/data", "attention_tuning_vanilla_mnli_paper"
  search = table_spec.load_table(f"attention_tuning:task=mnli,attention=vanilla,{data}")
  assert search.name == name
  with open(os.path.join(REPO_ROOT, "results", "records", "mnli_hans.json")) as f:
    record = json.load(f)  # A recorded table's provenance; the runs are the search's.
  best = search.row_values[2]
  record["runs"] = [
      {"row": row, "seed": seed, "status": "ok", "settings": {}, "examples": 100, "groups": {}}
      | {"metrics": {search.select: 0.7 if row == best else 0.6}}
      for row in search.row_values
      for seed in (0, 1, 2)
  ]
  (records / f"{name}.json").write_text(json.dumps(dict(record, spec=search.path, references=[])))
  sweep = load_sweep(f"results/mnli_hans.py:{data}")
  rates = {
      p["model.attention"]: run_settings(sweep, p).get("optimizer.learning_rate")
      for p in grid_points(sweep)
  }
  assert rates == {"causal": None, "vanilla@constraints.weight=0.0": best.split("@")[0]}
