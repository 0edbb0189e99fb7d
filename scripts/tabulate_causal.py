r"""Markdown table of causal_attn_jax runs: mean +- std over seeds of what report.json holds.

  python scripts/tabulate_causal.py ROOT/{vanilla,causal,band}_s{0,1,2}

Workdirs are grouped by name with the trailing `_s<seed>` removed; each group is one row.
Columns: in-distribution accuracy, challenge accuracy and its two halves (HANS schema), mean
effective keys and top-1 mass over the self-attention layers, fraction of nodes in the
Markov-blanket band, number of seeds.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

import numpy as np


def _row(reports: list[dict]) -> dict[str, list[float]]:
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


def main(workdirs: list[str]) -> None:
  groups: dict[str, list[dict]] = collections.OrderedDict()
  for workdir in workdirs:
    path = os.path.join(workdir, "report.json")
    if not os.path.isfile(path):
      print(f"skipping {workdir}: no report.json", file=sys.stderr)
      continue
    name = re.sub(r"_s\d+$", "", os.path.basename(os.path.normpath(workdir)))
    with open(path) as f:
      groups.setdefault(name, []).append(json.load(f))
  rows = {name: _row(reports) for name, reports in groups.items()}
  columns = list(dict.fromkeys(c for values in rows.values() for c in values))
  print("| run | " + " | ".join(columns) + " | seeds |")
  print("|---" * (len(columns) + 2) + "|")
  for name, values in rows.items():
    cells = []
    for c in columns:
      v = values.get(c, [])
      cells.append(f"{np.mean(v):.3f} ± {np.std(v):.3f}" if v else "-")
    print(f"| {name} | " + " | ".join(cells) + f" | {len(groups[name])} |")


if __name__ == "__main__":
  main(sys.argv[1:])
