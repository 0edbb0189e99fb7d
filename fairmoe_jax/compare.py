r"""Command line: train several methods over several seeds, then tabulate them as the paper does.

  python -m fairmoe_jax.compare --config=configs/quickstart.py \
      --methods=fairsmoe,vanilla_smoe,muffin,multifair --seeds=0,1,2 --workdir=/tmp/compare

A method may carry config overrides, `METHOD@KEY=VALUE[@KEY=VALUE...]`, so readings of the
same method compare side by side, e.g.
`--methods=fairsmoe@fair.specialization=class_routing,fairsmoe@fair.route_by=label`.

Every (method, seed) trains in `<workdir>/<method>/seed<k>/` with `fairmoe_jax.main`'s
recipe. A run that finished with the same config (its config.json) is not trained again (one
trained with another config is an error, or with --retrain is moved aside and retrained), and
an interrupted run
resumes from its checkpoint, so rerunning the same command resumes the comparison. A run
that raises is recorded (its message in `error.txt`, retried on the next invocation) and
the others go on. The result, `<workdir>/comparison.md` and `comparison.json`, has one row
per method with mean ± sample std over the seeds that succeeded: Acc. (%), MF-PQD and
MF-DP (x 1e-3, as the paper's Tables 1-2 print it), the effective number of experts the MoE
block uses (exp of the entropy of its test-set choices, paper Fig. 5) and the mean gradient
cosine between attribute tasks (Fig. 6), then each attribute's PQD and DP.
The exit status is 1 when any run has no result (the tables are still written).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import traceback
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import train
from fairmoe_jax.methods import METHODS
from trainkit import cli
from trainkit import config as cfg
from trainkit.errors import ConfigError, UserError, exit_on_user_error
from trainkit.workdir import (
    move_aside,
    prepare_workdir,
    stale_runs_error,
    trained_config_differences,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally `file.py:key=value,...`; shared by every run."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory of the comparison: one sub-directory per method and seed."
)
_METHODS = flags.DEFINE_list(
    "methods",
    "fairsmoe,vanilla_smoe,muffin,multifair",
    f"Comma-separated methods to compare, from: {', '.join(METHODS)}; each may add config "
    "overrides as METHOD@KEY=VALUE@KEY=VALUE.",
)
_SEEDS = flags.DEFINE_list("seeds", "0,1,2", "Comma-separated seeds (non-negative integers).")
_RETRAIN = flags.DEFINE_bool(
    "retrain",
    False,
    "Move finished runs trained with another config aside (<run>.stale-<n>) and train them "
    "again; without it such runs are an error.",
)
flags.mark_flags_as_required(["config", "workdir"])

REPORT = "report.json"
ERROR = "error.txt"
# Display scale of the markdown table: accuracy in %, MF-DP in units of 1e-3 (the paper's).
TABLE_SCALE = {"accuracy": 100.0, "mf_pqd": 1.0, "mf_dp": 1e3}
TABLE_SCALE.update(experts_active=1.0, gradient_cosine=1.0)
_COLUMNS = (
    ("accuracy", "Acc. (%)", 2),
    ("mf_pqd", "MF-PQD", 4),
    ("mf_dp", "MF-DP (×10⁻³)", 2),
    ("experts_active", "Experts active", 2),
    ("gradient_cosine", "Grad. cos", 3),
)


def run_dir(workdir: str, method: str, seed: int) -> str:
  return os.path.join(workdir, method, f"seed{seed}")


def parse_methods(names: Sequence[str]) -> list[str]:
  """Validated, de-duplicated `--methods` (order kept, so the table follows the command)."""
  names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
  if not names:
    raise UserError(f"--methods is empty; choose from {', '.join(METHODS)}")
  unknown = [n for n in names if split_method(n)[0] not in METHODS]
  if unknown:
    raise UserError(
        f"--methods: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}"
    )
  return names


def parse_seeds(values: Sequence[str]) -> list[int]:
  """Validated, de-duplicated `--seeds` as integers."""
  seeds = []
  for value in values:
    value = value.strip()
    if not value:
      continue
    try:
      seed = int(value)
    except ValueError:
      raise UserError(f"--seeds: {value!r} is not an integer") from None
    if seed < 0:
      raise UserError(f"--seeds: {seed} is negative")
    seeds.append(seed)
  if not seeds:
    raise UserError("--seeds is empty")
  return list(dict.fromkeys(seeds))


def split_method(entry: str) -> tuple[str, dict[str, str]]:
  """`METHOD@KEY=VALUE@...` -> (METHOD, {KEY: VALUE})."""
  name, *overrides = entry.split("@")
  pairs = {}
  for override in overrides:
    key, sep, value = override.partition("=")
    if not sep or not key:
      raise UserError(f"--methods: {override!r} in {entry!r} is not KEY=VALUE")
    pairs[key.strip()] = value.strip()
  return name.strip(), pairs


def _override(config: ml_collections.ConfigDict, key: str, text: str, entry: str) -> None:
  """Sets `key` from `text`, parsed to the type the key already has."""
  try:
    current = cfg.get(config, key)
  except ConfigError:
    raise UserError(f"--methods: unknown config key {key!r} in {entry!r}") from None
  try:
    value = cfg.convert(key, text, current)
  except ConfigError as e:
    raise UserError(f"--methods: {e} (in {entry!r})") from None
  parent, _, leaf = key.rpartition(".")
  (cfg.get(config, parent) if parent else config)[leaf] = value


def run_config(
    config: ml_collections.ConfigDict, method: str, seed: int
) -> ml_collections.ConfigDict:
  """A copy of the shared config for one run, validated (its error names the method and seed)."""
  config = copy.deepcopy(config)
  name, overrides = split_method(method)
  config.method = name
  config.seed = seed
  for key, text in overrides.items():
    _override(config, key, text, method)
  try:
    fairmoe_config.validate(
        config, num_devices=jax.device_count(), num_processes=jax.process_count()
    )
  except UserError as e:
    raise UserError(f"{e} (in the run of method {method}, seed {seed})") from None
  return config


def run_one(config: ml_collections.ConfigDict, directory: str, *, retrain: bool = False) -> str:
  """Trains one run unless it finished with this config; returns "done", "cached", "failed" or
  "stopped".

  A finished run trained with another config (config.json) is an error, or with `retrain` is
  moved aside and trained again. Any exception from training is written to
  `directory/error.txt` (message first, then the traceback) rather than raised, so one method's
  crash does not cost the others.
  """
  directory = prepare_workdir(directory)
  report_path = os.path.join(directory, REPORT)
  error_path = os.path.join(directory, ERROR)
  if os.path.exists(report_path):
    differences = trained_config_differences(directory, config)
    if not differences:
      return "cached"
    if not retrain:
      raise stale_runs_error([(directory, differences)], "--retrain")
    print(f"  moved the stale run to {move_aside(directory)}", flush=True)
    directory = prepare_workdir(directory)
  try:
    report = train.train_and_evaluate(config, directory)
  except Exception as e:  # noqa: BLE001 - any failure of one run is recorded, not fatal.
    with open(error_path, "w") as f:
      f.write(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
    return "failed"
  if report is None:  # SIGTERM or Ctrl-C: the run checkpointed; the comparison stops too.
    return "stopped"
  if os.path.exists(error_path):  # A retry that succeeded: the old error no longer applies.
    os.remove(error_path)
  return "done"


def _seed_of(directory: str) -> int | None:
  """The run's seed, from the config.json training wrote, else from the `seed<k>` name."""
  try:
    with open(os.path.join(directory, "config.json")) as f:
      return int(json.load(f)["seed"])
  except (OSError, ValueError, KeyError, TypeError):
    match = re.fullmatch(r"seed(\d+)", os.path.basename(os.path.normpath(directory)))
    return int(match.group(1)) if match else None


