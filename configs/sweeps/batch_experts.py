r"""Sweep: batch size (64, 128, 256) x experts (4, 8) x FairSMoE or vanilla SMoE, on the quickstart.

  python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py --workdir=/tmp/batch_experts

The learning rate follows the batch size by the square-root rule from batch 128
(`optimizer.lr_scaling`). Arguments, e.g. `:steps=50,seeds=2`:
  steps  training steps per run (default 350)
  seeds  seeds 0..seeds-1 per grid point (default 1)
"""

import ml_collections

from paper_runner.spec import dotted
from trainkit.config import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, steps=350, seeds=1)
  return ml_collections.ConfigDict(
      dict(
          module="fairmoe_jax.main",
          config="configs/quickstart.py",
          grid=dotted(
              {
                  "batch_size": (64, 128, 256),
                  "moe.num_experts": (4, 8),
                  "method": ("fairsmoe", "vanilla_smoe"),
                  "seed": tuple(range(arg.seeds)),
              }
          ),
          overrides=dotted(
              {
                  "num_train_steps": arg.steps,
                  "optimizer.lr_scaling": "sqrt",
                  "optimizer.base_batch_size": 128,
              }
          ),
          metrics=("accuracy", "mf.pqd", "mf.dp"),
      )
  )
