"""How few experts a finished run's router uses: the paper's Sec. 3.2 and Figure 2, measured.

Sec. 3.2 finds that vanilla SMoE's router sends similar inputs, whatever their attribute, to the
same few experts, "intensified with increased experts or earlier SMoE layer integration"; Figure
2 reads it as a utilisation rate that falls as the experts increase and one routing pattern for
every attribute group. Per MoE block, on a split the run's report describes (the test split, or
the validation split, whose routing the report keeps beside it):

* `utilisation`: experts active (exp entropy of the split's expert choices, the report's
  `experts_active`) over the number of experts E: 1 when every expert serves alike, 1/E when one
  serves all.
* `top_k_share`: the share of the split's choices that its k most used experts serve, k the
  router's top_k: k/E when routing is uniform, 1 when every token picks the same k experts.
* `image_utilisation`, `image_top_k_share`: the same per image (its own choices, from the run's
  `predictions.csv`), averaged over images: concentration within an image, which a split can
  hide when different images use different experts.
* `group_divergence`: the largest total-variation distance between one attribute group's expert
  distribution and the split's (and that group): 0 when every group routes alike.
* `dropped`: the share of the split's (token, choice) pairs over capacity.

`write_routing_table` is a sweep table collector (`routing.md`, `routing.json`: a row per run
and block, on the test split); `write_validation_routing_table` is the same on the validation
split, without the per-image measures: the one to read where the measurement chooses a setting
(docs/protocol.md).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fairmoe_jax.evaluation import effective_experts, group_divergence
from fairmoe_jax.metrics.pooling import PREDICTIONS_FILE
from trainkit import storage
from trainkit.storage import write_atomically
from trainkit.workdir import CONFIG_FILE


def top_share(usage: np.ndarray, k: int) -> float:
  """The share of `usage` (counts or shares per expert) held by its k largest entries."""
  total = float(np.sum(usage))
  return float(np.sort(usage)[::-1][:k].sum() / total) if total > 0 else math.nan


def per_image(shares: np.ndarray, k: int) -> tuple[float, float]:
  """(mean utilisation, mean top-k share) over images of `shares` [N, E]: each row an image's
  share of its (token, choice) pairs per expert. Rows with nothing served (every choice dropped)
  are left out; each row is renormalised, so a drop does not count as concentration."""
  shares = np.asarray(shares, np.float64)
  shares = shares[shares.sum(axis=1) > 0]  # effective_experts renormalises each row.
  if not len(shares):
    return math.nan, math.nan
  num_experts = shares.shape[1]
  active = [effective_experts(row) / num_experts for row in shares]
  top = [top_share(row, k) for row in shares]
  return float(np.mean(active)), float(np.mean(top))


def read_expert_columns(path: str) -> dict[str, np.ndarray]:
  """{block: [N, E] shares} from a run's predictions.csv (its `<block>/expert_<e>` columns)."""
  reader = csv.reader(storage.read_text(path).splitlines())
  header = next(reader)
  rows = list(reader)
  columns: dict[str, list[tuple[int, int]]] = {}
  for index, name in enumerate(header):
    block, sep, expert = name.partition("/expert_")
    if sep and expert.isdigit():
      columns.setdefault(block, []).append((int(expert), index))
  shares = {}
  for block, pairs in columns.items():
    order = [index for _, index in sorted(pairs)]
    shares[block] = np.array([[float(row[i] or 0.0) for i in order] for row in rows], np.float64)
  return shares


def routing_concentration(
    report: Mapping[str, Any], top_k: int, image_shares: Mapping[str, np.ndarray] | None = None
) -> dict[str, dict[str, Any]]:
  """{block: the measures of the module docstring} from a run's report (and its per-image
  expert shares, `read_expert_columns`; without them the per-image measures are NaN)."""
  measures = {}
  for block, share in report.get("expert_share", {}).get("choices", {}).items():
    share = np.asarray(share, np.float64)
    num_experts = len(share)
    divergence, group = group_divergence(share, report["expert_utilisation"][block])
    image = (
        per_image(image_shares[block], top_k)
        if image_shares and block in image_shares
        else (math.nan, math.nan)
    )
    measures[block] = dict(
        num_experts=num_experts,
        top_k=top_k,
        utilisation=effective_experts(share) / num_experts,
        top_k_share=top_share(share, top_k),
        uniform_top_k_share=min(top_k, num_experts) / num_experts,
        image_utilisation=image[0],
        image_top_k_share=image[1],
        group_divergence=divergence,
        most_divergent_group=group,
        dropped=float(report.get("fraction_dropped", {}).get(block, 0.0)),
    )
  return measures


