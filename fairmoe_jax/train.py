"""Training and evaluation of a fair sparse-MoE image classifier.

`train_and_evaluate` is the whole recipe, top to bottom: data, model, state, then
`trainkit.recipe`'s resume and loop (the skeleton both packages share), then the fairness
report on the test split.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from fairmoe_jax import data as data_lib
from fairmoe_jax import export as export_lib
from fairmoe_jax import run_info as run_info_lib
from fairmoe_jax.data import images as images_lib
from fairmoe_jax.data.augment import normalize_on_device
from fairmoe_jax.metrics import attribute_counts, fairness_report, format_report, overall_counts
from fairmoe_jax.metrics import intersections as intersections_lib
from fairmoe_jax.metrics import predictions as predictions_lib
from fairmoe_jax.methods import METHODS, make_loss_fn as method_loss_fn
from fairmoe_jax.analysis import write_plots
from fairmoe_jax.fairness import experts as experts_lib
from trainkit import recipe
from trainkit.checkpoint import restore_trained
from trainkit.errors import ConfigError, UserError
from trainkit.fits import check_eval_step
from trainkit.mesh import place, shard_batch, to_host
from fairmoe_jax.metrics.gradients import gradient_cosines
from fairmoe_jax.fairness.surrogates import review_metric
from fairmoe_jax.models.convert_timm import export_timm_state_dict, load_timm_checkpoint
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.moe.layer import ATTRIBUTE_PROBS, SA_CHOICE_CHANGE, SA_LOGIT_MOMENTS
from trainkit import storage
from trainkit.mesh import replicated
from trainkit.metric_writers import read_metrics, write_atomically
from trainkit.train_state import TrainState, create_train_state
from trainkit.textfiles import iter_lines
from trainkit.workdir import RUN_INFO_FILE

# The key that locates each dataset read from disk.
_DATA_LOCATION_KEYS = {"celeba": "root", "isic2019": "root", "celeba_tfds": "tfds_data_dir"}


def load_data(
    config: ml_collections.ConfigDict,
) -> tuple[data_lib.DatasetInfo, dict[str, dict[str, np.ndarray]]]:
  """The dataset of `config.data`: its DatasetInfo and its splits.

  A data directory that is not there is a ConfigError naming the key to set: a trained
  workdir's config.json names the data where it was at training time, and it may have moved.
  """
  key = _DATA_LOCATION_KEYS.get(config.data.name)
  location = config.data[key] if key else ""
  if location and storage.is_remote(location) and config.data.name != "celeba_tfds":
    raise ConfigError(
        f"data.{key}",
        f"{location!r} is not on the local disk; the {config.data.name} reader reads a local "
        "directory (the workdir may be on gs://, the data is copied to each host)",
    )
  if location and not storage.is_remote(location) and not os.path.isdir(location):
    raise ConfigError(
        f"data.{key}",
        f"directory {location!r} does not exist; set --config.data.{key}=DIR to where the "
        f"{config.data.name} data is",
    )
  return data_lib.dataset_from_config(config.data)


def build_model(
    config: ml_collections.ConfigDict,
    info: data_lib.DatasetInfo,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
) -> nnx.Module:
  """The model of `config.method`, from a timm checkpoint when `model.pretrained` is set."""
  model = METHODS[config.method].build_model(config, info, rngs, mesh)
  if config.model.pretrained:
    load_pretrained(config, model)
  return model


def load_pretrained(config: ml_collections.ConfigDict, model: nnx.Module) -> None:
  """Loads `model.pretrained` (a timm checkpoint) into the backbone, keeping the shardings."""
  # Muffin's backbones each start from the checkpoint.
  for backbone in model.backbones if isinstance(model, Muffin) else [model]:
    for note in load_timm_checkpoint(backbone, config.model.pretrained):
      logging.info("%s", note)


def make_loss_fn(config: ml_collections.ConfigDict, info: data_lib.DatasetInfo):
  return method_loss_fn(METHODS[config.method], config, info)


# Per-example expert usage of each MoE block: the share of its (token, choice) pairs each expert
# served, and the mean gate weight each expert received (paper Figs. 2 and 5).
# An SA classifier "beats the majority rate" when its accuracy exceeds it by more than this.
SA_MARGIN = 0.01
USAGE_METRICS = {"example_expert_fraction": "choices", "example_gate_weight": "gate_weight"}


def make_eval_step(
    graphdef: nnx.GraphDef, info: data_lib.DatasetInfo, config: ml_collections.ConfigDict
):
  """Returns a jitted `eval_step(state, batch) -> counts`; counts add up over batches.

  For a batch with an `index` (the eval pipeline's), the output also has "examples": per-example
  index, prediction, class probabilities and each MoE block's expert fractions, which do not add.

  The model sees only what its method reads at inference (`Method.eval_context`): FairSMoE with
  the default `route_by=predicted` never sees the sensitive attributes. They are used here only
  to count, per group, the confusion matrices and each MoE block's expert usage.
  """
  method = METHODS[config.method]

  @jax.jit
  def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
    model = nnx.merge(graphdef, state.params, state.model_state)
    images = normalize_on_device(batch["image"], batch["mask"])
    logits, aux = model(images, train=False, context=method.eval_context(config, batch))
    predictions = jnp.argmax(logits, -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    usage, example_experts, dropped, sa_correct, sa_branch = {}, {}, {}, {}, {}
    weight = batch["mask"].astype(jnp.float32)
    for key, value in aux.metrics.items():
      block, _, metric = key.rpartition("/")
      if metric == "fraction_dropped":
        dropped[block] = value
      if metric == SA_LOGIT_MOMENTS:  # Summed over examples: token moments of the split.
        sa_branch.setdefault(block, {})["moments"] = jnp.einsum("b,bme->me", weight, value)
        sa_branch[block]["examples"] = weight.sum()
      if metric == SA_CHOICE_CHANGE:
        sa_branch.setdefault(block, {})["changed"] = jnp.sum(value * weight)
      if metric.startswith(ATTRIBUTE_PROBS):
        # FGR's SA classifier of one attribute: is its per-example prediction the true group?
        a = int(metric[len(ATTRIBUTE_PROBS) :])
        truth = batch["attributes"][:, a]
        known = (truth >= 0) & (batch["mask"] > 0)
        hit = (jnp.argmax(value, -1) == truth) & known
        sa_correct.setdefault(block, {})[a] = jnp.stack([hit.sum(), known.sum()])
      if metric not in USAGE_METRICS:
        continue
      if metric == "example_expert_fraction":
        example_experts[block] = value
      fraction = value * batch["mask"][:, None]  # [B, E]
      usage.setdefault(USAGE_METRICS[metric], {})[block] = {
          "total": fraction.sum(0),
          "groups": [
              jax.nn.one_hot(batch["attributes"][:, i], size).T @ fraction  # [G_i, E]
              for i, size in enumerate(info.group_sizes)
          ],
      }
    counts = {
        "overall": overall_counts(
            batch["label"], predictions, batch["mask"], num_classes=info.num_classes
        ),
        "attributes": attribute_counts(
            batch["label"],
            predictions,
            batch["attributes"],
            batch["mask"],
            group_sizes=info.group_sizes,
            num_classes=info.num_classes,
        ),
        "loss_sum": jnp.sum(ce * batch["mask"]),
        "expert_usage": usage,
        # Summed over batches, then divided by their count: the mean per-batch fraction.
        "fraction_dropped": dropped,
        "batches": jnp.ones((), jnp.int32),
        "sa_correct": sa_correct,
        "sa_branch": sa_branch,
    }
    if "index" in batch:
      counts["examples"] = {
          "index": batch["index"],
          "prediction": predictions,
          "probabilities": jax.nn.softmax(logits.astype(jnp.float32), -1),
          "experts": example_experts,
      }
    return counts

  return eval_step


@jax.jit
def _add_counts(totals: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
  """The running sum of an evaluation's counts, one program for the whole tree (added leaf by
  leaf, each count's shape compiles an `add` of its own and every batch dispatches dozens)."""
  return jax.tree.map(jnp.add, totals, counts)


def _eval_batches(arrays, config, mesh):
  for batch in data_lib.eval_batches(
      arrays,
      batch_size=config.eval_batch_size // jax.process_count(),
      image_size=config.data.image_size,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  ):
    yield shard_batch(batch, mesh)


def evaluate(
    eval_step,
    state: TrainState,
    arrays: dict[str, np.ndarray],
    info: data_lib.DatasetInfo,
    config: ml_collections.ConfigDict,
    mesh: Mesh,
    *,
    keep_examples: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """Runs one pass over a split: (the fairness report plus the mean loss, and with
  `keep_examples` the per-example outputs (`gather_examples`), else None).

  With MoE blocks the report has "expert_utilisation": per block, attribute and
  group, the fraction of the group's routed (token, choice) pairs that each expert
  served.
  """
  totals = None
  kept = []
  for batch in _eval_batches(arrays, config, mesh):
    if totals is None:  # Before the first batch runs: refuse a step that cannot fit.
      check_eval_step(eval_step, state, batch, config.eval_batch_size)
    counts = eval_step(state, batch)
    examples = counts.pop("examples", None)
    if keep_examples:
      kept.append(examples)  # Still on device: fetching now would stall the loop every batch.
    totals = counts if totals is None else _add_counts(totals, counts)
  totals = jax.device_get(totals)
  examples = None
  if keep_examples:
    # to_host gathers the other processes' rows (a collective, run by every process alike).
    examples = predictions_lib.gather_examples(
        [jax.tree.map(to_host, e) for e in kept], len(arrays["label"])
    )
  report = fairness_report(
      np.asarray(totals["overall"]),
      [np.asarray(c) for c in totals["attributes"]],
      info.attribute_names,
      info.group_names,
  )
  report["loss"] = float(totals["loss_sum"]) / max(report["num_examples"], 1)
  for kind, key in (("choices", "expert_utilisation"), ("gate_weight", "expert_gate_weight")):
    blocks = totals["expert_usage"].get(kind)
    if not blocks:
      continue
    report[key] = {
        block: {
            attribute: {
                group: (row / max(row.sum(), 1e-12)).round(6).tolist()
                for group, row in zip(groups, np.asarray(per_group))
            }
            for attribute, groups, per_group in zip(
                info.attribute_names, info.group_names, usage["groups"]
            )
        }
        for block, usage in blocks.items()
    }
    report.setdefault("experts_active", {})[kind] = {
        block: effective_experts(np.asarray(usage["total"])) for block, usage in blocks.items()
    }
    # The same per group: a router whose groups each use one expert but different ones has
    # many experts active overall and one per group.
    report.setdefault("experts_active_by_group", {})[kind] = {
        block: {
            attribute: {
                group: effective_experts(np.asarray(row))
                for group, row in zip(groups, np.asarray(per_group))
                if np.asarray(row).sum() > 0
            }
            for attribute, groups, per_group in zip(
                info.attribute_names, info.group_names, usage["groups"]
            )
        }
        for block, usage in blocks.items()
    }
  if totals["sa_correct"]:
    report["sa_classifiers"] = sa_classifier_report(totals["sa_correct"], report, info)
  if totals["sa_branch"]:
    report["sa_branch"] = sa_branch_report(totals["sa_branch"])
  for kind, blocks in totals["expert_usage"].items():
    # Each expert's share of the split's routing (choices or gate weight): what FEM's changes
    # are judged by (fem_changes).
    report.setdefault("expert_share", {})[kind] = {
        block: (np.asarray(u["total"]) / max(float(np.sum(u["total"])), 1e-12)).round(6).tolist()
        for block, u in blocks.items()
    }
  if totals["fraction_dropped"]:
    report["fraction_dropped"] = {
        block: float(value) / int(totals["batches"])
        for block, value in totals["fraction_dropped"].items()
    }
  return report, examples


def effective_experts(usage: np.ndarray) -> float:
  """exp(entropy) of an expert-usage distribution: 1 when one expert takes all, E when uniform."""
  p = usage / max(usage.sum(), 1e-12)
  p = p[p > 0]
  return float(np.exp(-np.sum(p * np.log(p)))) if p.size else 0.0


def _summary_scalars(report: dict[str, Any], prefix: str) -> dict[str, float]:
  scalars = {f"{prefix}/accuracy": report["accuracy"], f"{prefix}/loss": report["loss"]}
  scalars.update({f"{prefix}/mf_{k}": v for k, v in report["mf"].items()})
  for name, attr in report["attributes"].items():
    scalars.update({f"{prefix}/{name}/{k}": attr[k] for k in ("pqd", "dp")})
  return scalars


def sa_classifier_report(
    correct: dict[str, dict[int, np.ndarray]], report: dict[str, Any], info: data_lib.DatasetInfo
) -> dict[str, dict[str, dict[str, Any]]]:
  """Per MoE block and attribute: FGR's SA classifier's accuracy on the split, the majority
  rate (always answering the largest group) and whether the classifier beats it.

  A classifier at the majority rate gives every token the same routing vote whatever its
  group, so fairness-guided routing is then a learned constant bias (docs/design.md).
  """
  result: dict[str, dict[str, dict[str, Any]]] = {}
  for block, per_attribute in correct.items():
    for a, (hits, known) in per_attribute.items():
      name = info.attribute_names[a]
      sizes = [g["n"] for g in report["attributes"][name]["groups"].values()]
      if not sizes or not known:  # No example with this attribute known (e.g. predict mode).
        continue
      accuracy = float(hits) / float(known)
      majority = max(sizes) / max(sum(sizes), 1)
      result.setdefault(block, {})[name] = {
          "accuracy": accuracy,
          "majority_rate": majority,
          "above_majority": bool(accuracy > majority + SA_MARGIN),
      }
  return result


def sa_branch_report(totals: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
  """Per MoE block: how much of FGR's routing the SA branch decides.

  "variance_share": Var_tokens(sa) / (Var_tokens(sa) + Var_tokens(gate)), summed over experts,
  where the routing logits are gate + sa: 0 when the SA branch adds the same vote to every
  token (a constant bias), 1 when only it varies. "choices_changed": the fraction of tokens whose
  top-k set changes when sa is replaced by its batch mean.
  """
  result = {}
  for block, t in totals.items():
    examples = max(float(t["examples"]), 1.0)
    mean_sa, mean_sa2, mean_gate, mean_gate2 = np.asarray(t["moments"], np.float64) / examples
    var_sa = float(np.sum(np.maximum(mean_sa2 - mean_sa**2, 0.0)))
    var_gate = float(np.sum(np.maximum(mean_gate2 - mean_gate**2, 0.0)))
    result[block] = {
        "variance_share": var_sa / max(var_sa + var_gate, 1e-30),
        "sa_logit_std": float(np.sqrt(var_sa / len(mean_sa))),
        "gate_logit_std": float(np.sqrt(var_gate / len(mean_gate))),
        "choices_changed": float(t.get("changed", 0.0)) / examples,
    }
  return result


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

  "train": over the logged training steps (`records`, metrics.jsonl; None when nothing was
  logged); "test": over the test batches at `moe.eval_capacity_factor`. Both are 0.0 for a model
  without MoE blocks, so that a comparison of methods shows which of them lost tokens.
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

  The report has the method, the intersections of `eval.intersections`, the expert allocation,
  the validation split's headline numbers and the gradient cosines besides `evaluate`'s.
  `validate(state)`, when given, is the training loop's validation pass (which may already have
  evaluated this step); otherwise the validation split is evaluated here.
  """
  test = splits["test"]
  report, examples = evaluate(eval_step, state, test, info, config, mesh, keep_examples=True)
  columns = predictions_lib.prediction_columns(examples, test, info)
  report["class_names"] = list(info.class_names)
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
  logged = workdir and storage.path(storage.join(workdir, "metrics.jsonl")).exists()
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
      validation, _ = evaluate(eval_step, state, splits["val"], info, config, mesh)
    else:
      validation = validate(state)
    report["validation"] = {
        "accuracy": validation["accuracy"],
        "num_examples": validation["num_examples"],
        "mf": validation["mf"],
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
  report["dropped"] = dropped_summary(report, records)
  report["mechanisms"] = mechanism_summary(report)
  batches = itertools.islice(_eval_batches(splits["val"], config, mesh), config.analysis_batches)
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


def _write_report(report: dict[str, Any], predictions: dict[str, np.ndarray], workdir: str) -> None:
  # Each file is replaced whole or not at all: a crash mid-write never tears the earlier one.
  write_atomically(storage.join(workdir, "report.json"), json.dumps(report, indent=2))
  predictions_lib.write_csv(storage.join(workdir, "predictions.csv"), predictions)
  print(format_report(report), flush=True)
  plots = write_plots(workdir)
  shown = ", ".join(storage.relpath(p, workdir) for p in plots)
  print(f"Plots: {shown} in {workdir}", flush=True)


def create_state(
    config: ml_collections.ConfigDict,
    info: data_lib.DatasetInfo,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    pretrained: bool = True,
) -> tuple[nnx.GraphDef, TrainState]:
  """The initial train state of `config.method` on `mesh`.

  `pretrained=False` skips loading `model.pretrained`, for a state that a checkpoint's
  restore overwrites anyway (predict, export: the timm file need not be there).
  """
  load_weights = None
  if pretrained and config.model.pretrained:
    load_weights = functools.partial(load_pretrained, config)
  graphdef, state = create_train_state(
      lambda: METHODS[config.method].build_model(config, info, nnx.Rngs(params=config.seed), mesh),
      tx,
      mesh,
      config.seed,
      load_weights=load_weights,
  )
  extra = METHODS[config.method].initial_extra(config, info)
  if extra:  # Checkpointed with the run (e.g. FEM's allocator state).
    state = state.replace(extra=place(extra, replicated(mesh)))
  return graphdef, state


def _setup(
    config: ml_collections.ConfigDict, workdir: str, training: bool = True
) -> tuple[data_lib.DatasetInfo, dict[str, dict[str, np.ndarray]], recipe.Run]:
  info, splits = load_data(config)
  # Validation drives checkpoint-worthy evaluation and the test split the report: found empty
  # only after training, they would cost the whole run.
  needed = ("train", "val", "test") if training else ("test",)  # --mode=eval scores test only.
  empty = [name for name in needed if not len(splits[name]["label"])]
  if empty:
    raise UserError(
        f"data.name={config.data.name}: the {' and '.join(empty)} split(s) are empty "
        f"(load statistics: {info.load_stats}); check the partition/split file"
    )
  try:  # Checked before training: a wrong name would otherwise cost the whole run.
    intersections_lib.check_attributes(
        intersections_lib.parse_intersections(config.eval.intersections), info.attribute_names
    )
  except ValueError as e:
    raise ConfigError("eval.intersections", str(e)) from None
  run = recipe.setup(
      config,
      workdir,
      train_examples=len(splits["train"]["label"]),
      create_state=lambda tx, mesh: create_state(config, info, tx, mesh),
      training=training,
  )
  return info, splits, run


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Trains (resuming from the latest checkpoint in `workdir`), then evaluates on the test split.

  Returns the test report, or None when the run was stopped by SIGTERM.
  """
  info, splits, run = _setup(config, workdir)
  mesh = run.mesh
  train_iterator = data_lib.train_iterator(
      splits["train"],
      global_batch_size=config.batch_size,
      image_size=config.data.image_size,
      seed=config.seed,
      augment=config.data.augment.to_dict(),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      num_threads=config.data.num_threads,
      prefetch_buffer_size=config.data.prefetch_buffer_size,
      num_workers=config.data.num_workers,
      resampling=config.data.train_resampling,
  )
  if config.data.cache_eval_images:
    # Validated every eval_every_steps (and at each FEM review): decoded once here, not each time.
    splits["val"] = images_lib.preload_images(
        splits["val"], config.data.image_size, max(1, config.data.num_threads)
    )
  eval_step = make_eval_step(run.graphdef, info, config)
  last_validation: dict[int, dict[str, Any]] = {}

  def validate(state: TrainState) -> dict[str, Any]:
    # A step that is due for both evaluation and an expert review validates once.
    step = int(state.step)
    if step not in last_validation:
      last_validation.clear()
      last_validation[step], _ = evaluate(eval_step, state, splits["val"], info, config, mesh)
    return last_validation[step]

  review = METHODS[config.method].review(
      config, info, graphdef=run.graphdef, mesh=mesh, validate=validate
  )
  trained = recipe.train(
      run,
      train_iterator=train_iterator,
      loss_fn=make_loss_fn(config, info),
      # Patch tokens per image, the sequence the transformer (and the MoE) processes.
      tokens_per_example=(config.data.image_size // config.model.patch_size) ** 2,
      evaluate=lambda state: _summary_scalars(validate(state), "val"),
      reviews=[review] if review else [],
      # Class names and preprocessing: predict and export then need the workdir alone.
      run_info=run_info_lib.RunMetadata.from_dataset(info, config).to_json(),
  )
  if trained is None:
    return None
  report, predictions = final_report(
      eval_step, run.graphdef, trained.state, splits, info, config, mesh, workdir, validate
  )
  return recipe.finish(
      run,
      trained.state,
      report,
      writer=trained.writer,
      scalars=_summary_scalars(report, "test"),
      write_report=lambda report: _write_report(report, predictions, workdir),
  )


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Evaluates the latest readable checkpoint in `workdir` on the test split."""
  info, splits, run = _setup(config, workdir, training=False)
  state, _ = restore_trained(run.checkpointer, run.state)
  if run_info_lib.load(workdir) is None:  # A run trained before run_info.json was written.
    run_info_lib.RunMetadata.from_dataset(info, config).save(workdir)
  report, predictions = final_report(
      make_eval_step(run.graphdef, info, config),
      run.graphdef,
      state,
      splits,
      info,
      config,
      run.mesh,
      workdir,
  )
  return recipe.finish(
      run, state, report, write_report=lambda report: _write_report(report, predictions, workdir)
  )


@dataclasses.dataclass
class Restored:
  """A trained run's latest checkpoint, ready for inference (`restore_run`).

  Attributes:
    metadata: The run's class and attribute names and preprocessing (run_info.json).
    info: The same names as the DatasetInfo the model was built from.
    graphdef: The model's graph.
    state: The restored train state (params, model state, optimizer state, extras).
    mesh: The device mesh of `config.mesh` the state is placed on.
    step: The checkpoint's step; None when nothing was restored (`from_checkpoint=False`).
  """

  metadata: run_info_lib.RunMetadata
  info: data_lib.DatasetInfo
  graphdef: nnx.GraphDef
  state: TrainState
  mesh: Mesh
  step: int | None

  @property
  def model(self) -> nnx.Module:
    """The model with the restored parameters."""
    return nnx.merge(self.graphdef, self.state.params, self.state.model_state)


def run_metadata(config: ml_collections.ConfigDict, workdir: str) -> run_info_lib.RunMetadata:
  """The run's metadata from `<workdir>/run_info.json`; for a run trained before that file was
  written, from its dataset (which must then be where `data.*` says)."""
  metadata = run_info_lib.load(workdir)
  if metadata is None:
    try:
      info, _ = load_data(config)
    except UserError as e:
      raise UserError(
          f"{workdir} has no {RUN_INFO_FILE} (trained before it was written), so the class "
          f"names are read from the dataset, which failed: {e}"
      ) from None
    metadata = run_info_lib.RunMetadata.from_dataset(info, config)
  return metadata


def restore_run(
    config: ml_collections.ConfigDict, workdir: str, *, from_checkpoint: bool = True
) -> Restored:
  """The latest readable checkpoint of `workdir`, from the workdir alone (no dataset).

  With `from_checkpoint=False`, the state as initialised from `config` (from
  `model.pretrained` when set) instead. Raises UserError when there is no readable checkpoint.
  """
  metadata = run_metadata(config, workdir)
  info = metadata.dataset_info()
  run = recipe.setup(
      config,
      workdir,
      train_examples=0,  # num_train_steps is config.json's, resolved at training time.
      create_state=lambda tx, mesh: create_state(
          config, info, tx, mesh, pretrained=not from_checkpoint
      ),
      training=False,
  )
  state, step = run.state, None
  if from_checkpoint:
    state, step = restore_trained(run.checkpointer, state)
  else:
    run.checkpointer.close()
  return Restored(metadata, info, run.graphdef, state, run.mesh, step)


def load_model(
    config: ml_collections.ConfigDict, workdir: str, *, restore: bool = True
) -> tuple[nnx.Module, int | None]:
  """The model of the latest readable checkpoint in `workdir` and its step, or with
  `restore=False` the model as initialised from `config` (step None)."""
  restored = restore_run(config, workdir, from_checkpoint=restore)
  return restored.model, restored.step


EXPORT_FILE = os.path.join("export", export_lib.WEIGHTS_FILE)
EXPORT_CONFIG_FILE = os.path.join("export", export_lib.CONFIG_FILE)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def export_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes the latest checkpoint's parameters as a timm-named safetensors state dict.

  The file is `<workdir>/export/model.safetensors`: PyTorch layouts and timm names
  (`fairmoe_jax.models.convert_timm`; MoE experts stacked as `<block>.mlp.experts.*`, the
  router and FairSMoE's attribute branches under their own names), with the step, backbone
  and class names in its metadata. `load_timm_checkpoint(model, path, skip=())` loads it back.
  Beside it, `<workdir>/export/config.json` says which timm model it is, with what arguments
  and preprocessing, or why timm cannot load it (`fairmoe_jax.export`). Reads the workdir
  alone (config, run_info.json, checkpoint), not the dataset.
  """
  from safetensors.numpy import save  # Only this mode needs it.

  restored = restore_run(config, workdir)
  model = restored.model
  state = export_timm_state_dict(model)
  timm_config = export_lib.timm_config(model, state, config, restored.metadata, restored.step)
  path = storage.join(workdir, EXPORT_FILE)
  if jax.process_index() == 0:
    storage.makedirs(storage.join(workdir, os.path.dirname(EXPORT_FILE)))
    metadata = {
        "format": "timm",
        "step": str(restored.step),
        "method": config.method,
        "backbone": str(config.model.get("backbone", "")),
        "class_names": json.dumps(list(restored.metadata.class_names)),
        "config": config.to_json(),
    }
    write_atomically(path, save(state, metadata=metadata))
    if not storage.is_remote(path):
      # The temporary file behind an atomic write is private (mode 0600); the export is meant
      # to be shared like every other output of the run.
      os.chmod(path, 0o644 & ~_umask())
    write_atomically(storage.join(workdir, EXPORT_CONFIG_FILE), json.dumps(timm_config, indent=2))
    size = sum(v.nbytes for v in state.values())
    print(f"Exported step {restored.step} ({len(state)} tensors, {size / 2**20:.1f} MiB) to {path}")
    if timm_config["timm_loadable"]:
      print(
          f"timm: {timm_config['architecture']} with the model_args of "
          f"{storage.join(workdir, EXPORT_CONFIG_FILE)} (README, 'Loading an export into timm')"
      )
    else:
      print(
          f"Not loadable by timm: {timm_config['why_not_timm']}. Load it with "
          f"{export_lib.LOAD_OURS}."
      )
  return path


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
PREDICT_FILE = os.path.join("predict", "predictions.csv")


def predict_inputs(source: str) -> list[str]:
  """The image paths `predict.input` names: a folder's images (sorted), or a list file's lines."""
  if not source:
    raise ConfigError(
        "predict.input", "--mode=predict needs --config.predict.input=FOLDER_OR_LIST_FILE"
    )
  if os.path.isdir(source):
    paths = sorted(
        os.path.join(source, name)
        for name in os.listdir(source)
        if name.lower().endswith(IMAGE_SUFFIXES)
    )
    if not paths:
      raise ConfigError(
          "predict.input", f"folder {source} holds no image ({', '.join(IMAGE_SUFFIXES)})"
      )
    return paths
  folder = os.path.dirname(os.path.abspath(source))
  paths = []
  for _, line in iter_lines(source, "predict.input list"):
    if line.strip() and not line.lstrip().startswith("#"):
      paths.append(os.path.join(folder, line.strip()))  # Absolute paths stay as they are.
  if not paths:
    raise ConfigError("predict.input", f"list file {source} names no image")
  return paths


def check_predictable(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError when the method needs what unlabelled images lack (route_by=label)."""
  if METHODS[config.method].eval_context(config, {"attributes": None}) is not None:
    raise ConfigError(
        "fair.route_by",
        "'label' routes by the sensitive labels, which unlabelled images do not have; "
        "predict with a model trained with route_by=predicted",
    )


def predict_examples(
    restored: Restored,
    config: ml_collections.ConfigDict,
    images: np.ndarray,
    eval_step: Callable[..., Any] | None = None,
) -> dict[str, Any]:
  """Classifies unlabelled images as evaluation does (same batches, padding and eval step).

  Args:
    restored: The trained run (`restore_run`).
    config: Its config (eval_batch_size, image size, method).
    images: Image file paths (an object array [N]), or uint8 images [N, S, S, 3].
    eval_step: `make_eval_step(restored.graphdef, restored.info, config)`, to reuse its
      compilation over calls; None makes one.

  Returns:
    `gather_examples`' per-example outputs, in the order of `images`: `prediction` [N],
    `probabilities` [N, C] and `experts` {block: [N, E]}.
  """
  info = restored.info
  # Labels and attributes are placeholders the eval step needs in its batch; unread by the model.
  split = {
      "path" if images.dtype == object else "image": images,
      "label": np.zeros(len(images), np.int32),
      "attributes": np.full((len(images), len(info.attribute_names)), -1, np.int32),
  }
  _, examples = evaluate(
      eval_step or make_eval_step(restored.graphdef, info, config),
      restored.state,
      split,
      info,
      config,
      restored.mesh,
      keep_examples=True,
  )
  return examples


def predict_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Classifies `predict.input`'s images with the latest checkpoint.

  Writes `<workdir>/predict/predictions.csv`: per image its path, the predicted class (index and
  name), the class probabilities and, per MoE block and expert, the share of the image's
  (token, choice) pairs that expert served. No label or sensitive attribute is read, and
  neither is the dataset: the class names come from the workdir's run_info.json.
  """
  check_predictable(config)
  paths = predict_inputs(config.predict.input)
  restored = restore_run(config, workdir)
  examples = predict_examples(restored, config, np.array(paths, dtype=object))
  prediction = examples["prediction"]
  columns: dict[str, np.ndarray] = {
      "path": np.array(paths, dtype=object)[examples["index"]],
      "prediction": prediction,
      "class_name": np.array(restored.metadata.class_names, dtype=object)[prediction],
  }
  columns.update(predictions_lib.probability_columns(examples))
  columns.update(predictions_lib.expert_columns(examples))
  path = storage.join(workdir, PREDICT_FILE)
  if jax.process_index() == 0:
    storage.makedirs(storage.join(workdir, os.path.dirname(PREDICT_FILE)))
    predictions_lib.write_csv(path, columns)
    print(f"Predicted {len(paths)} images with the checkpoint of step {restored.step}: {path}")
  return path