def _read_run(directory: str) -> dict[str, Any]:
  """One run's entry of the summary: its metrics when it succeeded, else why not."""
  entry: dict[str, Any] = {"run_dir": directory, "seed": _seed_of(directory)}
  report_path = os.path.join(directory, REPORT)
  if os.path.exists(report_path):
    try:
      with open(report_path) as f:
        report = json.load(f)
      entry.update(
          status="ok",
          step=report.get("step"),
          accuracy=float(report["accuracy"]),
          mf={k: float(v) for k, v in report["mf"].items()},
          attributes={
              name: {k: float(a[k]) for k in ("pqd", "dp", "eopp", "eodds") if k in a}
              for name, a in report["attributes"].items()
          },
      )
      entry["mf_pqd"], entry["mf_dp"] = entry["mf"]["pqd"], entry["mf"]["dp"]
      active = report.get("experts_active", {}).get("choices", {})
      if active:
        entry["experts_active"] = float(np.mean(list(active.values())))
      # {"a|b": [cosine per validation batch]} for every pair of attributes.
      cosines = [v for values in report.get("gradient_cosine", {}).values() for v in values]
      if cosines:
        entry["gradient_cosine"] = float(np.mean(cosines))
      return entry
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      return {**entry, "status": "failed", "error": f"unreadable {report_path}: {e}"}
  error_path = os.path.join(directory, ERROR)
  if os.path.exists(error_path):
    with open(error_path) as f:
      message = f.read().split("\n\n", 1)[0].strip()
    return {**entry, "status": "failed", "error": message or "failed"}
  return {**entry, "status": "missing", "error": "no report.json (not run, or interrupted)"}


