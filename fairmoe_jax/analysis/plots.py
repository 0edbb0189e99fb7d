"""PNG plots of a finished run, from its `report.json` and `metrics.jsonl`.

  from fairmoe_jax.analysis import write_plots
  write_plots("/tmp/quickstart")  # -> /tmp/quickstart/plots/*.png

Each plot is drawn only when the run logged its data, so the same call works for every method.
Figures use `matplotlib.figure.Figure` on the Agg canvas rather than `pyplot`: no display, no
global figure state, and importing this module leaves a notebook's backend alone.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fairmoe_jax.fairness.experts import ALLOCATION_PREFIX, SHARE_PREFIX
from fairmoe_jax.metrics.pooling import read_report
from trainkit import storage
from trainkit.metric_writers import log_exists, read_log

_DPI = 120
# Heatmap cells are annotated with their value only while the text stays legible.
_MAX_ANNOTATED_CELLS = 160


def load_metrics(workdir: str) -> list[dict[str, Any]]:
  """The lines of `metrics.jsonl`, or [] without one; unlike `trainkit.metric_writers.read_metrics`,
  a line cut short is skipped, as plots are best-effort."""
  path = storage.join(workdir, "metrics.jsonl")
  if not log_exists(path):
    return []
  records = []
  for line in read_log(path).splitlines():  # On gs://, with the parts not folded in yet.
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
      records.append(record)
  return sorted(records, key=lambda r: r["step"])


def _series(metrics: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
  """(steps, values) of `key`, skipping steps where it is absent or not finite (None in JSON)."""
  steps, values = [], []
  for record in metrics:
    value = record.get(key)
    if isinstance(value, (int, float)) and math.isfinite(value):
      steps.append(record["step"])
      values.append(float(value))
  return steps, values


def _safe_name(name: str) -> str:
  """A block name as a file-name part (block names may hold '/' or '.')."""
  return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "block"


def _subplots(n: int, *, width: float, height: float, max_cols: int = 3):
  """A figure with `n` axes in a grid of at most `max_cols` columns; the unused axes removed."""
  cols = min(n, max_cols)
  rows = math.ceil(n / cols)
  fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for ax in axes[n:]:
    ax.remove()
  return fig, list(axes[:n])


def _title(report: dict[str, Any]) -> str:
  parts = [report.get("method"), f"step {report['step']}" if "step" in report else None]
  return " - ".join(str(p) for p in parts if p)


def _save(fig: Figure, path: str) -> str:
  storage.save_figure(fig, path, dpi=_DPI)
  return path


def plot_expert_activation(report: dict[str, Any], block: str, path: str) -> str:
  """Per attribute, the fraction of each group's routed tokens that each expert served.

  Rows are the groups, columns the experts (the paper's Figs. 2 and 5): a bright cell off the
  common pattern is an expert that specialised on one group.
  """
  per_attribute = report["expert_utilisation"][block]
  fig, axes = _subplots(len(per_attribute), width=4.2, height=3.4)
  vmax = max(
      (max(row) for groups in per_attribute.values() for row in groups.values() if row), default=1.0
  )
  image = None
  for ax, (attribute, groups) in zip(axes, per_attribute.items()):
    names = list(groups)
    values = np.asarray([groups[g] for g in names], dtype=float)
    if values.size == 0:
      ax.set_axis_off()
      ax.set_title(f"{attribute}: no groups")
      continue
    image = ax.imshow(values, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax)
    ax.set_title(attribute)
    ax.set_xlabel("expert")
    ax.set_ylabel("group")
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(len(names)), names)
    if values.size <= _MAX_ANNOTATED_CELLS:
      for (i, j), v in np.ndenumerate(values):
        colour = "black" if v > 0.6 * vmax else "white"  # Legible on the cell's own shade.
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=colour)
  if image is not None:
    fig.colorbar(image, ax=axes, shrink=0.8, label="fraction of the group's routed tokens")
  fig.suptitle(f"Expert activation per group, {block} ({_title(report)})")
  return _save(fig, path)


def plot_group_accuracy(report: dict[str, Any], path: str) -> str:
  """Per attribute, test accuracy of each group with its size (PQD in the title); overall
  accuracy as a line."""
  attributes = report["attributes"]
  most = max((len(a["groups"]) for a in attributes.values()), default=1)
  # Horizontal bars: group names as long as "posterior_torso" stay legible.
  fig, axes = _subplots(len(attributes), width=4.6, height=1.4 + 0.32 * most)
  overall = 100.0 * report["accuracy"]
  for ax, (attribute, entry) in zip(axes, attributes.items()):
    groups = entry["groups"]
    names = list(groups)
    accuracies = [100.0 * groups[g]["accuracy"] for g in names]
    positions = np.arange(len(names))
    ax.barh(positions, accuracies, color="tab:blue")
    ax.set_yticks(positions, [f"{g} (n={groups[g]['n']})" for g in names], fontsize=8)
    ax.invert_yaxis()  # First group on top, as in the report.
    ax.axvline(overall, color="tab:red", linestyle="--", label=f"overall {overall:.1f}%")
    ax.set_xlim(0.0, 100.0)
    ax.set_xlabel("test accuracy (%)")
    title = f"{attribute} (PQD {entry['pqd']:.3f})" if "pqd" in entry else attribute
    if entry.get("empty_groups"):
      title += f"\nempty: {', '.join(entry['empty_groups'])}"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
  fig.suptitle(f"Test accuracy per group ({_title(report)})")
  return _save(fig, path)


def _allocation_attributes(report: dict[str, Any], metrics: Sequence[dict]) -> list[str]:
  """Attributes with a logged allocation, in the report's order (then any others, sorted)."""
  logged = {
      k[len(ALLOCATION_PREFIX) :] for r in metrics for k in r if k.startswith(ALLOCATION_PREFIX)
  }
  ordered = [a for a in report.get("attributes", {}) if a in logged]
  return ordered + sorted(logged - set(ordered))


def plot_allocation_history(report: dict[str, Any], metrics: Sequence[dict], path: str) -> str:
  """Experts of each attribute against step, as FairSMoE's expert management moved them, and
  each expert's share of the validation routing choices at the same reviews.

  One panel per attribute: the counts are small, often equal integers that one axis would hide.
  """
  attributes = _allocation_attributes(report, metrics)
  experts = sorted(
      {int(k[len(SHARE_PREFIX) :]) for r in metrics for k in r if k.startswith(SHARE_PREFIX)}
  )
  panels = len(attributes) + bool(experts)
  fig = Figure(figsize=(6.4, 1.2 + 1.6 * panels), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(panels, 1, sharex=True, squeeze=False).ravel()
  for ax, attribute in zip(axes, attributes):
    steps, values = _series(metrics, ALLOCATION_PREFIX + attribute)
    ax.plot(steps, values, drawstyle="steps-post", marker="o", color="tab:green")
    ax.set_ylim(0.0, max(values, default=1.0) + 1.0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{attribute}\nexperts")
    ax.grid(alpha=0.3)
  if experts:
    # Did routing follow? Each expert's share of the validation choices at each review, with
    # the reviews that changed the allocation marked.
    ax = axes[-1]
    for e in experts:
      ax.plot(*_series(metrics, f"{SHARE_PREFIX}{e}"), marker=".", label=f"expert {e}")
    for change in report.get("fem_changes", []):
      ax.axvline(change["step"], color="0.6", lw=0.8, ls=":")
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("share of\nval. choices")
    ax.legend(fontsize="x-small", ncol=min(len(experts), 4), loc="upper right")
    ax.grid(alpha=0.3)
  axes[-1].set_xlabel("step (dotted: a FEM change)")
  fig.suptitle(f"Experts per attribute at each review ({_title(report)})")
  return _save(fig, path)


def plot_gradient_cosine(report: dict[str, Any], path: str) -> str:
  """Per attribute pair, the histogram of the cosine between their fairness-loss gradients.

  The paper's Fig. 6: mass below 0 means one attribute's fairness works against the other's.
  """
  pairs = report["gradient_cosine"]
  fig, axes = _subplots(len(pairs), width=3.8, height=3.0)
  bins = np.linspace(-1.0, 1.0, 41)
  for ax, (pair, values) in zip(axes, pairs.items()):
    values = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    ax.hist(values, bins=bins, color="tab:purple", alpha=0.8)
    ax.axvline(0.0, color="black", linewidth=0.8)
    if values.size:
      ax.axvline(values.mean(), color="tab:red", linestyle="--", label=f"mean {values.mean():.2f}")
      ax.legend(fontsize=8)
    ax.set_xlim(-1.0, 1.0)
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("batches")
    ax.set_title(f"{pair.replace('|', ' vs ')} ({values.size} batches)", fontsize=10)
  fig.suptitle(f"Gradient cosine between attribute fairness losses ({_title(report)})")
  return _save(fig, path)


_CE = "training task loss (cross-entropy)"
# (panel, metrics.jsonl key, scale, style) of each curve of `validation_curves_figure`; a curve
# the run did not log is left out, each attribute's validation PQD follows the last.
_CURVES = (
    (0, "loss", 1, dict(color="tab:blue", linewidth=1, label="training loss (all terms)")),
    (0, "loss/cross_entropy", 1, dict(color="tab:orange", linestyle="--", linewidth=1, label=_CE)),
    (0, "val/loss", 1, dict(marker="o", color="black", label="validation cross-entropy")),
    (1, "accuracy", 100, dict(color="tab:blue", linewidth=1, alpha=0.6, label="training batches")),
    (1, "val/accuracy", 100, dict(marker="o", color="black", label="validation")),
    (2, "val/mf_pqd", 1, dict(marker="o", color="black", linewidth=2, label="MF-PQD")),
)


def validation_curves_figure(report: dict[str, Any], metrics: Sequence[dict]) -> Figure:
  """The run's curves against step, in three panels sharing the step axis.

  Loss (training, its cross-entropy term, validation), accuracy (training batches thin,
  validation points) and validation MF-PQD with each attribute's PQD (thin).
  """
  fig = Figure(figsize=(14.0, 3.8), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 3, sharex=True)
  curves = [*_CURVES] + [
      (2, f"val/{a}/pqd", 1, dict(linewidth=1, alpha=0.7, label=a))
      for a in report.get("attributes", {})
  ]
  for panel, key, scale, style in curves:
    steps, values = _series(metrics, key)
    if steps:
      axes[panel].plot(steps, [scale * v for v in values], **style)
  if not _series(metrics, "val/mf_pqd")[0]:
    axes[2].text(0.5, 0.5, "no evaluation logged", transform=axes[2].transAxes, ha="center")
  for ax, label in zip(axes, ("loss", "accuracy (%)", "validation PQD (1 = fair)")):
    ax.set_ylabel(label)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  axes[2].set_ylim(0.0, 1.05)
  fig.suptitle(f"Training and validation curves ({_title(report)})")
  return fig


def write_plots(workdir: str) -> list[str]:
  """Writes every plot the run has data for into `workdir/plots/`; returns their paths.

  Needs `workdir/report.json` (UserError otherwise); metrics.jsonl is optional.
  """
  report = read_report(workdir)
  metrics = load_metrics(workdir)
  out_dir = storage.join(workdir, "plots")
  storage.makedirs(out_dir)

  jobs: list[tuple[str, Callable[[str], str]]] = []
  for block in report.get("expert_utilisation") or {}:
    if report["expert_utilisation"][block]:
      jobs.append(
          (
              f"expert_activation_{_safe_name(block)}.png",
              lambda p, b=block: plot_expert_activation(report, b, p),
          )
      )
  if report.get("attributes"):
    jobs.append(("group_accuracy.png", lambda p: plot_group_accuracy(report, p)))
  if any(k.startswith(ALLOCATION_PREFIX) for r in metrics for k in r):
    jobs.append(("allocation_history.png", lambda p: plot_allocation_history(report, metrics, p)))
  if report.get("gradient_cosine"):
    jobs.append(("gradient_cosine.png", lambda p: plot_gradient_cosine(report, p)))
  if any(_series(metrics, key)[0] for key in ("loss", "val/accuracy", "val/mf_pqd")):
    jobs.append(
        ("validation_curves.png", lambda p: _save(validation_curves_figure(report, metrics), p))
    )

  return [draw(storage.join(out_dir, name)) for name, draw in jobs]
