r"""Sweep: does vanilla SMoE's routing concentrate on the synthetic testbed? (docs/protocol.md, 8)

  python -m paper_runner.sweep --sweep=configs/sweeps/testbed_routing.py --workdir=/tmp/testbed_routing

The paper's Sec. 3.2 and Figure 2: vanilla SMoE routes similar inputs, whatever their attribute,
to the same few experts, more so with more experts and an earlier MoE block. Trained at the
config's capacity factor, evaluated at 8.0 (no choice dropped); `<workdir>/routing.md` and
`routing_validation.md` tabulate the measures.
Arguments, e.g. `:experts=(4, 8),seeds=1`:
  experts  the numbers of experts (default (4, 8, 16))
  seeds    seeds 0..seeds-1 (default 2)
  steps    training steps (default 350, the config's)
  untrained  1: the control, one step at learning rate 0, last block only (default 0)
"""

import ml_collections

from paper_runner.spec import dotted
from trainkit.config import parse_arg

LAST_BLOCK, FIRST_BLOCK = (-1,), (0,)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, experts=(4, 8, 16), seeds=2, steps=350, untrained=0)
  untrained = {"optimizer.learning_rate": 0.0} if arg.untrained else {}
  return ml_collections.ConfigDict(
      dict(
          module="fairmoe_jax.main",
          config=f"configs/synthetic_testbed.py:steps={1 if arg.untrained else arg.steps}",
          grid=dotted(
              {
                  "moe.blocks": (LAST_BLOCK,) if arg.untrained else (LAST_BLOCK, FIRST_BLOCK),
                  "moe.num_experts": tuple(arg.experts),
                  "seed": tuple(range(arg.seeds)),
              }
          ),
          overrides=dotted(
              {"method": "vanilla_smoe", "moe.eval_capacity_factor": 8.0, **untrained}
          ),
          metrics=("accuracy", "mf.pqd", "validation.accuracy"),
          tables=(
              "fairmoe_jax.analysis.routing:write_routing_table",
              "fairmoe_jax.analysis.routing:write_validation_routing_table",
          ),
      )
  )
