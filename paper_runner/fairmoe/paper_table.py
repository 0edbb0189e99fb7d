"""The paper's comparison table, as a table collector of the experiment runner.

Named in a sweep spec as `tables=("paper_runner.fairmoe.paper_table:write_comparison",)` (as
`paper_runner.fairmoe.compare` does), it writes `comparison.md` and `comparison.json`: one row per method
(each distinct grid value of `method`, its `@` settings included, in grid order; with other
varied grid keys, per combination of them) with the mean and its 95% Student-t interval over
the seeds that succeeded (`paper_runner.stats`):
Acc. (%), MF-PQD and MF-DP (× 1e-3, as the paper's Tables 1-2 print it), the effective number of
experts the MoE block uses (exp of the entropy of its test-set choices, paper Fig. 5) and the
mean gradient cosine between attribute tasks (Fig. 6), then each attribute's PQD and DP, then
each method's paired differences (same seed) from vanilla SMoE on accuracy, MF-PQD and MF-DP
with their intervals and verdicts (holds / does not hold / undecided), then the runs without a
result and why.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from paper_runner import stats as stats_lib
from paper_runner.collect import RunResult, markdown_table, row_label
from trainkit.storage import write_atomically

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
_SUMMARY_KEYS = tuple(key for key, _, _ in _COLUMNS)
_ATTRIBUTE_METRICS = ("pqd", "dp")
# The paper's claims against vanilla SMoE (Sec. 6.2): more accurate, higher PQD, lower DP.
BASELINE = "vanilla_smoe"
_CLAIMS = (("accuracy", "higher"), ("mf_pqd", "higher"), ("mf_dp", "lower"))


def _entry(run: RunResult) -> dict[str, Any]:
  """One run's entry of the summary: its metrics when it succeeded, else why not."""
  entry: dict[str, Any] = {"run_dir": run.run_dir, "seed": run.point.get("seed")}
  if run.status != "ok":
    return {**entry, "status": run.status, "error": run.error or run.status}
  report = run.report or {}
  try:
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
    dropped = (report.get("dropped") or {}).get("train")
    if dropped is not None:
      entry["dropped_train"] = float(dropped)
    active = report.get("experts_active", {}).get("choices", {})
    if active:
      entry["experts_active"] = float(np.mean(list(active.values())))
    # {"a|b": [cosine per validation batch]} for every pair of attributes.
    cosines = [v for values in report.get("gradient_cosine", {}).values() for v in values]
    if cosines:
      entry["gradient_cosine"] = float(np.mean(cosines))
    return entry
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    # A report without the fairness fields (another package's main) cannot be tabulated here.
    error = f"report.json lacks what the table needs: {type(e).__name__}: {e}"
    return {**entry, "status": "failed", "error": error}


def _stats(values: Sequence[float]) -> dict[str, Any]:
  """Mean, sample std (ddof=1) and 95% interval (None for fewer than two values) of `values`."""
  values = [float(v) for v in values]
  if not values:
    return {"mean": None, "std": None, "low": None, "high": None, "values": []}
  std = float(np.std(values, ddof=1)) if len(values) > 1 else None
  interval = stats_lib.t_interval(values)
  return {
      "mean": float(np.mean(values)),
      "std": std,
      "low": interval.low,
      "high": interval.high,
      "values": values,
  }


def paired_claims(methods: dict[str, Any], baseline: str = BASELINE) -> list[dict[str, Any]]:
  """Per method and claim, the paired difference from `baseline` (same seeds) and its verdict."""
  if baseline not in methods:
    return []

  def by_seed(entry: dict[str, Any], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in entry["runs"] if r["status"] == "ok" and key in r}

  claims = []
  for method, entry in methods.items():
    if method == baseline:
      continue
    for key, better in _CLAIMS:
      result = stats_lib.decide(by_seed(entry, key), by_seed(methods[baseline], key), better)
      d = result.difference
      claims.append(
          {
              "method": method,
              "baseline": baseline,
              "metric": key,
              "better": better,
              "seeds": result.seeds,
              "mean": d.mean if d else None,
              "low": d.low if d else None,
              "high": d.high if d else None,
              "verdict": result.verdict,
              "enough_seeds": result.enough_seeds,
          }
      )
  return claims


