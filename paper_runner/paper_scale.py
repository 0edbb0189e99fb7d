"""The papers at their scale: a results spec's `results/NAME.py:scale=paper,data=ROOT` sweep
(`at_scale`) and its cost, priced from the preflight's compiled cells before anything runs
(`paper_estimate`; docs/reproducing.md)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import ml_collections

from paper_runner.spec import REPO_ROOT, dotted, grid_points, load_sweep, split_value
from trainkit.config import parse_arg
from trainkit.errors import ConfigError, UserError
from trainkit.preflight.calibration import CALIBRATION
from trainkit.preflight.targets import TARGETS

# A spec's `results/NAME.py:scale=small|paper,data=ROOT` (docs/reproducing.md): at the paper's
# scale, each config file's paper data, under ROOT, in place of the sample's.
SCALE = dict(scale="small", data="/data")
MNLI = "multinli_1.0/multinli_1.0_"
SIDES = (("source", "en"), ("target", "de"))
PAPER_DATA = {
    "configs/celeba.py": {"data.root": "celeba"},
    "configs/mnli_hans.py": {
        "data.train_file": f"{MNLI}train.jsonl",
        "data.eval_file": f"{MNLI}dev_matched.jsonl",
        "data.challenge_file": "hans/heuristics_evaluation_set.txt",
        "model.glove_path": "glove.840B.300d.txt",
    },
    # Table 2: WMT14 En-De as the config's docstring reads it, scored on newstest2014.
    "configs/wmt14_ende.py": {
        **{f"data.train_{side}": f"wmt14/train.{lang}" for side, lang in SIDES},
        **{f"data.eval_{side}": f"wmt14/newstest2014.{lang}" for side, lang in SIDES},
        "data.unescape": False,  # The sample's Moses escapes: not the raw corpus's.
    },
}


def at_scale(
    arg: Any, sweep: dict, paper_data: Mapping[str, Any] | None = None, tuned: str = ""
) -> dict:
  """`sweep`, the CPU sample's (`scale=small`, the default), or with `scale=paper` the paper's:
  its config file's defaults (full size: the paper's model, epochs, lambdas and official split)
  for all but the spec's `data.*` choices, PAPER_DATA updated with `paper_data` (under ROOT too),
  and five seeds in place of identity folds (`arg`: the spec's argument, or parsed with SCALE's
  keys). A comparison names its rows key as `tuned`: each row whose equal tuning budget is
  recorded at the paper's scale trains with that search's choice (`tuned_choice`)."""
  arg = arg if hasattr(arg, "scale") else parse_arg(arg, **SCALE)
  config = sweep["config"].partition(":")[0]
  if arg.scale == "small":
    return sweep
  if arg.scale != "paper" or config not in PAPER_DATA:
    raise ConfigError("scale", f"{arg.scale!r}: small, or paper for {', '.join(PAPER_DATA)}")
  grid = {k: v for k, v in sweep["grid"].items() if not k.startswith("data.identity_folds")}
  overrides = {k: v for k, v in sweep.get("overrides", {}).items() if k.startswith("data.")}
  overrides = {k: v for k, v in overrides.items() if not str(v).startswith("../shared/")}
  root = lambda v: os.path.join(arg.data, v) if isinstance(v, str) else v  # noqa: E731
  overrides.update({k: root(v) for k, v in {**PAPER_DATA[config], **(paper_data or {})}.items()})
  seeds = {"seed": (0, 1, 2, 3, 4)} if len(grid) < len(sweep["grid"]) else {}
  choices = ((v, tuned_choice(sweep["module"], config, v)) for v in grid.get(tuned, ()))
  row_settings = tuple((tuned, v, *choice) for v, choice in choices if choice)
  grid, overrides = dotted({**grid, **seeds}), dotted(overrides)
  return dict(sweep, config=config, grid=grid, overrides=overrides, row_settings=row_settings)


def tuned_choice(module: str, config: str, row: str) -> tuple[str, int, str] | None:
  """(the chosen `KEY=X@...`, settings searched, record) of the paper-scale search that tunes
  `row` (PAPER_SEARCH; FairSMoE's readings and ablations take FairSMoE's lambdas), or None where
  none is recorded: the row then trains the paper's settings, the search's first row."""
  from paper_runner import table_record, table_spec, table_summary  # They load specs: not above.

  searched = PAPER_SEARCH.get(module, ((), 0))[0]
  row = row if row in searched or not row.startswith("fairsmoe") else "fairsmoe"
  if row not in searched:
    return None
  if module == "fairmoe_jax.main":  # The default method's record has no method in its name.
    names = [f"lambda_tuning_{row}_paper"] + ["lambda_tuning_paper"] * (row == "fairsmoe")
  else:  # results/attention_tuning.py's task and attention.
    task = {"configs/mnli_hans.py": "mnli", "configs/wmt14_ende.py": "wmt14"}.get(config)
    names = [f"attention_tuning_{row.split('@')[0]}_{task}_paper"]
  for name in (n for n in names if os.path.isfile(table_spec.record_path(n))):
    spec = table_spec.load_table(name)
    summary = table_summary.summarise(spec, table_record.read_record(name))
    value, extra = split_value(table_summary.chosen_row(spec, summary) or "")
    if value:  # Else no run of the search finished.
      settings = "@".join(f"{k}={v}" for k, v in {spec.rows: value, **extra}.items())
      return settings, len(spec.row_values), name
  return None


# Equal tuning budgets at the paper's scale (docs/reproducing.md): per main, the rows with a
# setting to choose on validation and the runs each one's search takes (4 settings x 3 seeds):
# results/lambda_tuning.py:method=M for FairSMoE and every method with a loss weight,
# results/attention_tuning.py:task=T,attention=A for both attentions on MNLI and WMT14.
PAPER_SEARCH = {
    "fairmoe_jax.main": (("fairsmoe", "vanilla_smoe_psi", "muffin", "multifair"), 12),
    "causal_attn_jax.main": (("causal", "vanilla@constraints.weight=0.0"), 12),
}
# paper_runner/preflight_table.py's record, and its run of a Causal Transformer config (a
# FairSMoE run's: its method and backbone).
PREFLIGHT = os.path.join("results", "records", "preflight_paper.json")
CAUSAL_CELLS = {"configs/mnli_hans.py": "causal/mnli", "configs/wmt14_ende.py": "causal/wmt14_base"}


def _cell(sweep: ml_collections.ConfigDict, point: Mapping, target: str, cells: Mapping) -> str:
  """The preflight cell that prices `point`'s run: a FairSMoE ablation or `+ L_Psi` as the
  method it changes (the same backbone and MoE block), on the config's backbone."""
  path, _, args = sweep.config.partition(":")
  if sweep.module != "fairmoe_jax.main":
    return f"{CAUSAL_CELLS.get(path, path)}@{target}"
  method = str(point.get("method", "fairsmoe"))
  family = max((c.split("/")[0] for c in cells if method.startswith(c.split("/")[0])), key=len)
  backbone = dict(a.split("=", 1) for a in args.split(",") if a).get("backbone", "deit_s")
  return f"{family}/{backbone}@{target}"


