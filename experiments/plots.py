"""A sweep's plots: each tabulated number against each grid key that varies."""

from __future__ import annotations

import itertools
import os
from typing import Any, Mapping, Sequence

import ml_collections
import numpy as np

from experiments.collect import is_number, table_columns
from experiments.spec import format_value, safe_name


def write_plots(
    sweep: ml_collections.ConfigDict, workdir: str, rows: Sequence[Mapping[str, Any]]
) -> list[str]:
  """`plots/<column>_vs_<key>.png` per varied non-seed grid key and numeric column; returns paths.

  y is the mean over seeds (error bar: sample std when several), one line per combination of
  the other varied keys; only finished runs count.
  """
  varied = [k for k, values in sweep.grid.items() if k != "seed" and len(values) > 1]
  ok = [r for r in rows if r["status"] == "ok"]
  columns = [c for c in table_columns(sweep, rows)[len(sweep.grid) + 1 :]]
  columns = [c for c in columns if any(is_number(r.get(c)) for r in ok)]
  if not varied or not columns:
    return []
  import matplotlib  # Lazily: only collecting plots needs it.

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plots_dir = os.path.join(workdir, "plots")
  os.makedirs(plots_dir, exist_ok=True)
  paths = []
  for column, key in itertools.product(columns, varied):
    xs = list(sweep.grid[key])
    numeric = all(is_number(x) for x in xs)
    positions = xs if numeric else list(range(len(xs)))
    others = [k for k in varied if k != key]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for combo in itertools.product(*(sweep.grid[k] for k in others)):
      same = [r for r in ok if all(r[k] == v for k, v in zip(others, combo))]
      cells = [[r[column] for r in same if r[key] == x and is_number(r.get(column))] for x in xs]
      kept = [(p, c) for p, c in zip(positions, cells) if c]
      if not kept:
        continue
      label = ", ".join(f"{k}={format_value(v)}" for k, v in zip(others, combo)) or None
      ax.errorbar(
          [p for p, _ in kept],
          [np.mean(c) for _, c in kept],
          yerr=[np.std(c, ddof=1) if len(c) > 1 else 0.0 for _, c in kept],
          marker="o",
          capsize=3,
          label=label,
      )
    if numeric and min(xs) > 0 and max(xs) >= 4 * min(xs):
      ax.set_xscale("log", base=2)
    labels = [format_value(x) for x in xs]
    # Long values (a method with `@` settings) would overlap their neighbours when level.
    slant = {"rotation": 20, "ha": "right"} if max(map(len, labels)) > 12 else {}
    ax.set_xticks(positions, labels, **slant)
    ax.set_xlabel(key)
    ax.set_ylabel(column)
    ax.grid(alpha=0.3)
    if others:
      ax.legend(fontsize="small")
    fig.tight_layout()
    path = os.path.join(plots_dir, f"{safe_name(f'{column}_vs_{key}')}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
