r"""Tuning table (validation only): L_Psi's lambdas (docs/design.md, "One L_Psi rule"), FairSMoE
on the CelebA sample, the paper's 0.1 and 0.5 for each, three paired seeds. It chooses the highest
validation MF-PQD within one accuracy point of the best (fairness at no cost in accuracy).
"""

from paper_runner import table_parts as parts
from paper_runner.spec import dotted

# Rows: lambda_pqd, each value also setting lambda_dp.
SETTINGS = {
    "0.1@fair.lambda_dp=0.1": "lambda_pqd 0.1, lambda_dp 0.1 (the paper's lambda for both)",
    "0.1@fair.lambda_dp=0.5": "lambda_pqd 0.1, lambda_dp 0.5",
    "0.5@fair.lambda_dp=0.1": "lambda_pqd 0.5, lambda_dp 0.1",
    "0.5@fair.lambda_dp=0.5": "lambda_pqd 0.5, lambda_dp 0.5",
}

PAPER_TABLE = dict(title="The lambdas of L_Psi, FairSMoE, CelebA at paper scale")
TABLE = dict(
    references=parts.FAIR_REFERENCES,
    title="The lambdas of L_Psi = lambda_pqd L_PQD + lambda_dp L_DP, FairSMoE, CelebA sample, validation split",
    rows="fair.lambda_pqd",
    row_names=SETTINGS,
    split="validation",
    examples="validation.num_examples",
    columns=(parts.VAL_MF_PQD, ("validation.mf.dp", "Val. MF-DP", 1.0, 3), parts.VAL_ACCURACY),
    select="validation.mf.pqd",
    select_within=("validation.accuracy", 0.01),
    claims=parts.against_first(SETTINGS, "validation.mf.pqd"),
)


def get_config(arg=None):
  sweep = dict(
      module="fairmoe_jax.main",
      config="configs/celeba.py:size=small,epochs=3",
      grid=dotted({"seed": (0, 1, 2), "fair.lambda_pqd": tuple(SETTINGS)}),
      overrides=dotted({**parts.ON_CELEBA, "data.sensitive": "Male"}),
      metrics=("validation.accuracy", "validation.mf.pqd", "validation.mf.dp"),
  )
  return parts.at_scale(arg, sweep)
