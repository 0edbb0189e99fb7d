"""Evaluation of a fair sparse-MoE image classifier: the jitted eval step and one pass over a
split (`evaluate`), with the split's fairness numbers, expert usage and FGR's SA readings.

What the eval step computes is declared by the model's outputs: each MoE block's
`RoutingReadings` and, for FGR routers, its `FairRoutingReadings`, read by field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from fairmoe_jax import data as data_lib
from fairmoe_jax.data.augment import normalize_on_device
from fairmoe_jax.methods import METHODS
from fairmoe_jax.metrics import attribute_counts, fairness_report, overall_counts
from fairmoe_jax.metrics import predictions as predictions_lib
from fairmoe_jax.moe.routers.fair import FairRoutingReadings
from trainkit.fits import check_eval_step
from trainkit.mesh import shard_batch, to_host
from trainkit.train_state import TrainState

# An SA classifier "beats the majority rate" when its accuracy exceeds it by more than this.
SA_MARGIN = 0.01


def make_eval_step(
    graphdef: nnx.GraphDef, info: data_lib.DatasetInfo, config: ml_collections.ConfigDict
):
  """Returns a jitted `eval_step(state, batch) -> counts`; counts add up over batches.

  With an `index` in the batch, the output also has per-example "examples", which do not add.
  The model sees only what its method reads at inference (`Method.eval_context`); the sensitive
  attributes are used here only to count per group.
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

    def group_usage(per_example: jax.Array) -> dict[str, Any]:
      fraction = per_example * batch["mask"][:, None]  # [B, E]
      return {
          "total": fraction.sum(0),
          "groups": [
              jax.nn.one_hot(batch["attributes"][:, i], size).T @ fraction  # [G_i, E]
              for i, size in enumerate(info.group_sizes)
          ],
      }

    for block, readings in aux.routing.items():
      dropped[block] = readings.fraction_dropped
      example_experts[block] = readings.expert_fraction
      usage.setdefault("choices", {})[block] = group_usage(readings.expert_fraction)
      if readings.gate_weight is not None:  # Token choice: the gates each expert received.
        usage.setdefault("gate_weight", {})[block] = group_usage(readings.gate_weight)
      if not isinstance(readings.router, FairRoutingReadings):
        continue
      fgr = readings.router
      for a, probs in enumerate(fgr.attribute_probs):
        # FGR's SA classifier of one attribute: is its per-example prediction the true group?
        truth = batch["attributes"][:, a]
        known = (truth >= 0) & (batch["mask"] > 0)
        hit = (jnp.argmax(probs, -1) == truth) & known
        sa_correct.setdefault(block, {})[a] = jnp.stack([hit.sum(), known.sum()])
      if fgr.sa_logit_moments is not None:  # Summed over examples: token moments of the split.
        sa_branch[block] = {
            "moments": jnp.einsum("b,bme->me", weight, fgr.sa_logit_moments),
            "examples": weight.sum(),
            "changed": jnp.sum(fgr.sa_choice_change * weight),
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
  """The running sum of an evaluation's counts, one program for the whole tree (leaf by leaf,
  every batch would dispatch dozens of adds)."""
  return jax.tree.map(jnp.add, totals, counts)


def eval_batches(
    arrays: dict[str, np.ndarray], config: ml_collections.ConfigDict, mesh: Mesh
) -> Iterator[dict[str, jax.Array]]:
  """The eval pipeline's batches of `arrays` (this process's share), sharded over `mesh`."""
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

  With MoE blocks the report has "expert_utilisation": per block, attribute and group, the
  fraction of the group's routed (token, choice) pairs that each expert served.
  """
  totals = None
  kept = []
  for batch in eval_batches(arrays, config, mesh):
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

  def per_group(blocks, value, skip_empty=False):  # {block: {attribute: {group: value(row)}}}
    return {
        block: {
            attribute: {
                group: value(row)
                for group, row in zip(groups, np.asarray(rows))
                if not skip_empty or row.sum() > 0
            }
            for attribute, groups, rows in zip(
                info.attribute_names, info.group_names, usage["groups"]
            )
        }
        for block, usage in blocks.items()
    }

  for kind, key in (("choices", "expert_utilisation"), ("gate_weight", "expert_gate_weight")):
    blocks = totals["expert_usage"].get(kind)
    if not blocks:
      continue
    report[key] = per_group(blocks, lambda row: (row / max(row.sum(), 1e-12)).round(6).tolist())
    report.setdefault("experts_active", {})[kind] = {
        block: effective_experts(np.asarray(usage["total"])) for block, usage in blocks.items()
    }
    # The same per group: a router whose groups each use one expert but different ones has
    # many experts active overall and one per group.
    report.setdefault("experts_active_by_group", {})[kind] = per_group(
        blocks, effective_experts, skip_empty=True
    )
  if "expert_utilisation" in report:
    # How far routing depends on the groups: the group whose choices are spread over the experts
    # most unlike the split's. FGR's SA branch is what would make it large (`route_by`).
    report["routing_by_group"] = {}
    for block, by_attribute in report["expert_utilisation"].items():
      divergence, group = group_divergence(
          np.asarray(totals["expert_usage"]["choices"][block]["total"]), by_attribute
      )
      report["routing_by_group"][block] = {"divergence": divergence, "group": group}
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


def group_divergence(
    split_share: Sequence[float], groups: Mapping[str, Mapping[str, Sequence[float]]]
) -> tuple[float, str]:
  """(the largest total-variation distance between a group's expert distribution and the
  split's, "attribute=group" of that group); `groups` is report["expert_utilisation"][block]."""
  split = np.asarray(split_share, np.float64)
  largest, where = 0.0, ""
  if split.sum() <= 0:  # No routed choice in the split: nothing to compare.
    return largest, where
  split = split / split.sum()
  for attribute, by_group in groups.items():
    for group, share in by_group.items():
      share = np.asarray(share, np.float64)
      if share.sum() <= 0:
        continue
      distance = 0.5 * float(np.abs(share / share.sum() - split).sum())
      if distance > largest or not where:
        largest, where = distance, f"{attribute}={group}"
  return largest, where


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
