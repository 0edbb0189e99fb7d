r"""Tuning table (validation only): the learning rate of vanilla attention on the testbed.

The same budget as causal attention's schedule search (results/spurious_tuning_causal.py): four
settings, three seeds, the in-distribution validation split only. The shipped learning rate
(3e-3, configs/spurious_pairs.py size=small) against 1e-3, 2e-3 and 5e-3. The setting with the
highest mean validation accuracy is the one the comparison uses.
"""

from paper_runner.table_parts import LEARNING_RATES, learning_rate_table, spurious_sweep

TABLE = learning_rate_table("Vanilla attention's learning rate on the testbed, validation split")


def get_config(arg=None):
  del arg
  return spurious_sweep(
      {"seed": (0, 1, 2), "optimizer.learning_rate": LEARNING_RATES},
      {"model.attention": "vanilla", "constraints.weight": 0.0},
  )
