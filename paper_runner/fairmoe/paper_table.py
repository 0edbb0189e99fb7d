"""The paper's comparison table, a sweep collector (`paper_runner.fairmoe.compare`): per method
the mean [95% Student-t interval] over seeds of Acc., MF-PQD, MF-DP, experts active and the
gradient cosine, each attribute's PQD and DP, the paired differences from vanilla SMoE with their
verdicts, and the runs without a result (`comparison.md`, `comparison.json`)."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from paper_runner import stats as stats_lib
from paper_runner.collect import RunResult, markdown_table, row_label
from trainkit.storage import write_atomically

# (key, label, scale, decimals): accuracy in %, MF-DP in units of 1e-3 (the paper's).
_COLUMNS = (
    ("accuracy", "Acc. (%)", 100.0, 2),
    ("mf_pqd", "MF-PQD", 1.0, 4),
    ("mf_dp", "MF-DP (×10⁻³)", 1e3, 2),
    ("experts_active", "Experts active", 1.0, 2),
    ("gradient_cosine", "Grad. cos", 1.0, 3),
)
TABLE_SCALE = {key: scale for key, _, scale, _ in _COLUMNS}
_ATTRIBUTE_METRICS = ("pqd", "dp")
# The paper's claims against vanilla SMoE (Sec. 6.2): more accurate, higher PQD, lower DP.
BASELINE = "vanilla_smoe"
_CLAIMS = (("accuracy", "higher"), ("mf_pqd", "higher"), ("mf_dp", "lower"))


def _entry(run: RunResult) -> dict[str, Any]:
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
    error = f"report.json lacks what the table needs: {type(e).__name__}: {e}"
    return {**entry, "status": "failed", "error": error}


def _stats(values: Sequence[float]) -> dict[str, Any]:
  """Mean, sample std (ddof=1) and 95% interval (None for fewer than two values) of `values`."""
  values = [float(v) for v in values]
  if not values:
    return {"mean": None, "std": None, "low": None, "high": None, "values": []}
  std = float(np.std(values, ddof=1)) if len(values) > 1 else None
  t = stats_lib.t_interval(values)
  return dict(mean=float(np.mean(values)), std=std, low=t.low, high=t.high, values=values)


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
          dict(method=method, baseline=baseline, metric=key, better=better, seeds=result.seeds)
          | {k: getattr(d, k) if d else None for k in ("mean", "low", "high")}
          | dict(verdict=result.verdict, enough_seeds=result.enough_seeds)
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
        **{key: _stats([e[key] for e in ok if key in e]) for key in TABLE_SCALE},
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
      [m, *(_cell(s[key], scale, d) for key, _, scale, d in _COLUMNS), str(s["num_seeds"])]
      for m, s in methods.items()
  ]
  lines += markdown_table(["Method", *(label for _, label, _, _ in _COLUMNS), "Seeds"], rows)
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
    columns = {key: (label, scale, d) for key, label, scale, d in _COLUMNS}
    rows = []
    for c in summary["claims"]:
      label, scale, decimals = columns[c["metric"]]
      few = "" if c["enough_seeds"] else " (too few seeds)"
      cell = _cell(c, scale, decimals, sign=True)
      pairs = str(len(c["seeds"]))
      rows.append([c["method"], f"{c['better']} {label}", cell, pairs, c["verdict"] + few])
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
