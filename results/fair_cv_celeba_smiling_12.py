r"""Table: results/fair_cv_celeba.py with Smiling as the target at the 12 epochs its own budget
curve chose (docs/protocol.md section 7, `configs/sweeps/celeba_budget.py:target=Smiling`).
"""

from paper_runner.table_parts import sibling_spec

fair_cv_celeba = sibling_spec(__file__, "fair_cv_celeba")

TABLE = dict(
    fair_cv_celeba.TABLE,
    title=fair_cv_celeba.TABLE["title"].replace(
        "5 identity folds", "5 identity folds, Smiling, 12 epochs"
    ),
    **fair_cv_celeba.budget_and_leaks(12, "Smiling"),
)


def get_config():
  # Target and budget are this table's differences; another choice is another table.
  return fair_cv_celeba.get_config("target=Smiling,epochs=12")
