r"""Table: the CelebA comparison of results/fair_cv_celeba.py with Smiling as the target.

  python -m experiments.sweep --sweep=results/fair_cv_celeba_smiling.py --workdir=/tmp/results/fair_cv_celeba_smiling
  python -m experiments.tables --record=fair_cv_celeba_smiling --workdir=/tmp/results/fair_cv_celeba_smiling
  python -m experiments.tables --write=docs/results.md

Smiling is the second target of issue 34: one that a small model can learn from 2.5k faces,
chosen by the data-only rule of docs/protocol.md section 7 on fold 0's training and validation
folds, before any run. Everything else (folds, budget, methods, pairing, claims) is
results/fair_cv_celeba.py's, so the two tables differ only in the target. A table of its own
keeps its own record, so both targets' records stand side by side.
"""

import importlib.util
import os

# The Attractive table's spec, loaded beside this file (results/ is a folder of specs, not a package).
_ATTRACTIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fair_cv_celeba.py")
_spec = importlib.util.spec_from_file_location("_fair_cv_celeba", _ATTRACTIVE)
fair_cv_celeba = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fair_cv_celeba)

TABLE = dict(
    fair_cv_celeba.TABLE,
    title=fair_cv_celeba.TABLE["title"].replace("5 identity folds", "5 identity folds, Smiling"),
)


def get_config(arg=None):
  del arg  # The target is this table's one difference; a second choice would be a second table.
  return fair_cv_celeba.get_config("target=Smiling")
