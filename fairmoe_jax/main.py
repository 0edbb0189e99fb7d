r"""Command line: train then evaluate, evaluate the latest checkpoint, or export it.

  python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart
  python -m fairmoe_jax.main --config=configs/quickstart.py:steps=50 --workdir=/tmp/q \
      --config.batch_size=64 --mode=eval
  python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart --mode=export
"""

from __future__ import annotations

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import train
from trainkit import cli

main = cli.train_eval_command(
    validate=fairmoe_config.validate,
    train_and_evaluate=train.train_and_evaluate,
    evaluate_checkpoint=train.evaluate_checkpoint,
    checkpoint_modes={
        "export": (
            train.export_checkpoint,
            "write the latest checkpoint as a timm-named safetensors file, "
            "<workdir>/export/model.safetensors",
        )
    },
)

if __name__ == "__main__":
  main()
