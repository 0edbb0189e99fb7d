r"""Table: FairSMoE against vanilla SMoE with and without FairSMoE's fairness loss on the
built-in synthetic dataset (three sensitive attributes).

  python -m experiments.sweep --sweep=results/synthetic_small.py --workdir=/tmp/results/synthetic_small
  python -m experiments.tables --record=synthetic_small --workdir=/tmp/results/synthetic_small
  python -m experiments.tables --write=docs/results.md

The quickstart model and data (configs/quickstart.py: 32-px generated images, 4 classes, sex 2,
age 5 and site 8 groups; a 4-block ViT with a 4-expert top-2 MoE in its last block), 200 steps
of batch 128, FEM reviews every 25 steps on the validation split. Five paired seeds (the seed
changes the initialisation and the data order, not the data). Capacity factor 2.0: with 4
experts and top-2 routing no token is dropped. Claims are the paper's (Sec. 6.2-6.3): FairSMoE
is more accurate and fairer than vanilla SMoE, activates more experts (Fig. 5) and has a higher
gradient cosine between the attributes' fairness tasks (Fig. 6), each tested against vanilla
SMoE and against vanilla SMoE trained with the same lambda * L_Psi.
"""

from experiments.spec import dotted

METHODS = ("fairsmoe", "vanilla_smoe_psi", "vanilla_smoe")
_CLAIMS = (
    ("accuracy", "higher"),
    ("mf.pqd", "higher"),
    ("mf.dp", "lower"),
    ("experts_active.choices", "higher"),
    ("gradient_cosine", "higher"),
)

# How experiments.tables tabulates the runs (the rows, columns and claims of the table).
TABLE = dict(
    title="FairSMoE, vanilla SMoE + L_Psi and vanilla SMoE on the synthetic data",
    rows="method",
    split="test",
    examples="num_examples",
    groups="attributes",
    columns=(
        ("accuracy", "Acc. (%)", 100.0, 1),
        ("mf.pqd", "MF-PQD", 1.0, 3),
        ("mf.dp", "MF-DP", 1.0, 3),
        ("experts_active.choices", "Experts active", 1.0, 2),
        ("gradient_cosine", "Grad. cos", 1.0, 3),
        ("validation.accuracy", "Val. acc. (%)", 100.0, 1),
        ("dropped.train", "Dropped (train)", 1.0, 3),
    ),
    claims=tuple(
        dict(row="fairsmoe", baseline=baseline, metric=metric, better=better)
        for baseline in ("vanilla_smoe", "vanilla_smoe_psi")
        for metric, better in _CLAIMS
    ),
)


def get_config(arg=None):
  del arg
  return dict(
      module="fairmoe_jax.main",
      config="configs/quickstart.py:steps=200",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "method": METHODS}),
      overrides=dotted({"fair.review_every_steps": 25, "moe.capacity_factor": 2.0}),
      metrics=("accuracy", "mf.pqd", "mf.dp", "validation.accuracy"),
  )
