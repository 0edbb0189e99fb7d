r"""Table: causal against vanilla attention for En-De translation on the OpenNMT sample
(docs/results.md, "En-De sample: translation"). The sample has no test split: the validation
split reports, and it is the split the causal model's dual schedule was chosen on (the selection
leak below). The claim is the paper's (Table 2): the causal model translates at least as well.
"""

from paper_runner.spec import dotted
from paper_runner.table_parts import (
    CAUSAL,
    CAUSAL_REFERENCES,
    CONSTRAINT_MET,
    EFFECTIVE_KEYS,
    NODES_WITHIN,
    VANILLA,
    claims,
)

_DATA = "../shared/data/translation/wmt14_ende_opennmt"

TABLE = dict(
    references=CAUSAL_REFERENCES,
    title="Causal and vanilla attention, En-De sample (validation split)",
    rows="model.attention",
    row_names={CAUSAL: "causal (constrained GCN)", VANILLA: "vanilla"},
    split="validation",
    examples="num_sentences",
    columns=(
        ("bleu", "BLEU", 1.0, 2),
        ("eval_loss", "Val. loss", 1.0, 3),
        EFFECTIVE_KEYS,
        NODES_WITHIN,
        CONSTRAINT_MET,
    ),
    claims=claims(CAUSAL, (VANILLA,), (("bleu", "higher"), ("eval_loss", "lower"))),
    tuning=(
        (
            CAUSAL,
            2,
            "dual schedules (ramped and not), 2 seeds, on this validation split, by earlier "
            "code (docs/design.md)",
        ),
        (VANILLA, 0, "not tuned"),
    ),
    # The sample has no other in-distribution split: the schedule was chosen on the split the
    # table reports (docs/protocol.md, sections 1 and 9).
    selection_leaks=(
        dict(
            rows=(CAUSAL,),
            why=(
                "the causal model's dual schedule was chosen on this validation split, the one "
                "the table reports (docs/design.md). The sample has no second in-distribution "
                "split to move the choice to; the runs are kept and marked."
            ),
        ),
    ),
)


def get_config(arg=None):
  del arg
  return dict(
      module="causal_attn_jax.main",
      config="configs/wmt14_ende.py:size=small",
      grid=dotted({"seed": (0, 1, 2, 3, 4), "model.attention": (CAUSAL, VANILLA)}),
      overrides=dotted(
          {
              "data.train_source": f"{_DATA}/src-train.txt",
              "data.train_target": f"{_DATA}/tgt-train.txt",
              "data.eval_source": f"{_DATA}/src-val.txt",
              "data.eval_target": f"{_DATA}/tgt-val.txt",
              "data.unescape": True,
              "nmt.max_eval_sentences": 500,
          }
      ),
      metrics=("bleu", "eval_loss"),
  )