SPLITS = ("test", "validation")


def run_concentration(
    run_dir: str, report: Mapping[str, Any], split: str = "test"
) -> dict[str, dict[str, Any]] | None:
  """routing_concentration of the run in `run_dir` on `split` (per-image shares from
  predictions.csv on the test split); None when the report has no validation routing."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: one of {', '.join(SPLITS)}")
  top_k = int(json.loads(storage.read_text(storage.join(run_dir, CONFIG_FILE)))["moe"]["top_k"])
  if split == "validation":
    validation = report.get("validation") or {}
    return routing_concentration(validation, top_k) if "expert_share" in validation else None
  path = storage.join(run_dir, PREDICTIONS_FILE)
  image_shares = read_expert_columns(path) if storage.path(path).exists() else None
  return routing_concentration(report, top_k, image_shares)


_COLUMNS = (
    ("utilisation", "utilisation (experts active / E)"),
    ("top_k_share", "top-k share (uniform)"),
    ("image_utilisation", "per image: utilisation"),
    ("image_top_k_share", "per image: top-k share"),
    ("group_divergence", "largest group divergence (group)"),
    ("dropped", "dropped"),
)


def _cell(key: str, measures: Mapping[str, Any]) -> str:
  if math.isnan(measures[key]):
    return "—"  # A measure the run cannot give (per image without predictions.csv).
  value = f"{measures[key]:.3f}"
  if key == "top_k_share":
    return f"{value} ({measures['uniform_top_k_share']:.3f})"
  return f"{value} ({measures['most_divergent_group']})" if key == "group_divergence" else value


def format_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
  """The routing table: a row per run and block."""
  lines = [
      "| run | block | E | " + " | ".join(title for _, title in _COLUMNS) + " |",
      "|---|---|---|" + "---|" * len(_COLUMNS),
  ]
  for row in rows:
    if row["status"] != "ok":
      lines.append(f"| {row['run']} | {row['status']} |" + " |" * (len(_COLUMNS) + 1))
      continue
    for block, measures in row["blocks"].items():
      cells = " | ".join(_cell(key, measures) for key, _ in _COLUMNS)
      lines.append(f"| {row['run']} | {block} | {measures['num_experts']} | {cells} |")
  return "\n".join(lines) + "\n"


def _without_nan(value: Any) -> Any:
  """`value` with NaN (a measure the run cannot give) as None, which JSON can hold."""
  if isinstance(value, float) and math.isnan(value):
    return None
  if isinstance(value, dict):
    return {k: _without_nan(v) for k, v in value.items()}
  return [_without_nan(v) for v in value] if isinstance(value, list) else value


# A finished run whose report has no routing of the validation split.
NO_VALIDATION_ROUTING = "no validation routing (evaluate again: --mode=eval)"


def _write_table(workdir: str, runs: Sequence[Any], split: str, name: str) -> list[str]:
  rows = []
  for run in runs:
    row: dict[str, Any] = dict(run=run.name, point=dict(run.point), status=run.status)
    if run.status == "ok":
      blocks = run_concentration(run.run_dir, run.report, split)
      if blocks is None:
        row["status"] = NO_VALIDATION_ROUTING
      else:
        row["blocks"] = blocks
    rows.append(row)
  paths = [storage.join(workdir, f"{name}.md"), storage.join(workdir, f"{name}.json")]
  write_atomically(paths[0], format_markdown(rows))
  write_atomically(paths[1], json.dumps(_without_nan(rows), indent=2))
  return paths


def write_routing_table(workdir: str, runs: Sequence[Any]) -> list[str]:
  """The sweep table collector: `<workdir>/routing.md` and `routing.json`, a row per run (an
  `paper_runner.collect.RunResult`) and MoE block, on the test split."""
  return _write_table(workdir, runs, "test", "routing")


def write_validation_routing_table(workdir: str, runs: Sequence[Any]) -> list[str]:
  """The same on the validation split: `<workdir>/routing_validation.md` and `.json`."""
  return _write_table(workdir, runs, "validation", "routing_validation")
