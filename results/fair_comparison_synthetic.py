r"""Table: FairSMoE's three readings of Eq. 8, its two ablations and four baselines on the built-in
synthetic data without attribute cues (cues=false), five paired seeds (docs/results.md, "The
built-in synthetic data: three attributes"). The paper's claims (Sec. 6.2-6.3) against vanilla
SMoE and vanilla SMoE + L_Psi; the readings compared on validation.
"""

from paper_runner import table_parts as parts
from paper_runner.spec import dotted

METHODS = parts.fair_methods(
    (
        parts.FAIRSMOE,
        parts.ATTRIBUTE_ROUTING,
        "vanilla_smoe_psi",
        "vanilla_smoe",
        parts.CLASS_ROUTING,
        "fairsmoe_no_fgr",
        "fairsmoe_no_fem",
        "muffin",
        "multifair",
    )
)

TABLE = parts.fair_comparison_table(
    "FairSMoE (three readings of Eq. 8, two ablations) against four baselines, synthetic data",
    METHODS,
    (
        *(parts.ACCURACY, parts.MF_PQD, parts.MF_DP, parts.EXPERTS_ACTIVE, parts.GRADIENT_COSINE),
        *(*parts.VALIDATION, parts.SA_ABOVE_MAJORITY, *parts.MECHANISMS),
    ),
    parts.fair_claims(parts.FAIR_PAPER_CLAIMS),
    tuning=parts.fair_tuning(METHODS, elsewhere=" (not this data)"),
)


def get_config():
  return dict(
      module="fairmoe_jax.main",
      config="configs/quickstart.py:steps=200,cues=false",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "method": tuple(METHODS)}),
      overrides=dotted(parts.ON_SYNTHETIC),
      metrics=("accuracy", "mf.pqd", "mf.dp", "validation.accuracy", "gradient_cosine"),
  )
