r"""QQP -> PAWS-QQP (Causal Transformers, Sec. 4.1, Table 1): train on QQP, score PAWS-QQP, no fine-tuning.

  python -m causal_attn_jax.main --config=configs/qqp_paws.py:attention=causal \
      --config.data.train_file=/data/glue/QQP/train.tsv \
      --config.data.eval_file=/data/glue/QQP/dev.tsv \
      --config.data.challenge_file=/data/paws_qqp/dev_and_test.tsv \
      --config.model.glove_path=/data/glove.840B.300d.txt --workdir=/tmp/qqp_causal

Or tfds: --config.data.tfds_name=glue/qqp --config.data.tfds_data_dir=DIR (PAWS from a file).
Arguments: size (full | small), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed. No generated table; the paper's 87.8% QQP / 78.1% PAWS-QQP is not
reached.
"""

from causal_attn_jax.config import paper_config_from_arg


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="classification")
  config.data.pair_task = "paraphrase"
  if arg.size == "full" and not arg.steps:  # The paper counts epochs; steps= overrides.
    config.num_epochs = 200.0
  return config
