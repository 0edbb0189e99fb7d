"""Attention heatmaps (paper Fig. 8): one PNG per (layer, head, example).

Drawn with matplotlib's object API on an Agg canvas (no pyplot state), so it is safe in
threads, headless machines and tests.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def save_attention_heatmap(
    path: str,
    matrix: np.ndarray,
    labels: Sequence[str],
    *,
    title: str = "",
    column_labels: Sequence[str] | None = None,
) -> str:
  """Writes `matrix` [Nq, Nk] (attention probabilities) as a heatmap PNG; returns the path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  matrix = np.asarray(matrix, np.float32)
  column_labels = labels if column_labels is None else column_labels
  size = min(2.0 + 0.28 * max(matrix.shape), 14.0)
  figure = Figure(figsize=(size + 1.0, size))
  FigureCanvasAgg(figure)
  axes = figure.add_subplot(1, 1, 1)
  image = axes.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(float(matrix.max()), 1e-6))
  axes.set_xticks(range(len(column_labels)))
  axes.set_xticklabels(column_labels, rotation=90, fontsize=7)
  axes.set_yticks(range(len(labels)))
  axes.set_yticklabels(labels, fontsize=7)
  axes.set_xlabel("key")
  axes.set_ylabel("query")
  if title:
    axes.set_title(title, fontsize=9)
  figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
  figure.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  figure.savefig(path, dpi=100)
  return path
