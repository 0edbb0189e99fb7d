"""The report of a fair sparse-MoE run (report.json, predictions.csv, plots): the test split's
`evaluation.evaluate`, with the method, intersections, FEM's allocation history, the
validation split's headline numbers, the gradient cosines and one number per mechanism.
"""

from __future__ import annotations

import importlib.resources
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from fairmoe_jax import evaluation
from fairmoe_jax.fairness import experts as experts_lib
from fairmoe_jax.fairness.surrogates import review_metric
from fairmoe_jax.methods import METHODS
from fairmoe_jax.metrics import format_report
from fairmoe_jax.metrics import intersections as intersections_lib
from fairmoe_jax.metrics import predictions as predictions_lib
from fairmoe_jax.metrics.gradients import gradient_cosines
from fairmoe_jax.metrics.report import reference_check
from trainkit import config as cfg
from trainkit import storage
from trainkit.errors import ConfigError
from trainkit.metric_writers import log_exists, read_metrics
from trainkit.storage import write_atomically
from trainkit.train_state import TrainState


def summary_scalars(report: dict[str, Any], prefix: str) -> dict[str, float]:
  """A report's headline numbers as `<prefix>/<name>` scalars for metrics.jsonl."""
  scalars = {f"{prefix}/accuracy": report["accuracy"], f"{prefix}/loss": report["loss"]}
  scalars.update({f"{prefix}/mf_{k}": v for k, v in report["mf"].items()})
  for name, attr in report["attributes"].items():
    scalars.update({f"{prefix}/{name}/{k}": attr[k] for k in ("pqd", "dp")})
  return scalars


def mechanism_summary(report: dict[str, Any]) -> dict[str, float | None]:
  """One number per FairSMoE mechanism, for tables across runs (None where a method lacks it).

  "sa_above_majority": the fraction of SA classifiers that beat their majority rate;
  "sa_variance_share", "sa_choices_changed": `sa_branch_report`'s, averaged over MoE blocks;
  "fem_changes": how many allocation changes the run made; "fem_changes_moved": the fraction of
  them after which their experts' share of the validation choices moved (`fem_changes`).
  """
  classifiers = [c for b in report.get("sa_classifiers", {}).values() for c in b.values()]
  branches = list(report.get("sa_branch", {}).values())
  changes = report.get("fem_changes")
  judged = [c["usage_changed"] for c in changes or () if "usage_changed" in c]

  def mean(values):
    return float(np.mean(values)) if len(values) else None

  return {
      "sa_above_majority": mean([c["above_majority"] for c in classifiers]),
      "sa_variance_share": mean([b["variance_share"] for b in branches]),
      "sa_choices_changed": mean([b["choices_changed"] for b in branches]),
      "fem_changes": None if changes is None else len(changes),
      "fem_changes_moved": mean(judged),
  }


def dropped_summary(
    report: dict[str, Any], records: list[dict[str, Any]] | None
) -> dict[str, float | None]:
  """The fraction of (token, choice) pairs the MoE blocks dropped, averaged over blocks.

  "train": over the logged training steps (None when nothing was logged); "test": over the test
  batches at `moe.eval_capacity_factor`. Both 0.0 without MoE blocks.
  """
  test = list(report.get("fraction_dropped", {}).values())
  train = None
  if records is not None:
    logged = [
        value
        for record in records
        for key, value in record.items()
        if key.endswith("/fraction_dropped")
        and not key.startswith(("val/", "test/"))
        and isinstance(value, (int, float))
    ]
    train = float(np.mean(logged)) if logged else (0.0 if not test else None)
  return {"train": train, "test": float(np.mean(test)) if test else 0.0}


# The validation pass's routing measures that the report keeps beside the test split's.
VALIDATION_ROUTING_KEYS = (
    "expert_share",
    "expert_utilisation",
    "experts_active",
    "fraction_dropped",
)


# Vanilla SMoE on the quickstart's data, size, steps and seed (one run, its command inside): a
# FairSMoE run of the same settings prints it beside its own figures. The package ships a copy of
# the record, so that a run needs no checkout (tests/fairmoe_jax checks that the two are equal).
BASELINE_RECORD = "results/records/quickstart_vanilla_smoe.json"


