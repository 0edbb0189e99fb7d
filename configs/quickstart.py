r"""Quickstart: FairSMoE (a small ViT with a fairness-guided sparse-MoE last block) on the
built-in synthetic dataset.

  python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart

32x32 images with three sensitive attributes (sex: 2 groups, age: 5, site: 8).

Arguments, e.g. `--config=configs/quickstart.py:steps=100,experts=8`:
  steps    number of training steps (default 350)
  experts  number of experts in the MoE block (default 4)
  top_k    experts per token (default 2)

Baselines: `--config.method=vanilla_smoe` (or vanilla_smoe_psi, muffin, multifair), or all with
`python -m paper_runner.fairmoe.compare --config=configs/quickstart.py --workdir=DIR`. No
generated table covers it; the run prints the test accuracy (chance 25%) and the fairness report,
written to report.json, with vanilla SMoE's figures on the same settings beside them (from
results/records/quickstart_vanilla_smoe.json, which holds its command).
"""

from fairmoe_jax.config import quickstart_config


def get_config(arg: str | None = None):
  return quickstart_config(arg)
