r"""ISIC 2019 (paper Table 1, left): 8 diagnostic classes, sensitive sex, age (5 bins), site.

  python -m fairmoe_jax.main --config=configs/isic2019.py:method=fairsmoe,backbone=deit_s \
      --config.data.root=/data/isic2019 --workdir=/tmp/isic_fairsmoe_deit_s

--config.data.root holds the official layout; the split is the paper's seeded 80:20 train/test
with 5% of train as validation, or --config.data.split=<dir with train.csv, val.csv, test.csv>.
Missing metadata is an "unknown" group (--config.data.missing=exclude drops it from the metrics).
Arguments: as configs/celeba.py (method, backbone, size=full|small, epochs, seed); the paper
trains 300 epochs. The sample in ../shared/data (132 images) only exercises the pipeline. No
generated table; the paper's 77.25% accuracy / 0.801 MF-PQD (FairSMoE DeiT-S) is not reached.
"""

from fairmoe_jax.paper_config import paper_config
from trainkit.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, method="fairsmoe", backbone="deit_s", size="full", epochs=0, seed=0)
  epochs = arg.epochs or (300 if arg.size == "full" else 8)
  config = paper_config(
      dataset="isic2019",
      method=arg.method,
      backbone=arg.backbone,
      size=arg.size,
      epochs=epochs,
      seed=arg.seed,
  )
  config.data.sensitive = "sex,age,site"
  config.data.num_classes = 8
  if arg.size == "small":
    config.batch_size = 32
    config.eval_batch_size = 32
  return config
