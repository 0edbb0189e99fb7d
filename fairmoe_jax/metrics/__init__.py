"""Multi-attribute group-fairness metrics (PQD, DP, EOpp, EOdds and their MF means)."""

from fairmoe_jax.metrics.fairness import (
    METRIC_NAMES,
    AttributeFairness,
    attribute_counts,
    attribute_fairness,
    confusion_counts,
    demographic_parity,
    equal_opportunity,
    equalized_odds,
    multi_attribute_fairness,
    overall_accuracy,
    overall_counts,
    predictive_quality_disparity,
)
from fairmoe_jax.metrics.report import fairness_report, format_report, report_of_predictions

__all__ = [
    "METRIC_NAMES",
    "AttributeFairness",
    "attribute_counts",
    "attribute_fairness",
    "confusion_counts",
    "demographic_parity",
    "equal_opportunity",
    "equalized_odds",
    "fairness_report",
    "format_report",
    "multi_attribute_fairness",
    "overall_accuracy",
    "overall_counts",
    "predictive_quality_disparity",
    "report_of_predictions",
]
