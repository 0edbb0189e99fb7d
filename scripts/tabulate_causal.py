r"""Markdown table of causal_attn_jax runs: mean [95% interval] over seeds of what report.json holds.

  python scripts/tabulate_causal.py ROOT/{vanilla,causal,band}_s{0,1,2}

Workdirs are grouped by name without the trailing `_s<seed>`, one row each; the table is
`paper_runner.causal.results_table`'s (a sweep can ask for it too).
"""

from __future__ import annotations

import json
import os
import re
import sys

from paper_runner.causal.results_table import format_table


def main(workdirs: list[str]) -> None:
  groups: dict[str, list[dict]] = {}
  for workdir in workdirs:
    path = os.path.join(workdir, "report.json")
    if not os.path.isfile(path):
      print(f"skipping {workdir}: no report.json", file=sys.stderr)
      continue
    name = re.sub(r"_s\d+$", "", os.path.basename(os.path.normpath(workdir)))
    with open(path) as f:
      groups.setdefault(name, []).append(json.load(f))
  print(format_table(groups), end="")


if __name__ == "__main__":
  main(sys.argv[1:])
