r"""Statistics of the built-in generated datasets: the numbers in docs/dataset.md.

  python scripts/synthetic_stats.py --seed=0 [--dataset=synthetic_testbed] [--output=x.json]
  python scripts/synthetic_stats.py --seed=0 --workdir=/tmp/qs_seed0

Group sizes and P(y | group) beside the generator's; how often the corner marker shows the true
class, scored as a classifier with the repository's metrics; the lesion-tint oracle
(synthetic_testbed); a logistic regression on 8x8 pixels. With ``--workdir`` (a finished run on
the same data), that model's accuracy when the marker agrees and disagrees with the label.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special

from fairmoe_jax import data as data_lib
from fairmoe_jax.data import synthetic, synthetic_testbed
from fairmoe_jax.metrics import format_report, report_of_predictions

Split = dict[str, np.ndarray]


def group_sizes(split: Split, info: data_lib.DatasetInfo) -> dict[str, dict[str, int]]:
  """``{attribute: {group: n}}`` for one split (missing values, -1, are not counted)."""
  return {
      name: {g: int(np.sum(split["attributes"][:, i] == j)) for j, g in enumerate(groups)}
      for i, (name, groups) in enumerate(zip(info.attribute_names, info.group_names))
  }


def _expected_label_probs(num_classes: int) -> dict[str, np.ndarray]:
  """Generator's P(y | group) per attribute, [G, K], marginalised over the other attribute."""
  probs = synthetic.label_probs(num_classes)  # [age, site, K]
  age_freq, site_freq = np.asarray(synthetic.AGE_FREQ), np.asarray(synthetic.SITE_FREQ)
  by_age = np.einsum("ask,s->ak", probs, site_freq)
  by_site = np.einsum("ask,a->sk", probs, age_freq)
  overall = age_freq @ by_age
  # Sex does not enter the label distribution.
  by_sex = np.tile(overall, (len(synthetic.SEX_GROUPS), 1))
  return {"all": overall, "sex": by_sex, "age": by_age, "site": by_site}


def label_frequencies(split: Split, info: data_lib.DatasetInfo) -> dict[str, Any]:
  """Measured and expected P(y | group) per attribute, plus the overall label frequencies."""
  k = info.num_classes
  labels, attrs = split["label"], split["attributes"]
  expected = _expected_label_probs(k)

  def freq(mask: np.ndarray) -> list[float]:
    return (np.bincount(labels[mask], minlength=k) / max(int(mask.sum()), 1)).tolist()

  result: dict[str, Any] = {
      "all": {"measured": freq(np.ones(len(labels), bool)), "expected": expected["all"].tolist()}
  }
  for i, (name, groups) in enumerate(zip(info.attribute_names, info.group_names)):
    result[name] = {
        g: {"measured": freq(attrs[:, i] == j), "expected": expected[name][j].tolist()}
        for j, g in enumerate(groups)
    }
  return result


def _report(
    labels: np.ndarray, predictions: np.ndarray, attributes: np.ndarray, info: data_lib.DatasetInfo
) -> dict[str, Any]:
  return report_of_predictions(
      labels, predictions, attributes, info.attribute_names, info.group_names, info.num_classes
  )


def _expected_agreement(split: Split, info: data_lib.DatasetInfo) -> dict[str, Any]:
  """Generator's P(marker = label) = p + (1 - p) / K, averaged over each group's examples."""
  sex, site = split["attributes"][:, 0], split["attributes"][:, 2]
  p = np.take(synthetic.SITE_CUE, site) * np.take(synthetic.SEX_CUE, sex)
  agree = p + (1 - p) / info.num_classes
  result: dict[str, Any] = {"all": float(agree.mean())}
  for i, (name, groups) in enumerate(zip(info.attribute_names, info.group_names)):
    col = split["attributes"][:, i]
    result[name] = {
        g: float(agree[col == j].mean()) for j, g in enumerate(groups) if np.any(col == j)
    }
  return result


def marker_agreement(split: Split, info: data_lib.DatasetInfo) -> dict[str, Any]:
  """Measured (from the images) and expected rate at which the marker shows the true class."""
  distances = np.sort(synthetic.marker_distances(split["image"], info.num_classes), axis=1)
  marker = synthetic.read_marker(split["image"], info.num_classes)
  nearest, second = float(distances[:, 0].max()), float(distances[:, 1].min())
  return {
      # The decoding is unambiguous when every marker is much closer to its nearest palette
      # colour than any marker is to its second nearest.
      "decoding": {"max_distance_to_nearest": nearest, "min_distance_to_second": second},
      "measured": _report(split["label"], marker, split["attributes"], info),
      "expected": _expected_agreement(split, info),
  }


