r"""One fairness report over the test predictions of several runs: the folds of a cross-validation.

  python -m fairmoe_jax.metrics.pooling /tmp/celeba_fold0 /tmp/celeba_fold1 ... [--output=FILE]

Under identity folds (docs/protocol.md) the k runs of one seed together predict every image
once; pooling scores each group on all its images, where one fold may hold a handful. The
confusion counts of all rows are added and scored as a run's own test report is. Runs must name
the same classes and attributes and no image twice.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from fairmoe_jax.metrics.report import format_report, report_of_predictions
from trainkit import storage
from trainkit.errors import UserError, exit_on_user_error
from trainkit.storage import write_atomically
from trainkit.workdir import read_json_object

PREDICTIONS_FILE = "predictions.csv"
# docs/protocol.md, section 3: a group under 50 examples in a reported split is flagged.
MIN_GROUP_SIZE = 50
REPORT_FILE = "report.json"


def read_report(run_dir: str) -> dict[str, Any]:
  """A finished run's report.json; a UserError names the file when it is missing or unreadable."""
  return read_json_object(storage.join(run_dir, REPORT_FILE), f"is {run_dir} a finished run?")


def _read_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
  """A run's report.json and the rows of its predictions.csv."""
  report = read_report(run_dir)
  path = storage.join(run_dir, PREDICTIONS_FILE)
  if not storage.path(path).exists():
    raise UserError(f"{path} does not exist: is {run_dir} a finished run?")
  return report, list(csv.DictReader(storage.read_text(path).splitlines()))


def _group_names(report: dict[str, Any], name: str) -> list[str]:
  attribute = report["attributes"][name]
  return [*attribute["groups"], *attribute.get("empty_groups", [])]


def pooled_report(run_dirs: Sequence[str], min_group_size: int = MIN_GROUP_SIZE) -> dict[str, Any]:
  """The fairness report of the union of the runs' test predictions.

  Returns `fairness_report`'s dict plus `runs`, `run_examples` (test rows of each) and, per
  attribute, `small_groups` (non-empty groups under `min_group_size` rows).
  """
  if not run_dirs:
    raise UserError("pooling needs at least one run directory")
  reports, tables = zip(*(_read_run(d) for d in run_dirs))
  class_names = reports[0]["class_names"]
  attribute_names = list(reports[0]["attributes"])
  for run_dir, report in zip(run_dirs, reports):
    if report["class_names"] != class_names or list(report["attributes"]) != attribute_names:
      raise UserError(
          f"{run_dir} predicts classes {report['class_names']} with attributes "
          f"{list(report['attributes'])}, {run_dirs[0]} classes {class_names} with attributes "
          f"{attribute_names}: only runs of one task pool"
      )
  # Groups in first-seen order over the runs: a group empty in one fold may be filled in another.
  groups = {
      name: list(dict.fromkeys(g for report in reports for g in _group_names(report, name)))
      for name in attribute_names
  }
  seen: dict[str, str] = {}
  for run_dir, rows in zip(run_dirs, tables):
    for row in rows:
      if row["example_id"] in seen:
        raise UserError(
            f"image {row['example_id']} is predicted by both {seen[row['example_id']]} and "
            f"{run_dir}: pooled runs must be disjoint folds"
        )
      seen[row["example_id"]] = run_dir
  rows = [row for table in tables for row in table]
  attributes = [  # "" = attribute missing, -1 to the counts.
      [groups[name].index(row[name]) if row[name] != "" else -1 for name in attribute_names]
      for row in rows
  ]
  report = report_of_predictions(
      np.array([int(row["label"]) for row in rows], np.int32),
      np.array([int(row["prediction"]) for row in rows], np.int32),
      np.array(attributes, np.int32).reshape(len(rows), len(attribute_names)),
      attribute_names,
      list(groups.values()),
      len(class_names),
  )
  for entry in report["attributes"].values():
    entry["small_groups"] = [g for g, v in entry["groups"].items() if v["n"] < min_group_size]
  report["runs"] = [str(d) for d in run_dirs]
  report["run_examples"] = [len(table) for table in tables]
  return report


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> None:
  """The command line (module docstring): prints the pooled report, and writes it with --output."""
  parser = argparse.ArgumentParser(
      prog="python -m fairmoe_jax.metrics.pooling", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("run_dirs", nargs="+", help="finished runs (report.json, predictions.csv)")
  parser.add_argument("--output", help="also write the pooled report as JSON here")
  args = parser.parse_args(argv)
  report = pooled_report(args.run_dirs)
  examples = ", ".join(map(str, report["run_examples"]))
  print(f"Pooled over {len(report['runs'])} runs ({examples} test examples)")
  print(format_report(report))
  for name, entry in report["attributes"].items():
    if entry["small_groups"]:
      print(
          f"Small groups of {name} (< {MIN_GROUP_SIZE} examples): {', '.join(entry['small_groups'])}"
      )
  if args.output:
    write_atomically(os.path.abspath(args.output), json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  main()
