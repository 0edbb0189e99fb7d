r"""Tuning table (validation only): a method's loss weights on the CelebA sample, four settings,
three paired seeds. FairSMoE (the default): L_Psi's lambdas (docs/design.md, "One L_Psi rule"),
the paper's 0.1 and 0.5 for each. `:method=M` gives another method FairSMoE's budget
(docs/reproducing.md): vanilla_smoe_psi and muffin the same lambdas; multifair the weight of its
mixup loss and its mixup alpha, the config's 1.0 and a smaller value of each. It chooses the
highest validation MF-PQD within one accuracy point of the best (fairness at no cost in accuracy).

  python -m paper_runner.sweep --sweep=results/lambda_tuning.py:method=muffin --workdir=/tmp/t
"""

from paper_runner import table_parts as parts
from paper_runner.spec import dotted

# Rows: lambda_pqd, each value also setting lambda_dp.
LAMBDAS = {
    "0.1@fair.lambda_dp=0.1": "lambda_pqd 0.1, lambda_dp 0.1 (the paper's lambda for both)",
    "0.1@fair.lambda_dp=0.5": "lambda_pqd 0.1, lambda_dp 0.5",
    "0.5@fair.lambda_dp=0.1": "lambda_pqd 0.5, lambda_dp 0.1",
    "0.5@fair.lambda_dp=0.5": "lambda_pqd 0.5, lambda_dp 0.5",
}
# Rows: the mixup loss's weight, each value also setting the mixup alpha.
MIXUP = {
    "1.0@multifair.mixup_alpha=1.0": "weight 1.0, mixup alpha 1.0 (the config's)",
    "1.0@multifair.mixup_alpha=0.2": "weight 1.0, mixup alpha 0.2",
    "0.5@multifair.mixup_alpha=1.0": "weight 0.5, mixup alpha 1.0",
    "0.5@multifair.mixup_alpha=0.2": "weight 0.5, mixup alpha 0.2",
}
LOSS = "lambdas of L_Psi = lambda_pqd L_PQD + lambda_dp L_DP"
SEARCHES = {  # Per method: the rows key, its settings (the baseline first), the title's words.
    "fairsmoe": ("fair.lambda_pqd", LAMBDAS, f"{LOSS}, FairSMoE"),
    "vanilla_smoe_psi": ("fair.lambda_pqd", LAMBDAS, f"{LOSS}, vanilla SMoE + L_Psi"),
    "muffin": ("fair.lambda_pqd", LAMBDAS, f"{LOSS}, Muffin"),
    "multifair": ("multifair.weight", MIXUP, "mixup loss's weight and alpha, MultiFair"),
}


def TABLE(arg=None):  # noqa: N802 (a spec's TABLE, here following its argument)
  arg = parts.spec_arg(arg, method=SEARCHES)
  rows, settings, what = SEARCHES[arg.method]
  data = "CelebA at paper scale" if arg.scale == "paper" else "CelebA sample"
  return dict(
      references=parts.FAIR_REFERENCES,
      title=f"The {what}, {data}, validation split",
      rows=rows,
      row_names=settings,
      split="validation",
      examples="validation.num_examples",
      columns=(parts.VAL_MF_PQD, ("validation.mf.dp", "Val. MF-DP", 1.0, 3), parts.VAL_ACCURACY),
      select="validation.mf.pqd",
      select_within=("validation.accuracy", 0.01),
      claims=parts.against_first(settings, "validation.mf.pqd"),
  )


def get_config(arg=None):
  arg = parts.spec_arg(arg, method=SEARCHES)
  rows, settings, _ = SEARCHES[arg.method]
  method = {} if arg.method == "fairsmoe" else {"method": (arg.method,)}  # Kept at any scale.
  sweep = dict(
      module="fairmoe_jax.main",
      config="configs/celeba.py:size=small,epochs=3",
      grid=dotted({"seed": (0, 1, 2), rows: tuple(settings), **method}),
      overrides=dotted({**parts.ON_CELEBA, "data.sensitive": "Male"}),
      metrics=("validation.accuracy", "validation.mf.pqd", "validation.mf.dp"),
  )
  return parts.at_scale(arg, sweep)
