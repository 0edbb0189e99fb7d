"""A sweep's plots: each tabulated number against each grid key that varies (matplotlib's object
API on an Agg canvas: no pyplot state, no display)."""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import ml_collections
import numpy as np

from paper_runner.collect import is_number, table_columns
from paper_runner.spec import format_value, safe_name, split_value
from trainkit import storage

# The share of the gap between two categories that their series are spread over.
_DODGE_WIDTH = 0.5


def sweep_figure(
    sweep: ml_collections.ConfigDict, rows: Sequence[Mapping[str, Any]], column: str, key: str
) -> Any:
  """`column` against grid key `key`: the mean over finished runs (error bar: the sample std),
  one series per combination of the other varied keys; numeric keys on a (log2 when wide) line,
  others as unjoined categories with each run a dot."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # Lazily: only plots need it.
  from matplotlib.figure import Figure

  varied = [k for k, values in sweep.grid.items() if k != "seed" and len(values) > 1]
  ok = [r for r in rows if r["status"] == "ok"]
  xs = list(sweep.grid[key])
  numeric = all(is_number(x) for x in xs)
  positions = np.asarray(xs if numeric else range(len(xs)), dtype=float)
  others = [k for k in varied if k != key]
  combos = list(itertools.product(*(sweep.grid[k] for k in others)))
  fig = Figure(figsize=(5.5, 3.8), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for i, combo in enumerate(combos):
    same = [r for r in ok if all(r[k] == v for k, v in zip(others, combo))]
    cells = [[r[column] for r in same if r[key] == x and is_number(r.get(column))] for x in xs]
    kept = [(p, c) for p, c in zip(positions, cells) if c]
    if not kept:
      continue
    offset = 0.0
    if not numeric and len(combos) > 1:
      offset = _DODGE_WIDTH * (i / (len(combos) - 1) - 0.5)
    label = ", ".join(f"{k}={format_value(v)}" for k, v in zip(others, combo)) or None
    bars = ax.errorbar(
        [p + offset for p, _ in kept],
        [np.mean(c) for _, c in kept],
        yerr=[np.std(c, ddof=1) if len(c) > 1 else 0.0 for _, c in kept],
        marker="o",
        capsize=3,
        linestyle="-" if numeric else "none",
        label=label,
    )
    if not numeric:
      runs = [(p + offset, v) for p, c in kept for v in c]
      ax.scatter(*zip(*runs), s=9, alpha=0.4, color=bars[0].get_color(), zorder=3)
  if numeric and min(xs) > 0 and max(xs) >= 4 * min(xs):
    ax.set_xscale("log", base=2)
  if not numeric:
    ax.set_xlim(-0.5, len(xs) - 0.5)
  labels = [tick_label(x) for x in xs]
  longest = max(len(line) for label in labels for line in label.split("\n"))
  slant = {"rotation": 20, "ha": "right"} if longest > 12 else {}
  ax.set_xticks(positions, labels, **slant)
  ax.set_xlabel(key)
  ax.set_ylabel(column)
  ax.grid(alpha=0.3, axis="y" if not numeric else "both")
  if others:
    ax.legend(fontsize="small")
  return fig


def tick_label(value: Any) -> str:
  """A grid value as a tick label: `VALUE@a.b.c=X` -> `VALUE` and `c=X` on lines of their own."""
  value_text, settings = split_value(format_value(value))  # Validated with the sweep.
  return "\n".join([value_text, *(f"{k.rpartition('.')[2]}={v}" for k, v in settings.items())])


def write_plots(
    sweep: ml_collections.ConfigDict, workdir: str, rows: Sequence[Mapping[str, Any]]
) -> list[str]:
  """`plots/<column>_vs_<key>.png` per varied non-seed grid key and numeric column; returns paths."""
  varied = [k for k, values in sweep.grid.items() if k != "seed" and len(values) > 1]
  ok = [r for r in rows if r["status"] == "ok"]
  columns = table_columns(sweep, rows)[len(sweep.grid) + 1 :]
  columns = [c for c in columns if any(is_number(r.get(c)) for r in ok)]
  if not varied or not columns:
    return []
  plots_dir = storage.join(workdir, "plots")
  storage.makedirs(plots_dir)
  paths = []
  for column, key in itertools.product(columns, varied):
    path = storage.join(plots_dir, f"{safe_name(f'{column}_vs_{key}')}.png")
    storage.save_figure(sweep_figure(sweep, rows, column, key), path, dpi=100)
    paths.append(path)
  return paths
