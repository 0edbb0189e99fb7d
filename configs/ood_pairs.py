r"""The out-of-distribution testbed (docs/dataset.md, "The ood-pairs testbed"): a cue that is
perfect in training and reversed on the challenge split, against a relation of two tokens.

Sentence pairs are generated from data.ood_pairs.seed in well under a second: the label is whether
the hypothesis' first word names the same concept as the premise's first word (up to synonyms);
the cue is the majority class of eight filler words scattered over both sentences, the label's
class in every train and eval pair (data.ood_pairs.cue_agreement=1.0) and the other label's in
every challenge pair (data.ood_pairs.challenge_cue=reversed; "absent" gives half of each). A
model of the cue scores 1 on validation and 0 on the challenge split, a model of the relation 1
on both; report.json has the in-distribution `accuracy` and the challenge split in the HANS schema
(`challenge.accuracy`, `challenge.by_heuristic.filler_majority` per gold label):
  python -m causal_attn_jax.main --config=configs/ood_pairs.py:attention=causal,size=small \
      --workdir=/tmp/ood_causal

Arguments: size (small | full), attention (causal | vanilla | band | dilated | random | block),
gcn_hops (1 | 2), steps, seed (the model's; the data's is data.ood_pairs.seed).

size=small keeps the spurious-pairs testbed's settings (batch 64, no dropout, 2,000 steps,
learning rate 1e-3 for vanilla attention and 3e-3 otherwise, dual ascent from step 500 ramped over
1,000 steps to 0.01). They were chosen on that testbed's validation split, not on this one's
(docs/design.md, 'Defaults and the split that chose them').

Expected result: no generated table yet. What the design guarantees (a cue reader scores 0 on the
challenge split, a relation reader 1) is tested on the data (tests/test_ood_pairs.py); which of
the two a trained model follows is what a run measures.
"""

from causal_attn_jax.config import paper_config_from_arg, testbed_small_settings
from causal_attn_jax.data import ood_pairs


def get_config(arg: str | None = None):
  config, arg = paper_config_from_arg(arg, task="classification", size="small")
  config.data.generator = "ood_pairs"
  config.data.pair_task = "nli"
  # <bos> S V O <sep> s v <eos> and 8 fillers: 16 tokens, every word one SentencePiece piece.
  config.data.max_len = ood_pairs.WORDS_PER_PAIR + 3 + config.data.ood_pairs.num_fillers
  # The most SentencePiece can make of the default lexicon (72 words and their letters), so
  # every word is one piece; other data.ood_pairs sizes need another value (the error names the
  # largest).
  config.data.vocab_size = 97
  if arg.size == "small":
    # The spurious-pairs testbed's settings, not tuned on this testbed (validation cannot
    # choose here: a cue reader and a relation reader both score 1 on it).
    testbed_small_settings(config, arg.attention, arg.steps)
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  return config
