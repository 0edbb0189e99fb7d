"""JSON-serialisable fairness report and a plain-text rendering of it.

Schema of ``fairness_report`` (python scalars only, so ``json.dumps`` works)::

    {"accuracy": float, "num_examples": int,
     "attributes": {NAME: {"pqd": float, "dp": float, "eopp": float, "eodds": float,
                           "groups": {GROUP: {"n": int, "accuracy": float}},
                           "empty_groups": [GROUP, ...],
                           "single_group": bool}},
     "mf": {"pqd": float, "dp": float, "eopp": float, "eodds": float},
     "mf_excluded": [NAME, ...]}  # only when an attribute has a single group

A run's report adds ``"meaningful"`` and ``"reference_check"`` (``reference_check``).
``groups`` holds the non-empty groups only (JSON has no portable NaN). An attribute with a
single group has no disparity to measure: it is left out of the ``mf`` means
(``fairness.multi_attribute_fairness``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fairmoe_jax.metrics.fairness import (
    METRIC_NAMES,
    attribute_counts,
    attribute_fairness,
    multi_attribute_fairness,
    overall_accuracy,
    overall_counts,
)

_METRIC_LABELS = {"pqd": "PQD", "dp": "DP", "eopp": "EOpp", "eodds": "EOdds"}


def _check_names(
    per_attribute: Sequence[np.ndarray],
    attribute_names: Sequence[str],
    group_names: Sequence[Sequence[str]],
) -> None:
  if not (len(per_attribute) == len(attribute_names) == len(group_names)):
    raise ValueError(
        f"got {len(per_attribute)} count tensors, {len(attribute_names)} attribute names "
        f"and {len(group_names)} group-name lists; they must match"
    )
  if len(set(attribute_names)) != len(attribute_names):
    raise ValueError(f"duplicate attribute names: {list(attribute_names)}")
  for name, counts, groups in zip(attribute_names, per_attribute, group_names):
    if len(groups) != np.shape(counts)[0]:
      raise ValueError(
          f"attribute {name!r}: {len(groups)} group names for {np.shape(counts)[0]} groups"
      )
    if len(set(groups)) != len(groups):
      raise ValueError(f"attribute {name!r}: duplicate group names {list(groups)}")


def fairness_report(
    overall: np.ndarray,
    per_attribute: Sequence[np.ndarray],
    attribute_names: Sequence[str],
    group_names: Sequence[Sequence[str]],
) -> dict[str, Any]:
  """Report dict (schema in the module docstring) from accumulated count tensors.

  ``overall`` is ``overall_counts``'s [C, C]; ``per_attribute[i]`` attribute i's [G_i, C, C].
  """
  _check_names(per_attribute, attribute_names, group_names)
  accuracy, num_examples = overall_accuracy(np.asarray(overall))

  results = [attribute_fairness(np.asarray(c)) for c in per_attribute]
  attributes: dict[str, Any] = {}
  for name, groups, res in zip(attribute_names, group_names, results):
    entry: dict[str, Any] = {m: float(getattr(res, m)) for m in METRIC_NAMES}
    entry["groups"] = {
        str(g): {"n": int(n), "accuracy": float(acc)}
        for g, n, acc in zip(groups, res.group_n, res.group_accuracy)
        if n > 0
    }
    entry["empty_groups"] = [str(groups[i]) for i in res.empty_groups]
    entry["single_group"] = not res.measurable
    attributes[str(name)] = entry

  report = {
      "accuracy": float(accuracy),
      "num_examples": int(num_examples),
      "attributes": attributes,
      "mf": multi_attribute_fairness(results),
  }
  excluded = [str(name) for name, res in zip(attribute_names, results) if not res.measurable]
  if excluded:
    report["mf_excluded"] = excluded
  return report


def report_of_predictions(
    labels: np.ndarray,
    predictions: np.ndarray,
    attributes: np.ndarray,
    attribute_names: Sequence[str],
    group_names: Sequence[Sequence[str]],
    num_classes: int,
) -> dict[str, Any]:
  """``fairness_report`` of whole-split numpy predictions (a reader that needs no model: the
  majority class, the synthetic data's corner marker), counted by the evaluation's own code."""
  mask = np.ones(len(labels), np.float32)
  group_sizes = tuple(len(groups) for groups in group_names)
  overall = overall_counts(labels, predictions, mask, num_classes=num_classes)
  per_attribute = attribute_counts(
      labels, predictions, attributes, mask, group_sizes=group_sizes, num_classes=num_classes
  )
  return fairness_report(
      np.asarray(overall), [np.asarray(c) for c in per_attribute], attribute_names, group_names
  )


# The two-sided 95% normal quantile of `wilson_interval`.
_Z95 = 1.959963984540054


def wilson_interval(successes: float, n: int, z: float = _Z95) -> tuple[float, float]:
  """Wilson's score interval of a binomial proportion (95% by default): right at 0 and 1 and
  for small n, where the normal interval is not."""
  if n <= 0:
    return 0.0, 1.0
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return float(max(centre - half, 0.0)), float(min(centre + half, 1.0))


def reference_check(
    accuracy: float, num_examples: int, labels: np.ndarray, class_names: Sequence[str]
) -> dict[str, Any]:
  """Whether an accuracy means anything: is it above what answering without looking scores?

  The bar is the higher of the split's own majority-class rate and chance (1 / classes); the
  accuracy's 95% Wilson interval must lie above it. Otherwise the fairness figures measure a
  constant answer's group mix or noise: `"meaningful": False` with a `"reason"`.
  """
  counts = np.bincount(np.asarray(labels, np.int64), minlength=len(class_names))
  majority = int(np.argmax(counts))
  rate = float(counts[majority] / max(counts.sum(), 1))
  chance = 1.0 / len(class_names)
  low, high = wilson_interval(accuracy * num_examples, num_examples)
  bar = max(rate, chance)
  check = {
      "meaningful": bool(low > bar),
      "accuracy_interval": [low, high],
      "num_examples": int(num_examples),
      "majority_class": str(class_names[majority]),
      "majority_rate": rate,
      "chance": chance,
  }
  if not check["meaningful"]:
    where = "below" if high < bar else "not clearly above"
    reference = (
        f"the majority-class rate {100 * rate:.2f}% (always '{class_names[majority]}'; chance "
        f"{100 * chance:.1f}%)"
        if rate >= chance
        else f"chance {100 * chance:.1f}%"
    )
    check["reason"] = (
        f"accuracy {100 * accuracy:.2f}% (95% interval [{100 * low:.1f}%, {100 * high:.1f}%], "
        f"n={num_examples}) is {where} {reference}: the model may have "
        "learnt nothing, so its fairness figures are not meaningful"
    )
  return check


def _metric_line(metrics: dict[str, Any]) -> str:
  return "   ".join(f"{_METRIC_LABELS[m]} {metrics[m]:.4f}" for m in METRIC_NAMES)


def _intersection_lines(name: str, entry: dict[str, Any]) -> list[str]:
  """Table of one entry of ``intersections.intersection_report``."""
  groups = entry["groups"]
  small = set(entry["small_groups"])
  with_all = sum(v["n"] for v in groups.values())
  lines = [f"[{name}]  (intersection; {with_all} examples with all of its attributes)"]
  if not groups:
    return lines + ["  no example has all of these attributes"]
  width = max(len(g) for g in ["group", *groups])
  n_width = max([len("n"), *(len(str(v["n"])) for v in groups.values())])
  lines.append(f"  {'group':<{width}}  {'n':>{n_width}}  {'accuracy':>8}")
  for g, v in groups.items():
    flag = f"  small (n < {entry['min_group_size']})" if g in small else ""
    lines.append(f"  {g:<{width}}  {v['n']:>{n_width}}  {100.0 * v['accuracy']:>7.2f}%{flag}")
  if entry["empty_groups"]:
    lines.append(f"  {len(entry['empty_groups'])} empty group(s) (excluded)")
  lines.append(f"  all {len(groups)} groups:  {_metric_line(entry)}")
  if small:
    kept = entry["without_small_groups"]
    if kept["num_groups"] < 2:
      left = kept["num_groups"]
      lines.append(f"  without the {len(small)} small: {left} group(s) left, nothing to compare")
    else:
      lines.append(
          f"  without the {len(small)} small:  {_metric_line(kept)}   ({kept['num_groups']} groups)"
      )
  return lines


def format_report(report: dict[str, Any]) -> str:
  """Plain-text table of a ``fairness_report`` dict."""
  lines = [
      "Fairness report",
      f"  accuracy {100.0 * report['accuracy']:.2f}%   examples {report['num_examples']}",
  ]
  check = report.get("reference_check", {})
  if check and not check["meaningful"]:
    lines.append(f"  Warning: {check['reason']}")
  for name, attr in report["attributes"].items():
    groups = attr["groups"]
    width = max(len(g) for g in ["group", *groups])
    n_width = max([len("n"), *(len(str(v["n"])) for v in groups.values())])
    with_attribute = sum(v["n"] for v in groups.values())
    lines += ["", f"[{name}]  ({with_attribute} examples with this attribute)"]
    lines.append(f"  {'group':<{width}}  {'n':>{n_width}}  {'accuracy':>8}")
    for g, v in groups.items():
      lines.append(f"  {g:<{width}}  {v['n']:>{n_width}}  {100.0 * v['accuracy']:>7.2f}%")
    if attr["empty_groups"]:
      lines.append(f"  empty groups (excluded): {', '.join(attr['empty_groups'])}")
    if attr.get("single_group"):
      lines.append(
          "  Warning: one group only in this split, so no disparity can be measured (PQD 1, DP 0 "
          "by definition); left out of the MF averages"
      )
    lines.append(f"  {_metric_line(attr)}")
  num_attributes = len(report["attributes"])
  excluded = report.get("mf_excluded", [])
  measured = num_attributes - len(excluded)
  if not excluded:
    heading = f"MF (mean over {num_attributes} attributes)"
  elif measured:
    heading = (
        f"MF (mean over {measured} of {num_attributes} attributes; left out, one group only: "
        f"{', '.join(excluded)})"
    )
  else:
    heading = (
        f"MF (mean over {num_attributes} attributes, none of which has two groups here: no "
        "disparity is measured)"
    )
  if check and not check["meaningful"]:
    heading += ": not meaningful, the accuracy is not above the majority class's (see above)"
  lines += ["", heading, f"  {_metric_line(report['mf'])}"]
  for name, entry in report.get("intersections", {}).items():
    lines += ["", *_intersection_lines(name, entry)]
  if "experts_per_attribute" in report:
    counts = ", ".join(f"{k} {v}" for k, v in report["experts_per_attribute"].items())
    reviews = len(report.get("allocation_history", []))
    lines.append(f"Experts per attribute after {reviews} expert-management reviews: {counts}")
    if "allocation_note" in report:
      lines.append(f"  {report['allocation_note']}")
  for kind, blocks in report.get("experts_active", {}).items():
    active = ", ".join(f"{block} {value:.2f}" for block, value in blocks.items())
    lines.append(f"Experts active (exp entropy of the test-set {kind.replace('_', ' ')}): {active}")
  if (
      report.get("fraction_dropped") and "dropped" in report
  ):  # MoE blocks: their capacity drops (token, choice) pairs.
    train = report["dropped"]["train"]
    lines.append(
        "Dropped (token, choice) pairs, over the experts' capacity: training "
        + ("not logged" if train is None else f"{100 * train:.1f}%")
        + f", test {100 * report['dropped']['test']:.1f}% (moe.eval_capacity_factor)"
    )
  for block, by_group in report.get("routing_by_group", {}).items():
    if not by_group["group"]:  # No group had a routed choice.
      continue
    lines.append(
        f"Routing by group ({block}): the group routed least like the split is "
        f"{by_group['group']}, {100 * by_group['divergence']:.1f}% of its choices away "
        "(total-variation distance; 0 = every group routed alike)"
    )
  for block, classifiers in report.get("sa_classifiers", {}).items():
    scores = ", ".join(
        f"{name} {100 * c['accuracy']:.1f}% (majority {100 * c['majority_rate']:.1f}%)"
        for name, c in classifiers.items()
    )
    lines.append(f"FGR's sensitive-attribute classifiers ({block}): {scores}")
  for block, branch in report.get("sa_branch", {}).items():
    lines.append(
        f"FGR's SA branch ({block}): {100 * branch['variance_share']:.2f}% of the routing "
        f"logits' variance over tokens; replacing it by its mean changes "
        f"{100 * branch['choices_changed']:.2f}% of the tokens' top-k choices"
    )
  classifiers = [c for b in report.get("sa_classifiers", {}).values() for c in b.values()]
  if classifiers and not any(c["above_majority"] for c in classifiers):
    # Under the default route_by=predicted this is what Eq. 7 asks of the router's features;
    # the label reading routes by group whatever the classifiers learn (docs/design.md).
    if "note" in report:  # route_by=label: the SA branch read the labels, not the classifiers.
      lines.append(
          "Note: FGR's sensitive-attribute classifiers do not beat the majority rate; under "
          "route_by=label the SA branch votes by each image's true group, not by them."
      )
    else:  # route_by=predicted: the model read no sensitive label.
      lines.append(
          "Note: FGR's sensitive-attribute classifiers do not beat the majority rate, so the SA "
          "branch adds the same vote for every group: Eq. 7's confusion loss has hidden the "
          "groups from the router's features, as it intends."
      )
      lines.append(
          "  FGR routes by each image's own group only when it is given the group: "
          "--config.fair.route_by=label (reads the sensitive labels, also at test time; "
          'docs/report.md, "What the quickstart shows").'
      )
  for change in report.get("fem_changes", []):
    # Training moves the shares too: "moved" is necessary for a change to matter, not proof.
    experts = ", ".join(str(e) for e in change["experts"])
    line = (
        f"FEM at step {change['step']}: {change['change']} {change['attribute']} (expert {experts})"
    )
    if change.get("usage_changed") is not None:
      moved = "moved" if change["usage_changed"] else "did not move: routing ignored the change"
      line += (
          f"; its share of the validation choices {100 * change['share_before']:.1f}% -> "
          f"{100 * change['share_after']:.1f}% ({moved})"
      )
    lines.append(line)
  if "fem_reading" in report:
    lines.append(report["fem_reading"])
  if "note" in report:
    lines.append(f"Note: {report['note']}")
  if report.get("method", "").startswith("fairsmoe"):
    base = report.get("baseline")
    if base:  # The record's own run: same data, size, steps and seed (fairmoe_jax.report).
      lines += [
          "",
          f"Vanilla SMoE on the same data, size, steps and seed (one run, {base['date']}, jax "
          f"{base['jax']}, {base['machine']}; {base['record']}):",
          f"  {base['command']}",
          f"  accuracy {100 * base['accuracy']:.2f}% (this run {100 * report['accuracy']:.2f}%), "
          f"MF-PQD {base['mf']['pqd']:.3f} ({report['mf']['pqd']:.3f}), MF-DP "
          f"{base['mf']['dp']:.3f} ({report['mf']['dp']:.3f})",
          "More seeds and the other baselines, with intervals:",
      ]
    else:
      lines += [
          "",
          f"Method {report['method']}: no vanilla SMoE record matches this run's data, size, "
          "steps and seed (the quickstart's has one); to see the baselines it improves on, run",
      ]
    lines.append(
        "  python -m paper_runner.fairmoe.compare --methods=fairsmoe,vanilla_smoe,muffin,multifair "
        "--config=<config> --workdir=<dir>"
    )
  return "\n".join(lines)