def downsample(images: np.ndarray, side: int = 8) -> np.ndarray:
  """Mean-pools uint8 [N, S, S, 3] images to float64 [N, side * side * 3] features."""
  n, size = images.shape[0], images.shape[1]
  if size % side:
    raise ValueError(f"image size {size} is not a multiple of {side}")
  f = size // side
  pooled = images.astype(np.float64).reshape(n, side, f, side, f, 3).mean(axis=(2, 4))
  return pooled.reshape(n, -1)


def fit_logistic_regression(
    x: np.ndarray, y: np.ndarray, num_classes: int, *, l2: float
) -> np.ndarray:
  """Multinomial logistic regression; returns weights [D + 1, K].

  Minimises ``mean cross-entropy + l2 / 2 * |W|^2`` (the bias, the last row, is not penalised)
  with scipy's L-BFGS from zero weights: deterministic, and the minimum is unique for l2 > 0.
  ``x`` should be standardised.
  """
  n = x.shape[0]
  xb = np.concatenate([x, np.ones((n, 1))], axis=1)
  shape = (xb.shape[1], num_classes)
  onehot = np.eye(num_classes)[y]
  penalty = np.full((shape[0], 1), l2)
  penalty[-1] = 0.0

  def loss_and_grad(flat: np.ndarray) -> tuple[float, np.ndarray]:
    w = flat.reshape(shape)
    logits = xb @ w
    loss = np.mean(scipy.special.logsumexp(logits, axis=1) - logits[np.arange(n), y])
    grad = xb.T @ (scipy.special.softmax(logits, axis=1) - onehot) / n + penalty * w
    return loss + 0.5 * np.sum(penalty * w * w), grad.ravel()

  fit = scipy.optimize.minimize(loss_and_grad, np.zeros(shape).ravel(), jac=True, method="L-BFGS-B")
  return fit.x.reshape(shape)


def logistic_regression_baseline(
    train: Split, test: Split, info: data_lib.DatasetInfo, *, l2: float
) -> dict[str, Any]:
  """Trains on ``train`` (8x8 pixels); returns train accuracy, the test fairness report and the
  share of test images on which it predicts the class the marker shows."""
  x_train, x_test = downsample(train["image"]), downsample(test["image"])
  mean, std = x_train.mean(0), x_train.std(0) + 1e-6
  x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
  w = fit_logistic_regression(x_train, train["label"], info.num_classes, l2=l2)
  predict = lambda x: np.argmax(np.concatenate([x, np.ones((len(x), 1))], 1) @ w, axis=1)
  test_predictions = predict(x_test).astype(np.int32)
  marker = synthetic.read_marker(test["image"], info.num_classes)
  return {
      "features": f"8x8 mean-pooled pixels, {x_train.shape[1]} standardised features",
      "l2": l2,
      "train_accuracy": float(np.mean(predict(x_train) == train["label"])),
      "test": _report(test["label"], test_predictions, test["attributes"], info),
      "test_share_predicting_marker": float(np.mean(test_predictions == marker)),
  }


def oracle_reader(split: Split, info: data_lib.DatasetInfo) -> dict[str, Any]:
  """The fairness report of reading the class from the lesion's tint (synthetic_testbed)."""
  tint = synthetic_testbed.read_lesion_tint(split["image"], info.num_classes)
  return _report(split["label"], tint, split["attributes"], info)


def model_predictions(
    workdir: str, test: Split, expected_data: dict[str, Any]
) -> tuple[np.ndarray, int, np.ndarray]:
  """Test-split predictions, the step and the class probabilities of ``workdir``'s final
  checkpoint; exits if its ``config.data`` differs from ``expected_data`` in a key the latter has.
  """
  import fairmoe_jax

  with open(os.path.join(workdir, "config.json")) as f:
    trained_data = json.load(f)["data"]
  if trained_data.get("attribute_cues", False):
    # The images here have no tints: a model trained on tinted ones would be another model.
    raise SystemExit(
        f"{workdir} was trained on the data with attribute cues (data.attribute_cues, the "
        "quickstart's default); these statistics are of the data without them: train with "
        "--config=configs/quickstart.py:cues=false"
    )
  if any(trained_data.get(k) != v for k, v in expected_data.items()):
    raise SystemExit(
        f"{workdir} was trained on data {trained_data}, not on {expected_data}: "
        "pass the matching --seed and split sizes"
    )
  # The run's own predictor: it normalises the uint8 images inside its jitted step, and feeds
  # them in evaluation's batches.
  run = fairmoe_jax.load_run(workdir)
  probabilities = run.predict(test["image"]).probabilities
  return probabilities.argmax(-1).astype(np.int32), int(run.step), probabilities


