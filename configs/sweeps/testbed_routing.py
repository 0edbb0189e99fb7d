r"""Sweep: does vanilla SMoE's routing concentrate on the synthetic testbed? (docs/protocol.md, 8)

Command:
  python -m paper_runner.sweep --sweep=configs/sweeps/testbed_routing.py --workdir=/tmp/testbed_routing

The paper's Sec. 3.2 and Figure 2: vanilla SMoE routes similar inputs, whatever their attribute,
to the same few experts, more so with more experts and with the MoE in an earlier block. Vanilla
SMoE on `configs/synthetic_testbed.py` at its budget (350 steps) with 4, 8 and 16 experts (top-2)
in the last block or the first, two seeds; it trains at the config's capacity factor (1.25) and
is evaluated at 8.0, which clips to every token, so no choice is dropped and the test split shows
what the router prefers. `<workdir>/routing.md` (fairmoe_jax/analysis/routing.py) tabulates
the measures the rule of docs/protocol.md section 8 reads: utilisation (experts active / E) and
top-2 share over the split and per image, and how far the groups' routing differs;
`<workdir>/routing_validation.md` the same on the validation split (without the per-image
measures), the one to read where the measurement chooses a setting.

Arguments, e.g. `--sweep=configs/sweeps/testbed_routing.py:experts=(4, 8),seeds=1`:
  experts  the numbers of experts (default (4, 8, 16))
  seeds    seeds 0..seeds-1 (default 2)
  steps    training steps (default 350, the config's)
"""

import ml_collections

from paper_runner.spec import dotted
from trainkit.config import parse_arg

LAST_BLOCK, FIRST_BLOCK = (-1,), (0,)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, experts=(4, 8, 16), seeds=2, steps=350)
  return ml_collections.ConfigDict(
      dict(
          module="fairmoe_jax.main",
          config=f"configs/synthetic_testbed.py:steps={arg.steps}",
          grid=dotted(
              {
                  "moe.blocks": (LAST_BLOCK, FIRST_BLOCK),
                  "moe.num_experts": tuple(arg.experts),
                  "seed": tuple(range(arg.seeds)),
              }
          ),
          overrides=dotted({"method": "vanilla_smoe", "moe.eval_capacity_factor": 8.0}),
          metrics=("accuracy", "mf.pqd", "validation.accuracy"),
          tables=(
              "fairmoe_jax.analysis.routing:write_routing_table",
              "fairmoe_jax.analysis.routing:write_validation_routing_table",
          ),
      )
  )
