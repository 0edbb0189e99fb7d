r"""Quickstart: FairSMoE (a small ViT with a fairness-guided sparse-MoE last block) on the
built-in synthetic dataset.

Trains on 32x32 generated images with three sensitive attributes (sex: 2 groups,
age: 5, site: 8), evaluates on the test split, prints the fairness report and writes
plots in the workdir.

Command:
  python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart

Arguments, e.g. `--config=configs/quickstart.py:steps=100,experts=8`:
  steps    number of training steps (default 350)
  experts  number of experts in the MoE block (default 4)
  top_k    experts per token (default 2)

The baselines on the same data: `--config.method=vanilla_smoe` (or vanilla_smoe_psi, muffin,
multifair), or all at once with `python -m paper_runner.fairmoe.compare --config=configs/quickstart.py
--workdir=DIR` (each run in DIR/runs/, the paper-style table in DIR/comparison.md).

Expected result: no generated table covers the quickstart; the run prints the test accuracy
(chance is 25%, 4 classes) and the fairness report per attribute and writes them to
report.json. FairSMoE's expert management reviews the allocation every 50 steps on the
validation split (report.json "allocation_history", plots/allocation_history.png).
"""

from fairmoe_jax.config import quickstart_config


def get_config(arg: str | None = None):
  return quickstart_config(arg)
