r"""Table: causal against vanilla attention, trained on the MNLI sample, scored on HANS.

configs/mnli_hans.py at size=small: MultiNLI dev-matched (../shared/data/nli, 9,815 pairs)
split 90/10 into train and validation (data.eval_fraction), 1,500 steps; HANS is the 3,000
regenerated pairs (100 per subcase), out of distribution and for reporting only. Five paired
seeds. The claim is the paper's Table 1: causal attention scores higher on HANS than vanilla
attention trained the same way.
"""

from paper_runner.spec import dotted
from paper_runner.table_parts import (
    CAUSAL,
    CAUSAL_REFERENCES,
    EFFECTIVE_KEYS,
    NODES_WITHIN,
    VANILLA,
    claims,
)

# How paper_runner.tables tabulates the runs (the rows, columns and claims of the table).
TABLE = dict(
    references=CAUSAL_REFERENCES,
    title="Causal and vanilla attention, MNLI sample to HANS",
    rows="model.attention",
    row_names={CAUSAL: "causal", VANILLA: "vanilla"},
    split="challenge",
    examples="challenge.num_examples",
    columns=(
        ("challenge.accuracy", "HANS acc.", 1.0, 3),
        ("accuracy", "Val. acc. (MNLI)", 1.0, 3),
        EFFECTIVE_KEYS,
        NODES_WITHIN,
        # HANS by heuristic and gold label (500 pairs each): E entailment, N non-entailment.
        *(
            (f"challenge.by_heuristic.{h}.{label}", f"{short} {label[0].upper()}", 1.0, 2)
            for h, short in (
                ("lexical_overlap", "lex."),
                ("subsequence", "sub."),
                ("constituent", "const."),
            )
            for label in ("entailment", "non-entailment")
        ),
    ),
    claims=claims(CAUSAL, (VANILLA,), (("challenge.accuracy", "higher"),)),
    # An unequal budget (docs/design.md, "Defaults and the split that chose them").
    tuning=(
        (
            CAUSAL,
            10,
            "dual-step schedules, seed 0 then 3 seeds, on the MNLI sample's validation split, "
            "by earlier code (docs/design.md)",
        ),
        (VANILLA, 0, "not tuned"),
    ),
)


def get_config(arg=None):
  del arg
  return dict(
      module="causal_attn_jax.main",
      config="configs/mnli_hans.py:size=small",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "model.attention": (CAUSAL, VANILLA)}),
      overrides=dotted(
          {
              "data.train_file": "../shared/data/nli/mnli_dev_matched.tsv",
              "data.challenge_file": "../shared/data/nli/hans_regenerated_sample.txt",
          }
      ),
      metrics=("accuracy", "challenge.accuracy"),
  )
