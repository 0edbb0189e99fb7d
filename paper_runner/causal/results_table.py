"""A quick markdown table of causal_attn_jax runs, mean [95% interval] over seeds, no verdicts
(`scripts/tabulate_causal.py`; a results spec gives verdicts: paper_runner/tables.py)."""

from __future__ import annotations

import collections
from typing import Any, Mapping

import numpy as np

from paper_runner import stats
from paper_runner.collect import markdown_table


def report_values(reports: list[dict[str, Any]]) -> dict[str, list[float]]:
  """Per column, the value of each report that has it (in the order of `reports`)."""
  values = collections.defaultdict(list)
  for r in reports:
    values["accuracy"].append(r["accuracy"])
    if "challenge" in r:
      values["challenge"].append(r["challenge"]["accuracy"])
      for heuristic in r["challenge"]["by_heuristic"].values():
        for label, acc in heuristic.items():
          if acc is not None:
            values[f"challenge {label}"].append(acc)
    values["effective keys"].append(np.mean(list(r["attention"]["effective_keys"].values())))
    values["top-1 mass"].append(np.mean(list(r["attention"]["top1_mass"].values())))
    values["nodes within"].append(r["constraints"]["nodes_within"])
  return values


def _cell(values: list[float]) -> str:
  interval = stats.interval(values)
  return stats.format_interval(interval.mean, interval.low, interval.high)


def format_table(groups: Mapping[str, list[dict[str, Any]]]) -> str:
  """The markdown table of {row name: [report of each seed]}, one row per name in order."""
  rows = {name: report_values(reports) for name, reports in groups.items()}
  columns = list(dict.fromkeys(c for values in rows.values() for c in values))
  body = [
      [name, *(_cell(values[c]) if values.get(c) else "-" for c in columns), str(len(groups[name]))]
      for name, values in rows.items()
  ]
  return "\n".join(markdown_table(["run", *columns, "seeds"], body)) + "\n"
