r"""Command line of the Causal Transformer (paper 001): train then evaluate, or evaluate.

  python -m causal_attn_jax.main --config=configs/snli.py:size=small,attention=causal \
      --config.data.train_file=../shared/data/nli/snli_1.0_dev.jsonl \
      --config.data.eval_file=../shared/data/nli/snli_1.0_test.jsonl --workdir=/tmp/snli
  python -m causal_attn_jax.main --config=configs/snli.py:size=small ... --mode=eval

Writes <workdir>/report.json: classification {accuracy, macro_f1, challenge: {accuracy,
by_heuristic}, constraints: {rows_within, cols_within, per_layer, mean_multiplier}}; translation
{bleu, num_sentences, constraints}; plus metrics.jsonl, checkpoints/, plots/ (attention heatmaps).
"""

from __future__ import annotations

import jax
from absl import app, flags
from ml_collections import config_flags

from causal_attn_jax import config as causal_config
from causal_attn_jax import train
from trainkit import cli
from trainkit.errors import exit_on_user_error
from trainkit.workdir import prepare_workdir

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally `file.py:key=value,...`."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for the tokenizer, checkpoints, metrics and report.json."
)
_MODE = flags.DEFINE_enum(
    "mode",
    "train",
    ["train", "eval"],
    "train: train (resuming if possible) then evaluate; eval: evaluate the latest checkpoint.",
)
flags.mark_flags_as_required(["config", "workdir"])


@exit_on_user_error
def run(config, workdir: str, mode: str) -> None:
  causal_config.validate(config, num_devices=jax.device_count(), num_processes=jax.process_count())
  workdir = prepare_workdir(workdir)
  if mode == "train":
    train.train_and_evaluate(config, workdir)
  else:
    train.evaluate_checkpoint(config, workdir)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.quiet_logging()
  run(cli.loaded_config(_CONFIG), _WORKDIR.value, _MODE.value)


if __name__ == "__main__":
  cli.run(main)
