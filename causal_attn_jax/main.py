r"""Command line: train then evaluate; evaluate or predict with the latest checkpoint; compile.

  python -m causal_attn_jax.main --config=configs/snli.py:size=small,attention=causal \
      --config.data.train_file=../shared/data/nli/snli_1.0_dev.jsonl \
      --config.data.eval_file=../shared/data/nli/snli_1.0_test.jsonl --workdir=/tmp/snli
  python -m causal_attn_jax.main --config=configs/snli.py:size=small ... --mode=eval
  python -m causal_attn_jax.main --workdir=/tmp/snli --mode=predict \
      --config.predict.input=pairs.tsv   # premise<TAB>hypothesis lines; or sentences to translate
  python -m causal_attn_jax.main --config=configs/wmt14_ende.py --mode=compile \
      --config.preflight.target=h100x8 --workdir=/tmp/preflight

Without --config, eval and predict read the trained run's <workdir>/config.json
(--config.KEY=VALUE overrides still apply); predict needs no data file (the tokenizer and the
label names are in the workdir: spm.model, run_info.json). compile needs --config and no data,
tokenizer or accelerator: it compiles the run's train and eval steps for
--config.preflight.target (docs/scaling.md lists them; python -m trainkit.preflight.compilers) and
writes <workdir>/preflight.json; the vocabulary is data.vocab_size and the classes follow
data.pair_task (or the tfds dataset or testbed).

Writes <workdir>/report.json: classification {accuracy, macro_f1, challenge: {accuracy,
by_heuristic}}; translation {bleu, num_sentences}; both {attention: {kind, effective_keys,
top1_mass} (per self-attention layer), constraints: {rows_within, cols_within, nodes_within,
per_layer: {the fractions, violation, multiplier, met}, mean_multiplier, met, summary}}; plus
metrics.jsonl, checkpoints/, plots/ (attention heatmaps). `accuracy` and the constraint numbers
are measured on the eval split, which is the validation split (docs/protocol.md).
"""

from __future__ import annotations

from causal_attn_jax import config as causal_config
from causal_attn_jax import inference, train
from causal_attn_jax.preflight import preflight_program
from trainkit import cli

main = cli.train_eval_command(
    validate=causal_config.validate,
    train_and_evaluate=train.train_and_evaluate,
    evaluate_checkpoint=train.evaluate_checkpoint,
    workdir_help="Directory for the tokenizer, checkpoints, metrics and report.json.",
    checkpoint_modes={
        "predict": (
            inference.predict_checkpoint,
            "classify the sentence pairs (TSV) or translate the sentences of "
            "--config.predict.input with the latest checkpoint, into "
            "<workdir>/predict/predictions.tsv",
        )
    },
    preflight_program=preflight_program,
)

if __name__ == "__main__":
  main()