def shortcut_use(predictions: np.ndarray, test: Split, num_classes: int) -> dict[str, float]:
  """Accuracy split by whether the marker agrees with the label, and marker-following errors."""
  labels = test["label"]
  marker = synthetic.read_marker(test["image"], num_classes)
  agrees, correct = marker == labels, predictions == labels
  wrong_on_disagreeing = ~agrees & ~correct
  return {
      "share_marker_agrees": float(agrees.mean()),
      "accuracy": float(correct.mean()),
      "accuracy_marker_agrees": float(correct[agrees].mean()),
      "accuracy_marker_disagrees": float(correct[~agrees].mean()),
      "errors_on_disagreeing": int(wrong_on_disagreeing.sum()),
      "share_of_those_predicting_marker": float(
          np.mean(predictions[wrong_on_disagreeing] == marker[wrong_on_disagreeing])
      ),
  }


def compute(
    *, seed: int, sizes: dict[str, int], dataset: str = "synthetic", workdir: str | None = None
) -> dict[str, Any]:
  """All statistics as a JSON-serialisable dict: 32x32 images, 4 classes, label frequencies of
  the training split, logistic regression with L2 penalty 1e-3."""
  image_size, num_classes, split, l2 = 32, 4, "train", 1e-3
  for needed in ("train", "test"):
    if needed not in sizes:
      raise ValueError(f"sizes must include a {needed!r} split, got {sorted(sizes)}")
  start = time.perf_counter()
  if dataset not in data_lib.GENERATED_INFO:
    raise ValueError(f"dataset must be one of {sorted(data_lib.GENERATED_INFO)}, got {dataset!r}")
  info, splits = data_lib.get_dataset(
      dataset, image_size=image_size, num_classes=num_classes, sizes=sizes, seed=seed
  )
  generation_seconds = time.perf_counter() - start
  # What a trained run's config.data must hold to have been trained on this data.
  data = dict(name=dataset, seed=seed, image_size=image_size, num_classes=num_classes)
  stats: dict[str, Any] = {
      "dataset": dict(data, sizes=dict(sizes), class_names=list(info.class_names)),
      "generation_seconds": generation_seconds,
      "nominal_frequencies": {
          "sex": list(synthetic.SEX_FREQ),
          "age": list(synthetic.AGE_FREQ),
          "site": list(synthetic.SITE_FREQ),
      },
      "group_sizes": {name: group_sizes(s, info) for name, s in splits.items()},
      "label_frequencies": {"split": split, **label_frequencies(splits[split], info)},
      "marker_agreement": {
          name: marker_agreement(splits[name], info) for name in ("train", "test")
      },
  }
  if dataset == synthetic_testbed.NAME:
    stats["oracle_reader"] = {name: oracle_reader(splits[name], info) for name in ("train", "test")}
  start = time.perf_counter()
  stats["logistic_regression"] = logistic_regression_baseline(
      splits["train"], splits["test"], info, l2=l2
  )
  stats["logistic_regression"]["seconds"] = time.perf_counter() - start
  if workdir is not None:
    predictions, step, _ = model_predictions(
        workdir, splits["test"], dict(data, test_size=sizes["test"])
    )
    use = shortcut_use(predictions, splits["test"], num_classes)
    stats["model"] = dict(workdir=workdir, step=step, **use)
  return stats


def _fmt_probs(values: list[float]) -> str:
  return " ".join(f"{v:.3f}" for v in values)


