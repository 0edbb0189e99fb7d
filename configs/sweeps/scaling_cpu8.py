r"""Sweep: the expert-parallel scaling study on 8 fake CPU devices.

Command (the runs inherit the environment, so XLA_FLAGS reaches every one):
  export XLA_FLAGS=--xla_force_host_platform_device_count=8
  python -m paper_runner.sweep --sweep=configs/sweeps/scaling_cpu8.py --workdir=/tmp/scaling_cpu8

Sparse MoE (`method=smoe`, 8 experts) on the quickstart for every mesh layout mesh.expert in
(1, 2, 4, 8) (the data axis takes the remaining devices) and batch size (64, 256): 8 runs of 60
steps, logging every 5 steps so the throughput medians have enough points. The fake devices
share this host's cores, so the table and plots show the mechanics and the per-layout overheads
(all-to-all dispatch, sharded experts), not speedups; real scaling needs real devices.

Arguments: `:steps=N` training steps per run (default 60).
"""

import ml_collections

from paper_runner.spec import dotted
from trainkit.config import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, steps=60)
  return ml_collections.ConfigDict(
      dict(
          module="fairmoe_jax.main",
          config="configs/quickstart.py",
          grid=dotted(
              {
                  "mesh.expert": (1, 2, 4, 8),
                  "batch_size": (64, 256),
                  "seed": (0,),
              }
          ),
          overrides=dotted(
              {
                  "method": "smoe",
                  "moe.num_experts": 8,
                  "mesh.data": -1,
                  "num_train_steps": arg.steps,
                  "eval_every_steps": 0,
                  "log_every_steps": 5,
              }
          ),
          metrics=("accuracy", "mf.pqd"),
      )
  )
