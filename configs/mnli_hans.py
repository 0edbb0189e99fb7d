r"""MNLI -> HANS (Causal Transformers, Sec. 4.1, Table 1): train on MNLI, score HANS (no fine-tuning).

HANS is scored by collapsing the 3-way predictions (neutral, contradiction -> non-entailment);
report.json has challenge.accuracy and, per heuristic, the accuracy on entailment and
non-entailment examples.

Full run (200 epochs, warm-up 12800 steps, dropout 0.1, 300-d GloVe init as in the paper):
  python -m causal_attn_jax.main --config=configs/mnli_hans.py:attention=causal \
      --config.data.train_file=/data/multinli_1.0/multinli_1.0_train.jsonl \
      --config.data.eval_file=/data/multinli_1.0/multinli_1.0_dev_matched.jsonl \
      --config.data.challenge_file=/data/hans/heuristics_evaluation_set.txt \
      --config.model.glove_path=/data/glove.840B.300d.txt --workdir=/tmp/mnli_causal

CPU-scale run on the samples in ../shared/data (MNLI dev-matched split 90/10 into train/eval by
data.eval_fraction, the 3-row HANS sample as the challenge set):
  python -m causal_attn_jax.main --config=configs/mnli_hans.py:size=small,attention=causal \
      --config.data.train_file=../shared/data/nli/mnli_dev_matched.tsv \
      --config.data.challenge_file=../shared/data/nli/hans_format_sample.txt \
      --workdir=/tmp/mnli_small

Arguments: size (full | small), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed.

Expected result: the paper reports 72.8% MNLI-m and 85.2% HANS (full data, full scale), which we
have not reproduced. The small run (8.8k pairs, 1,500 steps, about 3.5 minutes on 2 CPU cores)
ramps the dual step up to 0.02 over its first 500 steps (constraints.dual_ramp_steps,
step_size; with the full step from step 0, seed 1 stayed at chance) and reaches 0.42-0.44 eval
accuracy with attention=causal on seeds 0-2, against 0.43-0.44 for vanilla, with both encoder
layers sparser than vanilla's (15-20 and 3-16 effective keys per row, against 24-38 and 25-38)
(docs/results.md). The 4-row HANS sample is too small to mean anything.
"""

from causal_attn_jax.config import paper_config_from_arg


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="classification")
  config.data.pair_task = "nli"
  if arg.size == "full" and not arg.steps:  # The paper counts epochs; steps= overrides.
    config.num_epochs = 200.0
  if arg.size == "small":
    # The full dual step from step 0 let the first layer turn sparse before the task learnt
    # anything on some seeds (docs/results.md); a 500-step ramp learns on every seed tried, and
    # ramping to 0.02 (not 0.01) makes both encoder layers sparser than vanilla's; 0.04 stays
    # at chance.
    config.constraints.dual_ramp_steps = 500
    config.constraints.step_size = 0.02
  return config
