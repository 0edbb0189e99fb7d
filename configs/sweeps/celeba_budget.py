r"""Sweep: the training budget of the CelebA sample, chosen on validation (docs/protocol.md, 6).

  python -m paper_runner.sweep --sweep=configs/sweeps/celeba_budget.py --workdir=/tmp/celeba_budget

Vanilla SMoE's learning curve over epochs on identity fold 0, read on the validation fold only.
Arguments, e.g. `:epochs=(3, 6),seeds=2`:
  epochs  the budgets (default (3, 6, 12))
  seeds   seeds 0..seeds-1 per budget (default 1)
  target  the target attribute (default Attractive)
"""

from typing import Any, Mapping

import ml_collections

from paper_runner.spec import dotted
from trainkit.config import parse_arg


def fold0_curve(
    grid: Mapping[str, Any], target: str, **overrides: Any
) -> ml_collections.ConfigDict:
  """Vanilla SMoE at size=small on identity fold 0, capacity factor 2.0 as in the comparisons,
  read on the validation fold only: the setting of every budget curve (the epochs here, the
  augmentation strength in configs/sweeps/celeba_augment.py), `grid` varying over it."""
  return ml_collections.ConfigDict(
      dict(
          module="fairmoe_jax.main",
          config="configs/celeba.py:size=small,split=identity_folds,fold=0,method=vanilla_smoe",
          grid=dotted(grid),
          overrides=dotted(
              {
                  "data.root": "../shared/data/celeba",
                  "data.target": target,
                  "moe.capacity_factor": 2.0,
                  **overrides,
              }
          ),
          metrics=(
              "validation.accuracy",
              "validation.mf.pqd",
              "validation.mf.dp",
              "validation.num_examples",
          ),
      )
  )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, epochs=(3, 6, 12), seeds=1, target="Attractive")
  return fold0_curve({"num_epochs": tuple(arg.epochs), "seed": tuple(range(arg.seeds))}, arg.target)