def matching_baseline(config: ml_collections.ConfigDict) -> dict[str, Any] | None:
  """The vanilla SMoE record, without its settings, when `config` has all of them; else None."""
  shipped = importlib.resources.files("fairmoe_jax") / os.path.basename(BASELINE_RECORD)
  record = json.loads(shipped.read_text(encoding="utf-8"))
  try:
    if all(cfg.get(config, key) == value for key, value in record.pop("settings").items()):
      return {**record, "record": BASELINE_RECORD}
  except ConfigError:  # A key the config lacks.
    pass
  return None


# How a FEM change reaches routing under each reading of Eq. 8 (docs/design.md, "FEM and routing").
_FEM_MECHANISM = {
    "expert_competence": "FEM changes what its experts learn, never the router: routing follows "
    "only through the task loss",
    "attribute_routing": "FEM's allocation routes the tokens directly",
}


def fem_reading(report: dict[str, Any], specialization: str) -> str:
  """What FEM did, in one line read from the run's numbers: its changes, whether routing moved,
  an expert a change emptied (its share of the validation choices fell below a point), and the
  idle experts at the end (test split)."""
  changes, reviews = report.get("fem_changes", []), len(report.get("allocation_history", []))
  shares = np.mean(list(report["expert_share"]["choices"].values()), axis=0)
  idle = [
      f"expert {e} {100 * s:.1f}%" for e, s in enumerate(shares) if s < experts_lib.USAGE_CHANGE
  ]
  followed = [c for c in changes if c.get("usage_changed")]
  parts = [f"{len(changes)} change(s) in {reviews} reviews"]
  if changes:
    parts[0] += f", routing moved after {len(followed)}"
    if specialization in _FEM_MECHANISM:
      parts[0] += f" (under {specialization}, {_FEM_MECHANISM[specialization]})"
  parts += [
      f"expert {', '.join(map(str, c['experts']))} emptied by FEM's move: {c['attribute']} "
      f"{'gained' if c['change'] == 'grow' else 'lost'} it at step {c['step']}, and its share of "
      f"the validation choices fell {100 * c['share_before']:.1f}% -> {100 * c['share_after']:.1f}%"
      for c in followed
      if c["share_after"] < experts_lib.USAGE_CHANGE <= c["share_before"]
  ]
  parts.append(
      f"at the end {len(shares) - len(idle)} of {len(shares)} experts serve 1% or more of the "
      "test choices" + (f" (idle: {', '.join(idle)})" if idle else "")
  )
  return "FEM's reading: " + "; ".join(parts)


