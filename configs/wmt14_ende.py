r"""WMT14 En-De NMT (Causal Transformers, Sec. 4.2, Table 2): d_model 512, 6 layers, 8 heads, d_k 64.

Full run on the Vaswani et al. preprocessed data (plain text, one sentence per line), or tfds
`wmt14_translate/de-en` (--config.data.tfds_name=wmt14_translate/de-en
--config.data.tfds_data_dir=DIR; reverse=True translates De->En, from files or tfds):
  python -m causal_attn_jax.main --config=configs/wmt14_ende.py:attention=causal \
      --config.data.train_source=/data/wmt14/train.en \
      --config.data.train_target=/data/wmt14/train.de \
      --config.data.eval_source=/data/wmt14/newstest2014.en \
      --config.data.eval_target=/data/wmt14/newstest2014.de --workdir=/tmp/ende_causal

CPU-scale run on the OpenNMT sample in ../shared/data (Moses-escaped text, hence unescape):
  python -m causal_attn_jax.main --config=configs/wmt14_ende.py:size=small,attention=causal \
      --config.data.train_source=../shared/data/translation/wmt14_ende_opennmt/src-train.txt \
      --config.data.train_target=../shared/data/translation/wmt14_ende_opennmt/tgt-train.txt \
      --config.data.eval_source=../shared/data/translation/wmt14_ende_opennmt/src-val.txt \
      --config.data.eval_target=../shared/data/translation/wmt14_ende_opennmt/tgt-val.txt \
      --config.data.unescape=True --workdir=/tmp/ende_small

Arguments: size (full | small), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed, reverse (True: De->En).

Expected result: BLEU (sacrebleu, on Moses-detokenised hypotheses and references when the
references are tokenised, nmt.detokenize=auto; report.json records the signature) of the
beam-search translations of the eval set. No generated table covers the small run (10k
training pairs, 1,500 steps); the paper's En-De number is a full-scale result we have not
reached.
"""

from causal_attn_jax.config import paper_config_from_arg


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="translation", reverse=False)
  config.data.source_lang, config.data.target_lang = ("en", "de")
  config.data.reverse = arg.reverse  # Both for files and tfds (config.data.reverse).
  return config
