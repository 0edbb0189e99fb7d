"""A result that means nothing is said to mean nothing: an accuracy at the majority class's rate
(the report's `reference_check`), and the progress line's total loss against its task loss."""

import numpy as np

from fairmoe_jax.metrics import format_report, report_of_predictions
from fairmoe_jax.metrics.report import reference_check, wilson_interval
from trainkit.loop import loss_terms_note, progress_scalars

CLASSES = ("not_attractive", "attractive")


def _report(labels, predictions, groups):
  return report_of_predictions(
      labels, predictions, groups[:, None], ("Male",), (("no", "yes"),), num_classes=2
  )


def test_wilson_interval_matches_known_values():
  low, high = wilson_interval(55, 100)  # 0.55 of 100, z = 1.96: [0.4524, 0.6439] by hand.
  assert abs(low - 0.4524) < 1e-4 and abs(high - 0.6439) < 1e-4
  assert wilson_interval(0, 10)[0] == 0.0 and abs(wilson_interval(10, 10)[1] - 1.0) < 1e-12


def test_an_accuracy_at_the_majority_rate_is_flagged_in_the_report_and_the_console():
  # The CelebA sample's case: 55% accuracy on a few hundred test images whose majority class
  # is 52% of them. The interval of 55% over n=300 reaches 52%: nothing is learnt for sure, and
  # the fairness figures of a near-constant answer are not fairness.
  rng = np.random.default_rng(0)
  n = 300
  labels = (rng.random(n) < 0.48).astype(np.int32)  # class 0 is the majority
  groups = rng.integers(0, 2, n).astype(np.int32)
  predictions = labels.copy()
  wrong = rng.choice(n, int(0.45 * n), replace=False)
  predictions[wrong] = 1 - predictions[wrong]
  report = _report(labels, predictions, groups)
  check = reference_check(report["accuracy"], report["num_examples"], labels, CLASSES)
  majority = np.bincount(labels).max() / n
  assert check["majority_class"] == "not_attractive" and check["majority_rate"] == majority
  assert check["chance"] == 0.5 and check["accuracy_interval"][0] <= majority
  assert check["meaningful"] is False and "not meaningful" in check["reason"]
  report["meaningful"], report["reference_check"] = check["meaningful"], check
  text = format_report(report)
  warning = [line for line in text.splitlines() if "Warning: accuracy" in line]
  assert len(warning) == 1 and "majority-class rate" in warning[0]
  assert "MF (mean over 1 attributes): not meaningful" in text
  # Below the majority rate (a model that learnt the wrong thing) is flagged too.
  low = reference_check(0.40, 1000, np.r_[np.zeros(600), np.ones(400)].astype(int), CLASSES)
  assert low["meaningful"] is False and "is below the majority-class rate" in low["reason"]


def test_an_accuracy_clearly_above_the_majority_rate_is_meaningful():
  labels = np.r_[np.zeros(10_000), np.ones(10_000)].astype(int)
  check = reference_check(0.55, 20_000, labels, CLASSES)  # [0.543, 0.557] > 0.5
  assert check["meaningful"] is True and "reason" not in check
  report = _report(labels, labels, np.zeros(20_000, np.int32))
  report["meaningful"], report["reference_check"] = True, check
  assert "Warning: accuracy" not in format_report(report)
  assert "not meaningful" not in format_report(report)
  # Four balanced classes: chance (25%) is the bar when no class is more frequent.
  four = reference_check(0.27, 400, np.arange(400) % 4, ("a", "b", "c", "d"))
  assert four["chance"] == 0.25 and four["meaningful"] is False


def test_the_progress_line_names_its_total_loss_and_what_it_sums():
  logged = {
      "loss": 5.0,
      "loss/cross_entropy": 0.6,
      "loss/fairness": 0.1,
      "loss/specialization": 4.3,
      "learning_rate": 1e-3,
  }
  assert progress_scalars(logged) == {"total loss": 5.0, "task loss": 0.6, "lr": 1e-3}
  note = loss_terms_note(logged)
  assert note.startswith("total loss = cross_entropy (the task loss) + fairness + specialization;")
  # A run whose loss is its task loss alone needs no note.
  assert loss_terms_note({"loss": 1.0, "loss/cross_entropy": 1.0}) is None
  assert loss_terms_note({"loss": 1.0}) is None
