r"""Command line: train then evaluate; evaluate, predict with or export the latest checkpoint.

  python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart
  python -m fairmoe_jax.main --config=configs/quickstart.py:steps=50 --workdir=/tmp/q \
      --config.batch_size=64 --mode=eval
  python -m fairmoe_jax.main --workdir=/tmp/quickstart --mode=predict --config.predict.input=DIR
  python -m fairmoe_jax.main --workdir=/tmp/quickstart --mode=export
  python -m fairmoe_jax.main --config=configs/celeba.py:backbone=deit_s --mode=compile \
      --config.preflight.target=h100x8 --workdir=/tmp/preflight

Without --config, eval, predict and export read the trained run's <workdir>/config.json
(--config.KEY=VALUE overrides still apply); predict and export need no dataset (the class names
and preprocessing are in <workdir>/run_info.json), eval reads the test split from
--config.data.root (config.json's unless overridden). compile needs --config and no data or
accelerator: it compiles the run for --config.preflight.target (docs/scaling.md lists them;
python -m trainkit.preflight.compilers) and writes <workdir>/preflight.json.
"""

from __future__ import annotations

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import inference, train
from fairmoe_jax.preflight import preflight_program
from trainkit import cli

main = cli.train_eval_command(
    validate=fairmoe_config.validate,
    train_and_evaluate=train.train_and_evaluate,
    evaluate_checkpoint=train.evaluate_checkpoint,
    checkpoint_modes={
        "predict": (
            inference.predict_checkpoint,
            "classify the images of --config.predict.input (a folder or a list file) with the "
            "latest checkpoint, into <workdir>/predict/predictions.csv",
        ),
        "export": (
            inference.export_checkpoint,
            "write the latest checkpoint as a timm-named safetensors file, "
            "<workdir>/export/model.safetensors, and timm's config.json beside it (the timm "
            "model, its arguments and preprocessing, or why timm cannot load it)",
        ),
    },
    preflight_program=preflight_program,
)

if __name__ == "__main__":
  main()