def final_report(
    eval_step,
    graphdef,
    state,
    splits,
    info,
    config,
    mesh,
    workdir: str | None = None,
    validate: Callable[[TrainState], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """The test report and the columns of predictions.csv (`metrics/predictions.py`).

  `validate(state)`, when given, is the training loop's validation pass (which may already have
  evaluated this step); otherwise the validation split is evaluated here.
  """
  test = splits["test"]
  report, examples = evaluation.evaluate(
      eval_step, state, test, info, config, mesh, keep_examples=True
  )
  columns = predictions_lib.prediction_columns(examples, test, info)
  report["class_names"] = list(info.class_names)
  # Below answering without looking, the fairness figures say nothing (reference_check).
  check = reference_check(
      report["accuracy"], report["num_examples"], columns["label"], info.class_names
  )
  report["meaningful"] = check["meaningful"]
  report["reference_check"] = check
  intersections = intersections_lib.parse_intersections(config.eval.intersections)
  if intersections:
    report["intersections"] = intersections_lib.intersection_report(
        columns["label"],
        columns["prediction"],
        np.asarray(test["attributes"])[examples["index"]],
        attribute_names=info.attribute_names,
        group_names=info.group_names,
        intersections=intersections,
        num_classes=info.num_classes,
        min_group_size=config.eval.min_group_size,
    )
  report["step"] = int(state.step)
  report["method"] = config.method
  if METHODS[config.method].eval_context(config, splits["test"]) is not None:
    report["note"] = (
        "route_by=label: the model read the true sensitive attributes of the test images "
        "(a training-time study, not deployable inference)"
    )
  # Only process 0 writes metrics.jsonl; the report is written by it alone.
  logged = workdir and log_exists(storage.join(workdir, "metrics.jsonl"))
  records = read_metrics(workdir) if logged else None
  if "fem" in state.extra:
    counts = np.asarray(jax.device_get(state.extra["fem"]["counts"]))
    report["experts_per_attribute"] = dict(zip(info.attribute_names, counts.tolist()))
    history = experts_lib.allocation_history(records, info.attribute_names) if records else []
    report["allocation_history"] = history
    initial = experts_lib.initial_state(info.num_attributes)["counts"].tolist()
    if not any(list(entry["experts"].values()) != initial for entry in history):
      report["allocation_note"] = (
          f"{len(history)} review(s) of the expert allocation "
          f"(fair.review_every_steps={config.fair.review_every_steps}); no attribute changed its "
          "experts: growth needs SF_a to hold for fair.patience reviews in a row"
      )
  # The validation split's headline numbers beside the test's: what a protocol that chooses on
  # validation reads (docs/protocol.md); the test numbers are for reporting only.
  validation = None
  if len(splits["val"]["label"]):  # An evaluation on another copy may have no validation rows.
    if validate is None:
      validation, _ = evaluation.evaluate(eval_step, state, splits["val"], info, config, mesh)
    else:
      validation = validate(state)
    report["validation"] = {
        "accuracy": validation["accuracy"],
        "num_examples": validation["num_examples"],
        "mf": validation["mf"],
        # Routing too: a measurement that chooses a setting reads validation (analysis/routing.py).
        **{key: validation[key] for key in VALIDATION_ROUTING_KEYS if key in validation},
    }
  if "fem" in state.extra and records:
    # Did each FEM change reach routing? Its experts' share of the validation choices at the
    # review that decided it against the next review's (or this final validation pass's).
    shares = list((validation or {}).get("expert_share", {}).get("choices", {}).values())
    report["fem_changes"] = experts_lib.allocation_changes(
        records,
        info.attribute_names,
        config.moe.num_experts,
        final_share=np.mean(shares, axis=0).tolist() if shares else None,
    )
  if "fem_changes" in report and "expert_share" in report:
    report["fem_reading"] = fem_reading(report, config.fair.specialization)
  baseline = matching_baseline(config) if config.method.startswith("fairsmoe") else None
  if baseline:  # Vanilla SMoE's figures on this run's settings, for the console.
    report["baseline"] = baseline
  report["dropped"] = dropped_summary(report, records)
  report["mechanisms"] = mechanism_summary(report)
  batches = itertools.islice(
      evaluation.eval_batches(splits["val"], config, mesh), config.analysis_batches
  )
  cosines = gradient_cosines(
      graphdef,
      state.params,
      state.model_state,
      batches,
      attribute_names=info.attribute_names,
      group_sizes=info.group_sizes,
      # Each attribute's task is its surrogate of the metric FEM watches (PQD under pqd+dp).
      psi=review_metric(config.fair.psi),
  )
  if cosines:
    report["gradient_cosine"] = cosines
  return report, columns


def write_report(
    report: dict[str, Any], predictions: dict[str, np.ndarray], workdir: str, plots: bool = True
) -> None:
  """Writes report.json and predictions.csv, prints the report and draws the plots (`plots`)."""
  # Each file is replaced whole or not at all: a crash mid-write never tears the earlier one.
  write_atomically(storage.join(workdir, "report.json"), json.dumps(report, indent=2))
  predictions_lib.write_csv(storage.join(workdir, "predictions.csv"), predictions)
  print(format_report(report), flush=True)
  if not plots:
    return
  # Imported here: matplotlib costs a second at start-up, which a run that fails early never needs.
  from fairmoe_jax.analysis import write_plots  # pylint: disable=g-import-not-at-top

  plots = write_plots(workdir)
  shown = ", ".join(storage.relpath(p, workdir) for p in plots)
  print(f"Plots: {shown} in {workdir}", flush=True)
