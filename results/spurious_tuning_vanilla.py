r"""Tuning table (validation only): the learning rate of vanilla attention on the testbed
(budget and choice: paper_runner.table_parts.learning_rate_table).
"""

from paper_runner import table_parts as parts

TABLE, get_config = parts.learning_rate_table(
    "Vanilla attention's learning rate on the testbed, validation split",
    {"model.attention": "vanilla", "constraints.weight": 0.0},
)
