r"""Table: FairSMoE against vanilla SMoE with and without FairSMoE's fairness loss, CelebA sample.

  python -m experiments.sweep --sweep=results/celeba_small.py --workdir=/tmp/results/celeba_small
  python -m experiments.tables --record=celeba_small --workdir=/tmp/results/celeba_small
  python -m experiments.tables --write=docs/results.md

The sample of ../shared/data/celeba (official partition: 2,328 train / 480 validation / 390
test images; target Attractive, sensitive Male, the only attribute known for every image), the
size=small model (a 4-block ViT at 64 px with a 4-expert top-2 MoE in its last block) for 3
epochs, FEM reviews every 20 steps on the validation split. Five paired seeds: seed k gives
every method the same initialisation seed and data order. The capacity factor is 2.0, at which
4 experts with top-2 routing drop no token, so no method loses tokens the others keep
(`dropped` columns). `vanilla_smoe_psi` is vanilla SMoE trained with the same lambda * L_Psi
(fair.psi and fair.lambda_psi as FairSMoE), the control that separates what FGR and FEM add
from what the fairness loss adds. Claims are the paper's (Sec. 6.2, Table 1: FairSMoE is more
accurate and fairer than vanilla SMoE), each tested against both controls.
"""

from experiments.spec import dotted

METHODS = ("fairsmoe", "vanilla_smoe_psi", "vanilla_smoe")
_CLAIMS = (
    ("accuracy", "higher"),
    ("mf.pqd", "higher"),
    ("mf.dp", "lower"),
    ("mf.eodds", "lower"),
)


# How experiments.tables tabulates the runs (the rows, columns and claims of the table).
TABLE = dict(
    title="FairSMoE, vanilla SMoE + L_Psi and vanilla SMoE on the CelebA sample",
    rows="method",
    split="test",
    examples="num_examples",
    groups="attributes",
    columns=(
        ("accuracy", "Acc. (%)", 100.0, 1),
        ("mf.pqd", "MF-PQD", 1.0, 3),
        ("mf.dp", "MF-DP", 1.0, 3),
        ("mf.eodds", "MF-EOdds", 1.0, 3),
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
      config="configs/celeba.py:size=small,epochs=3",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "method": METHODS}),
      overrides=dotted(
          {
              "data.root": "../shared/data/celeba",
              "data.sensitive": "Male",
              "fair.review_every_steps": 20,
              "moe.capacity_factor": 2.0,
          }
      ),
      metrics=("accuracy", "mf.pqd", "mf.dp", "mf.eodds", "validation.accuracy"),
  )
