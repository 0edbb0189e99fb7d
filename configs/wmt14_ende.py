r"""WMT14 En-De NMT (Causal Transformers, Sec. 4.2, Table 2): d_model 512, 6 layers, 8 heads, d_k 64.

  python -m causal_attn_jax.main --config=configs/wmt14_ende.py:attention=causal \
      --config.data.train_source=/data/wmt14/train.en \
      --config.data.train_target=/data/wmt14/train.de \
      --config.data.eval_source=/data/wmt14/newstest2014.en \
      --config.data.eval_target=/data/wmt14/newstest2014.de --workdir=/tmp/ende_causal
  python -m causal_attn_jax.main --config=configs/wmt14_ende.py:size=small,attention=causal \
      --config.data.train_source=../shared/data/translation/wmt14_ende_opennmt/src-train.txt \
      --config.data.train_target=../shared/data/translation/wmt14_ende_opennmt/tgt-train.txt \
      --config.data.eval_source=../shared/data/translation/wmt14_ende_opennmt/src-val.txt \
      --config.data.eval_target=../shared/data/translation/wmt14_ende_opennmt/tgt-val.txt \
      --config.data.unescape=True --workdir=/tmp/ende_small  # The Moses-escaped OpenNMT sample.

Or tfds `wmt14_translate/de-en` (--config.data.tfds_name, --config.data.tfds_data_dir).
Arguments: size (full | small), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed, reverse (True: De->En). report.json has the BLEU (sacrebleu, with
its signature) of the beam-search translations. No generated table.
"""

from causal_attn_jax.config import paper_config_from_arg


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="translation", reverse=False)
  config.data.source_lang, config.data.target_lang = ("en", "de")
  config.data.reverse = arg.reverse  # Both for files and tfds (config.data.reverse).
  return config
