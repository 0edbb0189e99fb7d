r"""Sweep: batch size x number of experts x method on the quickstart (synthetic data).

Command:
  python -m paper_runner.sweep --sweep=configs/sweeps/batch_experts.py --workdir=/tmp/batch_experts

Trains FairSMoE and vanilla SMoE for every batch size (64, 128, 256) and expert count (4, 8),
one seed: 12 runs of 350 steps. The learning rate follows the batch size by the square-root
rule from batch 128 (`optimizer.lr_scaling`). Writes `sweep.csv`, `sweep.md`, `sweep.json`
(accuracy, MF-PQD, MF-DP and throughput per run) and `plots/` (each metric against batch size,
against experts and against method) in the workdir.

Arguments, e.g. `--sweep=configs/sweeps/batch_experts.py:steps=50,seeds=2`:
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