def _stats(values: Sequence[float]) -> dict[str, Any]:
  """Mean and sample std (ddof=1; None for fewer than two values) of `values`."""
  values = [float(v) for v in values]
  if not values:
    return {"mean": None, "std": None, "values": []}
  std = float(np.std(values, ddof=1)) if len(values) > 1 else None
  return {"mean": float(np.mean(values)), "std": std, "values": values}


def summarise(run_dirs_by_method: dict[str, list[str]]) -> dict[str, Any]:
  """Reads each run's report.json (or error.txt) and aggregates per method over seeds.

  Returns {"methods": {METHOD: {"num_seeds", "accuracy", "mf_pqd", "mf_dp",
  "pqd": {ATTR: stats}, "runs": [per-run entry]}}, "attributes": [ATTR, ...],
  "failed": [{"method", "seed", "run_dir", "status", "error"}], "table_scale": {...}}, where
  stats is {"mean", "std", "values"} in raw units (accuracy a fraction, DP a rate); only
  runs with a report count. Pure: reads files, writes nothing.
  """
  methods: dict[str, Any] = {}
  attributes: list[str] = []
  failed: list[dict[str, Any]] = []
  for method, directories in run_dirs_by_method.items():
    runs = [_read_run(d) for d in directories]
    ok = [r for r in runs if r["status"] == "ok"]
    for r in runs:
      if r["status"] != "ok":
        failed.append(
            {"method": method, **{k: r[k] for k in ("seed", "run_dir", "status", "error")}}
        )
    method_attributes = list(dict.fromkeys(a for r in ok for a in r["attributes"]))
    attributes += [a for a in method_attributes if a not in attributes]
    methods[method] = {
        "num_seeds": len(ok),
        "seeds": [r["seed"] for r in ok],
        **{
            key: _stats([r[key] for r in ok if key in r])
            for key in ("accuracy", "mf_pqd", "mf_dp", "experts_active", "gradient_cosine")
        },
        **{
            metric: {
                a: _stats(
                    [r["attributes"][a][metric] for r in ok if metric in r["attributes"].get(a, {})]
                )
                for a in method_attributes
            }
            for metric in ("pqd", "dp")
        },
        "runs": runs,
    }
  return {
      "methods": methods,
      "attributes": attributes,
      "failed": failed,
      "table_scale": TABLE_SCALE,
  }


def _cell(stats: dict[str, Any] | None, scale: float, decimals: int) -> str:
  if not stats or stats["mean"] is None:
    return "—"
  text = f"{scale * stats['mean']:.{decimals}f}"
  if stats["std"] is not None:
    text += f" ± {scale * stats['std']:.{decimals}f}"
  return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
  return lines + ["| " + " | ".join(row) + " |" for row in rows]


