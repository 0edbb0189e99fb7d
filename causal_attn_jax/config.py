"""Default config of a causal_attn_jax run and its validation (before anything is compiled).

One config drives both tasks of the Causal Transformers paper:

* `task="classification"`: sentence-pair classification (SNLI, MNLI -> HANS, QQP -> PAWS) with
  `PairClassifier`;
* `task="translation"`: NMT (WMT14 En-De, WMT16 En-Ro) with the `Seq2Seq` encoder-decoder.

`model.attention` picks the self-attention: "causal" (Eq. 4 GCN updater + the Markov-blanket
Lagrangian of Eq. 6) or a baseline ("vanilla", "band", "dilated", "random", "block").
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import ml_collections

from causal_attn_jax import constraints as constraints_lib
from causal_attn_jax.data import nli, ood_pairs, spurious
from causal_attn_jax.layers.masks import ATTENTION_KINDS
from trainkit import config as cfg
from trainkit.errors import ConfigError
from trainkit.optim import default_optimizer_config, validate_optimizer_config
from trainkit.preflight.compile import preflight_config, validate_preflight
from trainkit.remat import validate_remat

TASKS = ("classification", "translation")
# data.generator ("" = files or tfds) -> (its config section under data, spec class, generate).
GENERATORS = {
    "spurious_pairs": ("spurious", spurious.SpuriousPairsSpec, spurious.generate),
    "ood_pairs": ("ood_pairs", ood_pairs.OodPairsSpec, ood_pairs.generate),
}


def base_config() -> ml_collections.ConfigDict:
  """Every key a run reads, with defaults; config files override what they need."""
  config = ml_collections.ConfigDict()
  config.task = "classification"  # classification | translation
  cfg.add_run_keys(config, batch_size=32, eval_batch_size=64, num_epochs=0.0)
  config.preflight = preflight_config()  # --mode=compile (docs/scaling.md).

  config.data = ml_collections.ConfigDict(
      dict(
          # A built-in testbed instead of files or tfds (docs/dataset.md): "spurious_pairs"
          # (data/spurious.py) or "ood_pairs" (data/ood_pairs.py); keys under their names.
          generator="",
          # Keys and defaults: the generators' specs (docs/dataset.md, "Keys").
          spurious=ml_collections.ConfigDict(dataclasses.asdict(spurious.SpuriousPairsSpec())),
          ood_pairs=ml_collections.ConfigDict(dataclasses.asdict(ood_pairs.OodPairsSpec())),
          # Sentence pairs (classification): files read by causal_attn_jax.data.nli.read_pairs.
          pair_task="nli",  # nli (3-way) | paraphrase (2-way)
          train_file="",
          eval_file="",  # "" = carve data.eval_fraction of the train file.
          eval_fraction=0.1,
          challenge_file="",  # HANS (nli) or PAWS (paraphrase); "" = none.
          # Parallel text (translation): plain text or .sgm (read_parallel).
          train_source="",
          train_target="",
          eval_source="",
          eval_target="",
          unescape=False,  # Undo XML entities of Moses-escaped corpora (OpenNMT WMT14 files).
          # tfds instead of files when both are set (prepared, never downloaded).
          tfds_name="",  # snli | glue/mnli | glue/qqp | wmt14_translate/de-en | ...
          tfds_data_dir="",
          tfds_train_split="train",
          tfds_eval_split="validation",
          source_lang="en",
          target_lang="de",
          # Translate target -> source (the *_target files become the inputs).
          reverse=False,
          max_train_examples=0,  # > 0 truncates the train split (small runs).
          max_eval_examples=0,  # > 0 truncates the eval and challenge splits.
          max_len=128,  # Pair classification: tokens of <bos> premise <sep> hypothesis <eos>.
          max_source_len=64,  # Translation: source tokens (with <eos>).
          max_target_len=64,  # Translation: target tokens (with <bos>/<eos>).
          vocab_size=8000,  # SentencePiece, trained on the training text in the workdir.
          tokenizer_type="unigram",  # unigram | bpe
      )
  )
  config.model = ml_collections.ConfigDict(
      dict(
          attention="causal",  # One of ATTENTION_KINDS.
          gcn_hops=1,  # 1 = literal Eq. 4, 2 = Kipf & Welling two-hop GCN.
          # > 0: Sinkhorn iterations on encoder self-attention (columns ~ 1, as Definition 1
          # assumes); 0 = softmax.
          sinkhorn_iters=0,
          dim=64,
          num_layers=2,  # Encoder layers.
          num_decoder_layers=2,  # Translation only.
          num_heads=4,
          head_dim=0,  # d_k = d_v; 0 = dim // num_heads.
          mlp_dim=128,
          dropout_rate=0.1,  # Everywhere except on the attention matrices.
          glove_path="",  # GloVe text file for the embedding init (classification).
          # Sparse baselines (layers/masks.py: sparse_mask).
          band_width=2,
          dilation=2,
          num_random=3,
          block_size=4,
          mask_seed=0,
          # Layer rematerialisation in training (trainkit/remat.py, docs/design.md): none |
          # dots (keep the linear layers' outputs) | block (keep only each layer's input).
          remat="none",
      )
  )
  config.constraints = ml_collections.ConfigDict(
      dict(
          # Weight of Eq. 6's Lagrangian in attention="causal" runs (0: ablation; baselines
          # never add it, but log its statistics).
          weight=1.0,
          # Reading of Eqs. 2-3 (constraints.py, docs/design.md "Markov-blanket constraint").
          form="node",  # node (Eq. 2: row + column per token) | separate (rows, columns)
          loss="hinge",  # hinge | linear (Eq. 3 as written: signed sums, slacks)
          # derived_self_loop (1/3 self-loop, from the prose) | paper_slack (printed constants).
          encoder_band="derived_self_loop",
          step_size=0.01,  # Dual ascent step on the multipliers (per train step).
          dual_start_step=0,  # Multipliers stay at init_multiplier before this step.
          # Steps after dual_start_step over which the dual step ramps up to step_size.
          dual_ramp_steps=0,
          init_multiplier=0.0,
          multiplier_cap=10.0,  # Projection of every multiplier onto [0, cap]; 0 = no cap.
          penalty=0.0,  # Augmented-Lagrangian quadratic penalty; 0 = plain Lagrangian.
          penalty_growth=1.0,  # Multiplies the penalty every step (grow_penalty)...
          penalty_max=10.0,  # ...up to this cap.
      )
  )
  config.nmt = ml_collections.ConfigDict(
      dict(
          label_smoothing=0.1,
          beam_size=4,
          alpha=0.6,  # GNMT length penalty.
          max_decode_len=64,
          max_eval_sentences=0,  # > 0 decodes only the first this many eval sentences.
          # BLEU on detokenised text: moses | none | auto (moses for Moses-tokenised references).
          detokenize="auto",
      )
  )
  config.plots = ml_collections.ConfigDict(dict(num_examples=3))  # Attention heatmaps (Fig. 8).
  config.optimizer = default_optimizer_config()
  return config


def uses_tfds(config: ml_collections.ConfigDict) -> bool:
  return bool(config.data.tfds_name and config.data.tfds_data_dir)


# Memory of one generated pair: two sentences as Python strings and words (generously), and
# their token ids.
_GENERATED_PAIR_BYTES = 2048


def _require_spec(config: ml_collections.ConfigDict, key: str, build: Callable[[], Any]) -> Any:
  """`build()`, with its ValueError (whose message starts with the field it is about) raised as a
  ConfigError naming `key.field`: the spec classes hold the rules, the config names the key."""
  try:
    return build()
  except ValueError as e:
    field = re.match(r"\w*", str(e)).group()
    raise ConfigError(f"{key}.{field}", str(e)[len(field) :].strip()) from None


def _validate_generator(config: ml_collections.ConfigDict) -> None:
  """data.<section>.* of data.generator (GENERATORS), its pairs fitting in host memory and, for
  ood_pairs, data.max_len long enough for its pairs."""
  generator, spec_class, _ = GENERATORS[config.data.generator]
  for field in dataclasses.fields(spec_class):
    if field.type == "int":
      cfg.require_int(config, f"data.{generator}.{field.name}", minimum=0)
    elif field.type == "float":  # Every float of both specs is a share (NaN passes no check).
      cfg.require_float(config, f"data.{generator}.{field.name}", minimum=0.0, maximum=1.0)
  spec = _require_spec(config, f"data.{generator}", lambda: generator_spec(config))
  sizes = {k: config.data[generator][k] for k in ("num_train", "num_eval", "num_challenge")}
  cfg.require_fits_in_host_memory(
      f"data.{generator}.{max(sizes, key=sizes.get)}",
      sum(sizes.values()) * (_GENERATED_PAIR_BYTES + 8 * config.data.max_len),
      f"the generated testbed ({sum(sizes.values())} sentence pairs)",
  )
  if generator == "spurious":
    return
  # <bos> S V O <sep> s v <eos> and the fillers: a shorter max_len would cut fillers or words.
  needed = ood_pairs.WORDS_PER_PAIR + 3 + spec.num_fillers
  if config.data.max_len < needed:
    raise ConfigError(
        "data.max_len",
        f"must be >= {needed} for data.generator='ood_pairs' ({ood_pairs.WORDS_PER_PAIR} words, "
        f"{spec.num_fillers} fillers and 3 special tokens per pair), got {config.data.max_len}",
    )


def validate(
    config: ml_collections.ConfigDict,
    *,
    num_devices: int,
    num_processes: int = 1,
    check_data: bool = True,
) -> None:
  """Raises ConfigError naming the first key with a wrong type, impossible value or missing file.

  `check_data=False` skips the data files (and `model.glove_path`): the modes that read only a
  trained workdir (predict: its tokenizer, run_info.json and checkpoint) need none of them.
  """

  def check_file(key: str, what: str = "") -> None:
    """The data file `key` names exists; `what` (what it holds) makes it required."""
    if not check_data:
      return
    path = cfg.get(config, key)
    if what and (not isinstance(path, str) or not path):
      raise ConfigError(key, f"is required ({what})")
    if path and not os.path.isfile(path):
      # A config.json reused from a trained workdir names the files where they were then.
      raise ConfigError(key, f"file {path!r} does not exist (--config.{key}=FILE says where it is)")

  task = cfg.require_choice(config, "task", TASKS)
  cfg.validate_run(config, num_devices=num_devices, num_processes=num_processes)
  validate_preflight(config)

  cfg.require_choice(config, "model.attention", ATTENTION_KINDS)
  cfg.require_choice(config, "model.gcn_hops", (1, 2))
  dim = cfg.require_int(config, "model.dim", minimum=1)
  heads = cfg.require_int(config, "model.num_heads", minimum=1)
  head_dim = cfg.require_int(config, "model.head_dim", minimum=0)
  if head_dim == 0 and dim % heads:
    raise ConfigError("model.num_heads", f"{heads} does not divide model.dim={dim}")
  for key in ("num_layers", "num_decoder_layers", "mlp_dim", "dilation", "block_size"):
    cfg.require_int(config, f"model.{key}", minimum=1)
  for key in ("band_width", "num_random", "mask_seed", "sinkhorn_iters"):
    cfg.require_int(config, f"model.{key}", minimum=0)
  cfg.require_float(config, "model.dropout_rate", minimum=0.0, maximum=1.0)
  validate_remat(config)
  check_file("model.glove_path")

  cfg.require_choice(config, "constraints.weight", (0, 1, 0.0, 1.0))
  _require_spec(config, "constraints", lambda: constraint_spec(config))
  cfg.require_int(config, "constraints.dual_start_step", minimum=0)
  cfg.require_int(config, "constraints.dual_ramp_steps", minimum=0)
  for key in ("step_size", "init_multiplier", "multiplier_cap", "penalty", "penalty_max"):
    cfg.require_float(config, f"constraints.{key}", minimum=0.0)
  cfg.require_float(config, "constraints.penalty_growth", minimum=1.0)

  cfg.require_int(config, "data.vocab_size", minimum=16)
  cfg.require_choice(config, "data.tokenizer_type", ("unigram", "bpe"))
  for key in ("max_train_examples", "max_eval_examples"):
    cfg.require_int(config, f"data.{key}", minimum=0)
  tfds = uses_tfds(config)
  if task == "classification":
    cfg.require_choice(config, "data.pair_task", nli.TASKS)
    cfg.require_int(config, "data.max_len", minimum=8)
    cfg.require_float(config, "data.eval_fraction", minimum=0.0, maximum=0.9)
    if cfg.require_choice(config, "data.generator", ("", *GENERATORS)):
      _validate_generator(config)
    elif not tfds:
      check_file("data.train_file", "the training sentence pairs")
      if config.data.eval_file:
        check_file("data.eval_file")
      elif config.data.eval_fraction <= 0:
        raise ConfigError(
            "data.eval_fraction", "must be > 0 when data.eval_file is empty (no eval set)"
        )
    check_file("data.challenge_file")
  else:
    cfg.require_int(config, "data.max_source_len", minimum=4)
    cfg.require_int(config, "data.max_target_len", minimum=4)
    if not tfds:
      check_file("data.train_source", "source side of the training text")
      check_file("data.train_target", "target side of the training text")
      check_file("data.eval_source", "source side of the evaluation text")
      check_file("data.eval_target", "target side of the evaluation text")
    cfg.require_float(config, "nmt.label_smoothing", minimum=0.0, maximum=0.99)
    cfg.require_int(config, "nmt.beam_size", minimum=1)
    cfg.require_float(config, "nmt.alpha", minimum=0.0)
    cfg.require_int(config, "nmt.max_decode_len", minimum=2)
    cfg.require_int(config, "nmt.max_eval_sentences", minimum=0)
    cfg.require_choice(config, "nmt.detokenize", ("auto", "moses", "none"))
    cfg.require_choice(config, "data.reverse", (False, True))
  cfg.require_int(config, "plots.num_examples", minimum=0)

  validate_optimizer_config(config)
  cfg.require_float(config, "peak_flops_per_device", minimum=0.0)


def paper_config(
    *, task: str, size: str, attention: str, gcn_hops: int = 1, steps: int = 0, seed: int = 0
) -> ml_collections.ConfigDict:
  """The Causal Transformers paper's Sec. 4 settings (size="full") or a CPU-scale one ("small").

  Classification "full" is BERT-base shaped (d 768, 12 layers, 12 heads, FFN 3072; the paper
  trains "with the hyper-parameters same with BERT-base", dropout 0.1 outside the attention,
  warm-up 12800 steps). Translation "full" is the paper's d_model 512, 6 layers, 8 heads,
  d_k = d_v = 64 (FFN 2048, label smoothing 0.1, beam 4, alpha 0.6 as in Vaswani et al.; the
  paper does not give them). "small" is a tiny model for a few hundred CPU steps.
  """
  if size not in ("full", "small"):
    raise ConfigError("size", f"must be 'full' or 'small', got {size!r}")
  if attention not in ATTENTION_KINDS:
    raise ConfigError(
        "attention", f"must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}"
    )
  config = base_config()
  config.task = task
  config.seed = seed
  config.model.attention = attention
  config.model.gcn_hops = gcn_hops
  config.constraints.weight = 1.0 if attention == "causal" else 0.0
  small = size == "small"
  if small:
    # The model and run cadence are base_config's. 300 steps ended at chance on the MNLI sample
    # (docs/design.md, "Defaults and the split that chose them").
    config.num_train_steps = 1500
    config.optimizer.update(learning_rate=1e-3, weight_decay=0.01)
  if task == "classification":
    config.data.max_len = 64 if small else 128
    config.data.vocab_size = 1000 if small else 30000
    if not small:
      config.update_from_flattened_dict(
          {
              "model.dim": 768,
              "model.num_layers": 12,
              "model.num_heads": 12,
              "model.mlp_dim": 3072,
              "eval_batch_size": 128,
              "num_train_steps": 1_000_000,
              "log_every_steps": 200,
              "eval_every_steps": 10_000,
              "checkpoint_every_steps": 10_000,
              "optimizer.learning_rate": 1e-4,
              "optimizer.warmup_steps": 12_800,
              "optimizer.weight_decay": 0.01,
          }
      )
  else:
    config.data.tokenizer_type = "bpe"
    if small:
      config.update_from_flattened_dict(
          {
              "data.vocab_size": 1000,
              "data.max_source_len": 32,
              "data.max_target_len": 32,
              "nmt.max_decode_len": 32,
              "nmt.beam_size": 2,
              "nmt.max_eval_sentences": 64,
              # From step 0 the decoder's attention collapsed (docs/design.md, "Defaults and
              # the split that chose them").
              "constraints.dual_start_step": 500,
              "constraints.dual_ramp_steps": 1000,
          }
      )
    else:
      config.update_from_flattened_dict(
          {
              "data.vocab_size": 32000,
              "data.max_source_len": 128,
              "data.max_target_len": 128,
              "nmt.max_decode_len": 160,
              "model.dim": 512,
              "model.num_layers": 6,
              "model.num_decoder_layers": 6,
              "model.num_heads": 8,
              "model.head_dim": 64,
              "model.mlp_dim": 2048,
              "batch_size": 256,
              "eval_batch_size": 64,
              "num_train_steps": 100_000,
              "log_every_steps": 200,
              "eval_every_steps": 5_000,
              "checkpoint_every_steps": 5_000,
              "optimizer.learning_rate": 7e-4,
              "optimizer.warmup_steps": 4_000,
              "optimizer.weight_decay": 0.0,
          }
      )
  if steps:
    config.num_train_steps = steps
  return config


def paper_config_from_arg(
    arg: str | None, *, task: str, size: str = "full", **extra: Any
) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """(paper_config, parsed arg) of a config file's `get_config(arg)`; `extra`: its own arguments."""
  arg = cfg.parse_arg(arg, size=size, attention="causal", gcn_hops=1, steps=0, seed=0, **extra)
  config = paper_config(
      task=task,
      size=arg.size,
      attention=arg.attention,
      gcn_hops=arg.gcn_hops,
      steps=arg.steps,
      seed=arg.seed,
  )
  return config, arg


