r"""Table: causal attention against vanilla attention and the unconstrained GCN updater on the
spurious-pairs testbed (docs/results.md, "The spurious-pairs testbed: is causal attention less
fooled by the cue?"): the paper's claim (Sec. 4, Table 1) of a higher challenge accuracy.
Validation chose the settings, among schedules that challenge scores had shaped (the leak).
"""

from paper_runner import table_parts as parts

VANILLA = parts.VANILLA_TUNED  # Its rate: spurious_tuning_vanilla.

TABLE = dict(
    references=parts.CAUSAL_WITH_CONTROLS,
    title="Causal attention, vanilla attention and the unconstrained GCN on the testbed",
    rows="model.attention",
    row_names={
        parts.CAUSAL: "causal (constrained GCN)",
        VANILLA: "vanilla",
        parts.UNCONSTRAINED: "GCN without the constraint",
    },
    split="challenge",
    examples="challenge.num_examples",
    columns=(
        ("challenge.accuracy", "Challenge acc.", 1.0, 3),
        ("accuracy", "Val. acc. (in distribution)", 1.0, 3),
        parts.EFFECTIVE_KEYS,
        parts.NODES_WITHIN,
    ),
    claims=parts.claims(
        (parts.CAUSAL,), (VANILLA, parts.UNCONSTRAINED), (("challenge.accuracy", "higher"),)
    ),
    tuning=(
        (parts.CAUSAL, 4, "dual-ascent schedules: `results/spurious_tuning_causal.py`"),
        (VANILLA, 4, "learning rates: `results/spurious_tuning_vanilla.py`"),
        (parts.UNCONSTRAINED, 4, "learning rates: `results/spurious_tuning_gcn.py`"),
    ),
    selection_leaks=(
        dict(
            rows=(parts.CAUSAL,),
            why="the candidate schedules validation chose among had been seen, by earlier code, "
            "on the challenge scores of seeds 0-2 of this table; seeds 3 and 4 informed nothing.",
        ),
    ),
)


def get_config():
  return parts.causal_sweep(
      {"seed": (0, 1, 2, 3, 4), "model.attention": (parts.CAUSAL, VANILLA, parts.UNCONSTRAINED)},
      metrics=("accuracy", "challenge.accuracy"),
  )