def summarise(runs: Sequence[RunResult]) -> dict[str, Any]:
  """Aggregates the runs per method (`row_label`) over seeds, in the order the runs come."""
  grouped: dict[str, list[dict[str, Any]]] = {}
  for run in runs:
    grouped.setdefault(row_label(run.point), []).append(_entry(run))
  methods: dict[str, Any] = {}
  attributes: list[str] = []
  failed: list[dict[str, Any]] = []
  for method, entries in grouped.items():
    ok = [e for e in entries if e["status"] == "ok"]
    for e in entries:
      if e["status"] != "ok":
        failed.append(
            {"method": method, **{k: e[k] for k in ("seed", "run_dir", "status", "error")}}
        )
    method_attributes = list(dict.fromkeys(a for e in ok for a in e["attributes"]))
    attributes += [a for a in method_attributes if a not in attributes]
    methods[method] = {
        "num_seeds": len(ok),
        "seeds": [e["seed"] for e in ok],
        **{key: _stats([e[key] for e in ok if key in e]) for key in _SUMMARY_KEYS},
        "dropped_train": _stats([e["dropped_train"] for e in ok if "dropped_train" in e]),
        **{
            metric: {
                a: _stats(
                    [e["attributes"][a][metric] for e in ok if metric in e["attributes"].get(a, {})]
                )
                for a in method_attributes
            }
            for metric in _ATTRIBUTE_METRICS
        },
        "runs": entries,
    }
  return {
      "methods": methods,
      "attributes": attributes,
      "claims": paired_claims(methods),
      "failed": failed,
      "table_scale": TABLE_SCALE,
  }


def _cell(stats: dict[str, Any] | None, scale: float, decimals: int, sign: bool = False) -> str:
  if not stats or stats["mean"] is None:
    return "—"
  return stats_lib.format_interval(
      stats["mean"], stats["low"], stats["high"], scale=scale, decimals=decimals, sign=sign
  )


def format_markdown(summary: dict[str, Any]) -> str:
  """The summary as markdown: the main table, per-attribute PQD, then runs that did not finish."""
  methods = summary["methods"]
  lines = [
      "# Method comparison",
      "",
      "Mean [95% Student-t interval] over the seeds that succeeded; a single value when one did.",
      "MF-DP is scaled by 10³ as in the paper's Tables 1-2 (comparison.json keeps raw values).",
      "",
  ]
  rows = [
      [m, *(_cell(s[key], TABLE_SCALE[key], d) for key, _, d in _COLUMNS), str(s["num_seeds"])]
      for m, s in methods.items()
  ]
  lines += markdown_table(["Method", *(label for _, label, _ in _COLUMNS), "Seeds"], rows)
  if summary["attributes"]:
    lines += ["", "## PQD and DP per attribute", ""]
    rows = [
        [
            m,
            *(
                _cell(s[metric].get(a), 1.0, 4)
                for a in summary["attributes"]
                for metric in _ATTRIBUTE_METRICS
            ),
        ]
        for m, s in methods.items()
    ]
    header = [
        f"{a} {metric.upper()}" for a in summary["attributes"] for metric in _ATTRIBUTE_METRICS
    ]
    lines += markdown_table(["Method", *header], rows)
  dropped = {
      m: s["dropped_train"]["mean"]
      for m, s in methods.items()
      if s.get("dropped_train", {}).get("mean") is not None
  }
  if any(v > 0 for v in dropped.values()):
    listed = ", ".join(f"{m} {v:.3f}" for m, v in dropped.items())
    lines += [
        "",
        f"Fraction of (token, choice) pairs dropped in training: {listed}. A method that drops "
        "more loses tokens the others keep; compare at a capacity factor of at least experts / "
        "top-k, which drops nothing (docs/protocol.md).",
    ]
  if summary["claims"]:
    lines += ["", f"## Paired differences from {BASELINE} (same seeds)", ""]
    labels = {key: label for key, label, _ in _COLUMNS}
    decimals = {key: d for key, _, d in _COLUMNS}
    rows = []
    for c in summary["claims"]:
      verdict = c["verdict"] if c["enough_seeds"] else f"{c['verdict']} (too few seeds)"
      rows.append(
          [
              c["method"],
              f"{c['better']} {labels[c['metric']]}",
              _cell(c, TABLE_SCALE[c["metric"]], decimals[c["metric"]], sign=True),
              str(len(c["seeds"])),
              verdict,
          ]
      )
    lines += markdown_table(
        ["Method", "claim", "difference [95% interval]", "pairs", "verdict"], rows
    )
    lines += [
        "",
        f"Verdicts need {stats_lib.MIN_VERDICT_SEEDS} paired seeds (docs/protocol.md); holds: the"
        " interval lies on the claimed side of 0, does not hold: on the other, undecided: it "
        "contains 0.",
    ]
  if summary["failed"]:
    lines += ["", "## Runs without a result", ""]
    for f in summary["failed"]:
      seed = "?" if f["seed"] is None else f["seed"]
      lines.append(f"- {f['method']} seed {seed} ({f['status']}, `{f['run_dir']}`): {f['error']}")
  return "\n".join(lines) + "\n"


def write_comparison(workdir: str, runs: list[RunResult]) -> list[str]:
  """The table collector: writes comparison.md and comparison.json into `workdir`."""
  summary = summarise(runs)
  paths = [os.path.join(workdir, "comparison.md"), os.path.join(workdir, "comparison.json")]
  write_atomically(paths[0], format_markdown(summary))
  write_atomically(paths[1], json.dumps(summary, indent=2))
  return paths
