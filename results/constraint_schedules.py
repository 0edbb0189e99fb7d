r"""Tuning table (validation only): the shipped dual schedule against three stronger ones on the
spurious-pairs testbed, three seeds: does any meet the Markov-blanket constraint? It chooses no
default (docs/results.md, "Is there a dual schedule that meets the constraint?").
"""

from paper_runner import table_parts as parts

SCHEDULES = {
    "0.01@constraints.dual_start_step=500@constraints.dual_ramp_steps=1000": (
        "from step 500, ramped over 1,000 to 0.01 (shipped)"
    ),
    "0.1": "0.1 from step 0",
    "0.02@constraints.penalty=1.0": "0.02 from step 0 with quadratic penalty 1.0",
    "0.1@constraints.multiplier_cap=0.0": "0.1 from step 0, multipliers uncapped",
}

TABLE = dict(
    references=parts.CAUSAL_WITH_CONTROLS,
    title="Dual schedules against the constraint on the spurious-pairs testbed, validation split",
    rows="constraints.step_size",
    row_names=SCHEDULES,
    split="validation",
    columns=(
        parts.VALIDATION_ACCURACY,
        parts.NODES_WITHIN,
        parts.CONSTRAINT_MET,
        parts.EFFECTIVE_KEYS,
    ),
    claims=parts.against_first(SCHEDULES, "constraints.nodes_within"),
    tuning=(
        (
            next(iter(SCHEDULES)),
            4,
            "dual-ascent schedules by validation accuracy: `results/spurious_tuning_causal.py`",
        ),
        *((schedule, 0, "this table's search") for schedule in list(SCHEDULES)[1:]),
    ),
)


def get_config():
  return parts.causal_sweep({"seed": (0, 1, 2), "constraints.step_size": tuple(SCHEDULES)})
