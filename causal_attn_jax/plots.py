"""Attention heatmaps (paper Fig. 8): one matrix per PNG, or every head of a layer as a grid.

Drawn with matplotlib's object API on an Agg canvas (no pyplot state).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from trainkit import storage

# Token labels on the axes while they stay legible; longer sequences get every k-th one.
_MAX_TICK_LABELS = 48
# Heads per row of the grid.
_GRID_COLUMNS = 4


def _ticks(labels: Sequence[str]) -> tuple[list[int], list[str]]:
  """Tick positions and token labels, every k-th token when there are too many to read."""
  positions = list(range(0, len(labels), max(1, math.ceil(len(labels) / _MAX_TICK_LABELS))))
  return positions, [labels[i] for i in positions]


def attention_heads_figure(maps: np.ndarray, labels: Sequence[str], *, title: str = "") -> Any:
  """Every head of one self-attention layer, `maps` [H, N, N], as a grid of heatmaps (a matplotlib
  Figure); `labels` name the tokens on both axes.

  The heads share one colour scale, so a head that spreads its attention looks paler than one
  that concentrates it. Queries are rows, keys columns.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  maps = np.asarray(maps, np.float32)
  if maps.ndim != 3:
    raise ValueError(f"expected attention maps [heads, queries, keys], got shape {maps.shape}")
  heads = maps.shape[0]
  cols = min(heads, _GRID_COLUMNS)
  rows = math.ceil(heads / cols)
  panel = min(max(1.6 + 0.14 * max(maps.shape[1:]), 2.6), 7.0)
  figure = Figure(figsize=(cols * panel + 1.2, rows * panel + 0.8), layout="constrained")
  FigureCanvasAgg(figure)
  grid = figure.subplots(rows, cols, squeeze=False)
  vmax = max(float(maps.max()), 1e-6)
  image = None
  for h, axes in enumerate(grid.ravel()):
    if h >= heads:
      axes.remove()
      continue
    image = axes.imshow(maps[h], cmap="viridis", vmin=0.0, vmax=vmax)
    axes.set_title(f"head {h}", fontsize=8)
    row, col = divmod(h, cols)
    bottom = row == rows - 1 or h + cols >= heads
    axes.set_xticks(*_ticks(labels), fontsize=6, rotation=90)
    axes.set_yticks(*_ticks(labels), fontsize=6)
    # Token labels on the outer panels only: every panel has the same tokens.
    axes.tick_params(labelbottom=bottom, labelleft=col == 0)
    if bottom:
      axes.set_xlabel("key", fontsize=8)
    if col == 0:
      axes.set_ylabel("query", fontsize=8)
  figure.colorbar(image, ax=grid.ravel()[:heads].tolist(), shrink=0.8, label="attention")
  if title:
    figure.suptitle(title, fontsize=10)
  return figure


def save_attention_heads(path: str, maps: np.ndarray, labels: Sequence[str], *, title: str) -> str:
  """Writes `attention_heads_figure(maps, labels, title=title)` as a PNG; returns the path."""
  storage.save_figure(attention_heads_figure(maps, labels, title=title), path, dpi=100)
  return path
