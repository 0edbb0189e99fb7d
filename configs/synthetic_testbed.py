r"""The synthetic testbed: the quickstart's model and budget on `synthetic_testbed`, the
generated task whose signal (the lesion's tint) a small model learns, whose sensitive attributes
differ in difficulty, and whose corner marker is a shortcut right on only about two images in
three (docs/dataset.md, "The synthetic testbed").

Command:
  python -m fairmoe_jax.main --config=configs/synthetic_testbed.py --workdir=/tmp/testbed

Arguments, e.g. `--config=configs/synthetic_testbed.py:experts=8`: as configs/quickstart.py
(steps 350, experts 4, top_k 2; the testbed has no `cues`).

The baselines on the same data: `--config.method=vanilla_smoe` (or vanilla_smoe_psi, muffin,
multifair), or all at once with `python -m paper_runner.fairmoe.compare
--config=configs/synthetic_testbed.py --workdir=DIR`. `python scripts/synthetic_stats.py
--dataset=synthetic_testbed` prints the data's statistics, with the marker and oracle readers.

Expected result: docs/results.md, table `fair_comparison_testbed` (every method at 200 steps, 5
paired seeds; results/fair_comparison_testbed.py), and docs/dataset.md records vanilla SMoE's
accuracy, fairness and routing at 350 steps (seeds 0 and 1, 4 and 8 experts) beside the two
readers', and its routing with 4, 8 and 16 experts in the last or the first block
(configs/sweeps/testbed_routing.py).
"""

from fairmoe_jax.config import quickstart_config


def get_config(arg: str | None = None):
  return quickstart_config(arg, data_name="synthetic_testbed")
