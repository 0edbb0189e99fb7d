r"""The synthetic testbed: the quickstart's model and budget on `synthetic_testbed`, a generated
task with attributes of unequal difficulty and a shortcut marker (docs/dataset.md).

  python -m fairmoe_jax.main --config=configs/synthetic_testbed.py --workdir=/tmp/testbed

Arguments, e.g. `:experts=8`: as configs/quickstart.py (steps, experts, top_k). Baselines:
`--config.method=vanilla_smoe` (or vanilla_smoe_psi, muffin, multifair), or all with
`python -m paper_runner.fairmoe.compare --config=configs/synthetic_testbed.py --workdir=DIR`.
Expected result: docs/results.md, table `fair_comparison_testbed`.
"""

from fairmoe_jax.config import quickstart_config


def get_config(arg: str | None = None):
  return quickstart_config(arg, data_name="synthetic_testbed")
