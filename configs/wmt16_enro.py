r"""WMT16 English-Romanian NMT (Causal Transformers, Sec. 4.2, Table 2): d_model 512, 6 layers, 8 heads.

  python -m causal_attn_jax.main --config=configs/wmt16_enro.py:attention=causal \
      --config.data.train_source=/data/wmt16_enro/train.en \
      --config.data.train_target=/data/wmt16_enro/train.ro \
      --config.data.eval_source=/data/wmt16_enro/test.en \
      --config.data.eval_target=/data/wmt16_enro/test.ro --workdir=/tmp/enro_causal

Or tfds `wmt16_translate/ro-en` (--config.data.tfds_name, --config.data.tfds_data_dir).
Arguments: size (full | small), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed, reverse (True: Ro->En). No generated table.
"""

from causal_attn_jax.config import paper_config_from_arg


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="translation", reverse=False)
  config.data.source_lang, config.data.target_lang = ("en", "ro")
  config.data.reverse = arg.reverse  # Both for files and tfds (config.data.reverse).
  return config
