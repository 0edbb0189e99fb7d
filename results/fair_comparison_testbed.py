r"""Table: FairSMoE, its ablations and the baselines on the synthetic testbed built for them
(docs/dataset.md, "The FairSMoE testbed"; docs/results.md, "The synthetic testbed"), 200 steps
(CPU time did not allow the config's 350 for 35 runs). Five paired seeds.

The paper's claims: higher MF-PQD than vanilla SMoE and vanilla SMoE + L_Psi at no worse accuracy
(Table 1), more experts active (Fig. 5), a higher gradient cosine (Fig. 6), and each of FGR and
FEM adds (Table 2).
"""

from paper_runner.spec import dotted
from paper_runner.table_parts import (
    FAIR_COMPARISON,
    SA_ABOVE_MAJORITY,
    fair_tuning,
    paper_claims_table,
)

ATTRIBUTES = ("sex", "age", "site")

TABLE = paper_claims_table(
    "FairSMoE, its ablations and the baselines, the synthetic testbed",
    ATTRIBUTES,
    SA_ABOVE_MAJORITY,
    tuning=fair_tuning(FAIR_COMPARISON, elsewhere=" (not this data)"),
)


def get_config(arg=None):
  del arg
  return dict(
      module="fairmoe_jax.main",
      config="configs/synthetic_testbed.py:steps=200",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "method": FAIR_COMPARISON}),
      overrides=dotted(
          {"fair.review_every_steps": 25, "moe.capacity_factor": 2.0, "analysis_batches": 16}
      ),
      metrics=("accuracy", "mf.pqd", "experts_active.choices", "gradient_cosine"),
  )