def format_markdown(summary: dict[str, Any]) -> str:
  """The summary as markdown: the main table, per-attribute PQD, then runs that did not finish."""
  methods = summary["methods"]
  lines = [
      "# Method comparison",
      "",
      "Mean ± sample std (ddof=1) over the seeds that succeeded; a single value when one did.",
      "MF-DP is scaled by 10³ as in the paper's Tables 1-2 (comparison.json keeps raw values).",
      "",
  ]
  rows = [
      [m, *(_cell(s[key], TABLE_SCALE[key], d) for key, _, d in _COLUMNS), str(s["num_seeds"])]
      for m, s in methods.items()
  ]
  lines += _table(["Method", *(label for _, label, _ in _COLUMNS), "Seeds"], rows)
  if summary["attributes"]:
    lines += ["", "## PQD and DP per attribute", ""]
    rows = [
        [m, *(_cell(s[metric].get(a), 1.0, 4) for a in summary["attributes"]
              for metric in ("pqd", "dp"))]
        for m, s in methods.items()
    ]
    header = [f"{a} {metric.upper()}" for a in summary["attributes"] for metric in ("pqd", "dp")]
    lines += _table(["Method", *header], rows)
  if summary["failed"]:
    lines += ["", "## Runs without a result", ""]
    for f in summary["failed"]:
      seed = "?" if f["seed"] is None else f["seed"]
      lines.append(f"- {f['method']} seed {seed} ({f['status']}, `{f['run_dir']}`): {f['error']}")
  return "\n".join(lines) + "\n"


def write_comparison(workdir: str, summary: dict[str, Any]) -> str:
  """Writes comparison.json and comparison.md into `workdir`; returns the markdown."""
  markdown = format_markdown(summary)
  with open(os.path.join(workdir, "comparison.json"), "w") as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(workdir, "comparison.md"), "w") as f:
    f.write(markdown)
  return markdown


@exit_on_user_error
def run(
    config, workdir: str, methods: Sequence[str], seeds: Sequence[str], retrain: bool = False
) -> None:
  methods, seeds = parse_methods(methods), parse_seeds(seeds)
  # Every config is checked before the first run trains, so a mistake costs seconds, not a run.
  configs = {(m, s): run_config(config, m, s) for m in methods for s in seeds}
  workdir = prepare_workdir(workdir)
  # A finished run is reused only if it was trained with the config asked for now.
  stale = [
      (run_dir(workdir, m, s), diff)
      for (m, s), run_cfg in configs.items()
      if os.path.exists(os.path.join(run_dir(workdir, m, s), REPORT))
      and (diff := trained_config_differences(run_dir(workdir, m, s), run_cfg))
  ]
  if stale and not retrain:
    raise stale_runs_error(stale, "--retrain")
  is_main = jax.process_index() == 0
  for i, ((method, seed), run_cfg) in enumerate(configs.items()):
    directory = run_dir(workdir, method, seed)
    print(f"[{i + 1}/{len(configs)}] {method} seed {seed}: {directory}", flush=True)
    status = run_one(run_cfg, directory, retrain=retrain)
    if status == "cached":
      print("  report.json exists; not retrained", flush=True)
    elif status == "failed":
      with open(os.path.join(directory, ERROR)) as f:
        print(f"  FAILED: {f.readline().strip()} (see {directory}/{ERROR})", flush=True)
    elif status == "stopped":
      print("Comparison stopped; rerun the same command to resume.", flush=True)
      return
  summary = summarise({m: [run_dir(workdir, m, s) for s in seeds] for m in methods})
  if is_main:
    markdown = write_comparison(workdir, summary)
    print(f"\n{markdown}\nWrote {workdir}/comparison.md and comparison.json", flush=True)
  if summary["failed"]:
    # The table is written, but a script driving the comparison must notice the gaps.
    print(f"{len(summary['failed'])} run(s) without a result; see the list above.", flush=True)
    sys.exit(1)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.quiet_logging()
  run(cli.loaded_config(_CONFIG), _WORKDIR.value, _METHODS.value, _SEEDS.value, _RETRAIN.value)


if __name__ == "__main__":
  cli.run(main)
