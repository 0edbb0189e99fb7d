r"""Sweep: expert-parallel scaling of sparse MoE (8 experts) on 8 fake CPU devices.

  export XLA_FLAGS=--xla_force_host_platform_device_count=8  # Every run inherits it.
  python -m paper_runner.sweep --sweep=configs/sweeps/scaling_cpu8.py --workdir=/tmp/scaling_cpu8

mesh.expert in (1, 2, 4, 8) (data takes the rest) x batch size (64, 256). The fake devices share
this host's cores: the table shows the per-layout overheads, not speedups.
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
          grid=dotted({"mesh.expert": (1, 2, 4, 8), "batch_size": (64, 256), "seed": (0,)}),
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
