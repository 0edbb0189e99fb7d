r"""Tuning table (validation only): the learning rate of the causal GCN updater without the
constraint (constraints.weight=0) on the testbed (budget and choice:
paper_runner.table_parts.learning_rate_table).
"""

from paper_runner import table_parts as parts

TABLE, get_config = parts.learning_rate_table(
    "The unconstrained GCN's learning rate on the testbed, validation split",
    {"constraints.weight": 0.0},
)
