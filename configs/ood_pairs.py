r"""The out-of-distribution testbed (docs/dataset.md, "The ood-pairs testbed"): a cue that is
perfect in training and reversed on the challenge split, against a relation of two tokens.

  python -m causal_attn_jax.main --config=configs/ood_pairs.py:attention=causal,size=small \
      --workdir=/tmp/ood_causal

The label: whether the hypothesis' first word names the premise's first concept; the cue: the
majority class of eight filler words, the label's in train and eval (data.ood_pairs.cue_agreement)
and the other's on the challenge split (data.ood_pairs.challenge_cue=reversed | absent).
Arguments: size (small | full), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed (the model's; the data's is data.ood_pairs.seed). size=small keeps
the spurious-pairs testbed's settings. No generated table yet.
"""

from causal_attn_jax.config import paper_config_from_arg, testbed_small_settings
from causal_attn_jax.data import ood_pairs


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="classification", size="small")
  config.data.generator = "ood_pairs"
  config.data.pair_task = "nli"
  # <bos> S V O <sep> s v <eos> and 8 fillers: 16 tokens, every word one SentencePiece piece.
  config.data.max_len = ood_pairs.WORDS_PER_PAIR + 3 + config.data.ood_pairs.num_fillers
  # The most SentencePiece makes of the default lexicon, so every word is one piece; other
  # data.ood_pairs sizes need another value (the error names the largest).
  config.data.vocab_size = 97
  if arg.size == "small":
    # The spurious-pairs testbed's settings, not tuned on this testbed (validation cannot
    # choose here: a cue reader and a relation reader both score 1 on it).
    testbed_small_settings(config, arg.attention, arg.steps)
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  return config