def paper_estimate(
    path: str, rows: str, scale: str | None, target: str | None, cells: Mapping | None = None
) -> list[str]:
  """The device-hours of the runs of the spec at `path` (rows keyed by `rows`) at `scale`, only
  paper, and of its rows' equal tuning budgets (PAPER_SEARCH) on `target`, from the preflight's
  cells: the estimate at the calibrated utilisation, and the range over the calibration's band."""
  if scale != "paper":
    raise UserError(f"--scale={scale}: the preflight compiled the paper's runs; give --scale=paper")
  sweep = load_sweep(f"{os.path.join(REPO_ROOT, path)}:scale=paper")
  if sweep.config not in PAPER_DATA:  # A spec whose options include no scale.
    raise UserError(f"{path} has no paper scale (its config: {sweep.config})")
  if cells is None:
    with open(os.path.join(REPO_ROOT, PREFLIGHT)) as f:
      cells = json.load(f)["cells"]
  if (target or "").split(",")[0] not in TARGETS:
    raise UserError(f"--target={target}: not a preflight target; known: {', '.join(TARGETS)}")
  from trainkit.preflight.compile import band_seconds  # pylint: disable=import-outside-toplevel

  platform = TARGETS[target.split(",")[0]].platform
  low_u, high_u = CALIBRATION[platform].band

  def hours(point: Mapping[str, Any]) -> tuple[float, float, float]:
    name = _cell(sweep, point, target, cells)
    if name not in cells:
      command = f"python -m paper_runner.preflight_table --compile --only={name}"
      raise UserError(f"no preflight cell {name} in {PREFLIGHT}: compile it with `{command}`")
    cell = cells[name]
    # The step is the roofline bound at the utilisation, plus the collectives' time; re-priced
    # at today's calibration (a cell keeps the utilisation it was compiled at).
    collectives = cell["step_s"] - cell["roofline_s"] / cell["utilization"]
    band = band_seconds(cell["roofline_s"], collectives, [low_u, high_u])
    steps = (cell["roofline_s"] / CALIBRATION[platform].utilization + collectives, *band)
    return tuple(cell["device_hours"] * s / cell["step_s"] for s in steps)

  points = grid_points(sweep)
  searched, runs = PAPER_SEARCH.get(sweep.module, ((), 0))
  first: dict[str, Mapping[str, Any]] = {}
  for point in (p for p in points if str(p[rows]) in searched):
    first.setdefault(str(point[rows]), point)
  parts = [("the table", len(points), [hours(p) for p in points])]
  if first:
    search = [h for p in first.values() for h in [hours(p)] * runs]
    parts.append((f"equal tuning ({runs} runs each: {', '.join(first)})", len(search), search))
  parts.append(("total", sum(n for _, n, _ in parts), [h for _, _, hs in parts for h in hs]))
  lines = [f"{path} at scale=paper on {target}, priced from {PREFLIGHT}:"]
  for what, count, found in parts:
    estimate, fast, slow = (sum(h[i] for h in found) for i in range(3))
    lines.append(
        f"  {what}: {count} runs, {estimate:,.0f} device-hours ({fast:,.0f}-{slow:,.0f} over "
        f"the {platform} calibration band {low_u:.2f}-{high_u:.2f})"
    )
  return lines
