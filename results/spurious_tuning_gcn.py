r"""Tuning table (validation only): the learning rate of the causal GCN updater without the constraint (constraints.weight=0) on the testbed.

  python -m experiments.sweep --sweep=results/spurious_tuning_gcn.py --workdir=/tmp/results/spurious_tuning_gcn
  python -m experiments.tables --record=spurious_tuning_gcn --workdir=/tmp/results/spurious_tuning_gcn

The same budget as causal attention's schedule search (results/spurious_tuning_causal.py): four
settings, three seeds, the in-distribution validation split only. The shipped learning rate
(3e-3, configs/spurious_pairs.py size=small) against 1e-3, 2e-3 and 5e-3. The setting with the
highest mean validation accuracy is the one the comparison uses.
"""

from experiments.spec import dotted

SHIPPED, *OTHERS = (0.003, 0.001, 0.002, 0.005)

TABLE = dict(
    references="causal_attn_jax.references:reference_reports",
    title="The unconstrained GCN's learning rate on the testbed, validation split",
    rows="optimizer.learning_rate",
    split="validation",
    examples="num_examples",
    select="accuracy",
    columns=(
        ("accuracy", "Val. acc.", 1.0, 3),
        ("attention.effective_keys", "Effective keys", 1.0, 1),
    ),
    claims=tuple(
        dict(row=repr(SHIPPED), baseline=repr(other), metric="accuracy", better="higher")
        for other in OTHERS
    ),
)


def get_config(arg=None):
  del arg
  return dict(
      module="causal_attn_jax.main",
      config="configs/spurious_pairs.py:size=small",
      grid=dotted({"seed": (0, 1, 2), "optimizer.learning_rate": (SHIPPED, *OTHERS)}),
      overrides=dotted({"constraints.weight": 0.0}),
  )
