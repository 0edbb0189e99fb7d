r"""Table: FairSMoE, its ablations and the baselines on the synthetic testbed built for them
(docs/dataset.md; docs/results.md, "The synthetic testbed"), 200 steps, five paired seeds: the
paper's Table 1, Fig. 5, Fig. 6 and Table 2 claims.
"""

from paper_runner import table_parts as parts
from paper_runner.spec import dotted

ATTRIBUTES = ("sex", "age", "site")

TABLE = parts.paper_claims_table(
    "FairSMoE, its ablations and the baselines, the synthetic testbed",
    ATTRIBUTES,
    parts.SA_ABOVE_MAJORITY,
    tuning=parts.fair_tuning(parts.FAIR_COMPARISON, elsewhere=" (not this data)"),
)


def get_config():
  return dict(
      module="fairmoe_jax.main",
      config="configs/synthetic_testbed.py:steps=200",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "method": parts.FAIR_COMPARISON}),
      overrides=dotted(parts.ON_SYNTHETIC),
      metrics=("accuracy", "mf.pqd", "experts_active.choices", "gradient_cosine"),
  )