def format_stats(stats: dict[str, Any]) -> str:
  """Plain-text rendering of ``compute``'s result."""
  d = stats["dataset"]
  lines = [
      f"Dataset {d['name']}, seed {d['seed']}, {d['image_size']}x{d['image_size']}, "
      f"{d['num_classes']} classes, sizes {d['sizes']} "
      f"(generated in {stats['generation_seconds']:.2f} s)",
      "",
      "== Group sizes (nominal frequency in brackets)",
  ]
  split_names = list(stats["group_sizes"])
  for attr, nominal in stats["nominal_frequencies"].items():
    lines.append(f"[{attr}]  " + "  ".join(f"{s:>6}" for s in split_names))
    for j, g in enumerate(stats["group_sizes"][split_names[0]][attr]):
      counts = "  ".join(f"{stats['group_sizes'][s][attr][g]:>6}" for s in split_names)
      lines.append(f"  {g:<16} ({nominal[j]:.2f})  {counts}")

  lf = stats["label_frequencies"]
  majority = int(np.argmax(lf["all"]["measured"]))
  lines += [
      "",
      f"== Label frequencies P(y | group) on {lf['split']}: measured [expected]; "
      f"classes {', '.join(d['class_names'])}",
      f"  {'all':<16} {_fmt_probs(lf['all']['measured'])}  [{_fmt_probs(lf['all']['expected'])}]",
      f"  majority class {d['class_names'][majority]}: {lf['all']['measured'][majority]:.3f} "
      f"of {lf['split']} (the accuracy of always answering it)",
  ]
  for attr in stats["nominal_frequencies"]:
    lines.append(f"[{attr}]")
    for g, v in lf[attr].items():
      lines.append(f"  {g:<16} {_fmt_probs(v['measured'])}  [{_fmt_probs(v['expected'])}]")
  lines.append("")

  for split, ma in stats["marker_agreement"].items():
    measured, expected = ma["measured"], ma["expected"]
    lines += [
        f"== Marker shows the true class ({split}): measured from the images "
        "[expected from the generator's factors]",
        f"  (marker colour within {ma['decoding']['max_distance_to_nearest']:.1f} of its "
        f"palette colour, at least {ma['decoding']['min_distance_to_second']:.1f} from any other)",
        f"  {'all':<16} {measured['accuracy']:.3f}  [{expected['all']:.3f}]",
    ]
    for attr, entry in measured["attributes"].items():
      lines.append(f"[{attr}]  PQD of always following the marker: {entry['pqd']:.3f}")
      for g, v in entry["groups"].items():
        lines.append(f"  {g:<16} {v['accuracy']:.3f}  [{expected[attr][g]:.3f}]  n={v['n']}")
    lines.append("")

  for split, report in stats.get("oracle_reader", {}).items():
    # The accuracy gap across an attribute's groups: the largest minus the smallest.
    accuracies = {
        name: [g["accuracy"] for g in a["groups"].values()]
        for name, a in report["attributes"].items()
    }
    gaps = ", ".join(f"{name} {max(a) - min(a):.3f}" for name, a in accuracies.items())
    lines += [
        f"== Oracle reader ({split}): the class read from the lesion's tint",
        f"  accuracy gap across groups (max - min): {gaps}",
        format_report(report),
        "",
    ]
  lr = stats["logistic_regression"]
  lines += [
      f"== Logistic regression on {lr['features']}, l2 {lr['l2']:g} "
      f"({lr['seconds']:.1f} s): train accuracy {lr['train_accuracy']:.3f}; test:",
      format_report(lr["test"]),
      f"It predicts the class the marker shows on {lr['test_share_predicting_marker']:.3f} of the "
      "test images.",
  ]
  if "model" in stats:
    m = stats["model"]
    lines += [
        "",
        f"== Trained model in {m['workdir']} (step {m['step']}), test split",
        f"  accuracy {m['accuracy']:.3f}; marker agrees with the label on "
        f"{m['share_marker_agrees']:.3f} of the images",
        f"  accuracy where the marker agrees {m['accuracy_marker_agrees']:.3f}, "
        f"where it disagrees {m['accuracy_marker_disagrees']:.3f}",
        f"  errors on disagreeing images: {m['errors_on_disagreeing']}, of which "
        f"{m['share_of_those_predicting_marker']:.3f} predict the marker's class",
    ]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      "--dataset",
      default="synthetic",
      choices=sorted(data_lib.GENERATED_INFO),
      help="the generated dataset (default synthetic)",
  )
  parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
  for name, size in synthetic.DEFAULT_SIZES.items():
    parser.add_argument(f"--{name}-size", type=int, default=size, help=f"default {size}")
  parser.add_argument(
      "--workdir",
      help="a finished fairmoe_jax.main run on this dataset: "
      "also measure how much its model follows the marker",
  )
  parser.add_argument("--output", help="also write the statistics to this JSON file")
  args = parser.parse_args(argv)

  sizes = {name: getattr(args, f"{name}_size") for name in synthetic.DEFAULT_SIZES}
  stats = compute(seed=args.seed, dataset=args.dataset, sizes=sizes, workdir=args.workdir)
  print(format_stats(stats), flush=True)
  if args.output:
    with open(args.output, "w") as f:
      json.dump(stats, f, indent=2)
  return stats


if __name__ == "__main__":
  main(sys.argv[1:])