def testbed_small_settings(config: ml_collections.ConfigDict, attention: str, steps: int) -> None:
  """The generated testbeds' size=small settings (configs/spurious_pairs.py, ood_pairs.py), chosen
  on the spurious-pairs validation split (docs/design.md, 'Defaults and the split that chose
  them'); the dual step ramps from step 500: from step 0 the constraint sparsifies attention
  before the relation is learnt."""
  config.batch_size = 64
  config.optimizer.learning_rate = 1e-3 if attention == "vanilla" else 3e-3
  config.model.dropout_rate = 0.0
  if not steps:
    config.num_train_steps = 2000
  config.constraints.dual_start_step = 500
  config.constraints.dual_ramp_steps = 1000
  config.constraints.step_size = 0.01


def generator_spec(config: ml_collections.ConfigDict) -> Any:
  """The spec (`SpuriousPairsSpec` or `OodPairsSpec`) of config.data.generator's settings."""
  section, spec_class, _ = GENERATORS[config.data.generator]
  return spec_class(**config.data[section].to_dict())


def constraint_applied(config: ml_collections.ConfigDict) -> bool:
  """Eq. 6's Lagrangian is added only to causal runs (and constraints.weight > 0)."""
  return config.model.attention == "causal" and float(config.constraints.weight) > 0


def constraint_spec(config: ml_collections.ConfigDict) -> constraints_lib.ConstraintSpec:
  """The reading of Eqs. 2-3 that `config.constraints` names."""
  c = config.constraints
  return constraints_lib.ConstraintSpec(form=c.form, loss=c.loss, encoder_band=c.encoder_band)
