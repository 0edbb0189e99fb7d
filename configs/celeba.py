r"""CelebA (paper Table 1, right): target Attractive, sensitive Male, Chubby, Goatee.

--config.data.root=DIR is required: DIR holds the official layout (img_align_celeba/,
list_attr_celeba.txt, list_eval_partition.txt; README.md, "Data"), and the official partition is
used. tfds celeb_a, prepared beforehand, is the alternative: --config.data.name=celeba_tfds
--config.data.tfds_data_dir=DIR. The default size=full is the paper's run (DeiT-S at 224 px for
500 epochs, an accelerator job); size=small below runs on a CPU.

One command per table cell:
  python -m fairmoe_jax.main --config=configs/celeba.py:method=fairsmoe,backbone=deit_s \
      --config.data.root=/data/celeba --workdir=/tmp/celeba_fairsmoe_deit_s
Whether it fits an accelerator, and what it costs, compiled here without one or the data
(README, "Before paying for an accelerator"; docs/scaling.md has every backbone and method):
  python -m fairmoe_jax.main --config=configs/celeba.py:method=fairsmoe,backbone=deit_s \
      --mode=compile --config.preflight.target=h100x8 --workdir=/tmp/preflight_h100x8

Arguments (`--config=configs/celeba.py:key=value,...`):
  method    fairsmoe | vanilla_smoe | vanilla_smoe_psi | muffin | multifair | fairsmoe_no_fgr |
            fairsmoe_no_fem
  backbone  deit_s | deit_b | swin_s | swin_b (size=full)
  size      full (224 px, the paper's 500 epochs; an accelerator job) or small (64 px, a
            tiny backbone, 8 epochs; CPU)
  epochs    overrides the size's number of epochs
  seed      run seed (also the data order)
  psi       the L_Psi rule: pqd+dp (the default on every dataset: PQD, the paper's headline
            metric, and DP trained together, each with its lambda chosen on the validation
            split; docs/design.md, "One L_Psi rule"), or pqd or dp alone (the paper trains
            each reported metric with its own loss, Sec. 4.1)

CPU-scale run on the sample in ../shared/data (only Attractive and Male are known for all its
images, so the sensitive attribute is Male):
  python -m fairmoe_jax.main --config=configs/celeba.py:size=small \
      --config.data.root=../shared/data/celeba --config.data.sensitive=Male --workdir=/tmp/celeba

FairSMoE's defaults route from the SA classifiers' predictions (no sensitive label at
evaluation), read Eq. 8 literally as `fair.specialization=expert_competence`, and review the
expert allocation on the validation split every 30 steps at size=small, 2,000 at size=full
(`fair.review_every_steps`); other readings: `--config.fair.specialization=attribute_routing`
or `class_routing` (docs/design.md).

Expected result: docs/results.md, table `fair_comparison_celeba` (FairSMoE under three readings
of Eq. 8, its two ablations, vanilla SMoE with and without L_Psi, Muffin and MultiFair at
size=small on the sample, 3 epochs, 5 paired seeds; generated from
results/records/fair_comparison_celeba.json by results/fair_comparison_celeba.py;
`python -m experiments.tables --reproduce=fair_comparison_celeba` reruns its first row). The paper
reports 86.01% accuracy / 0.787 MF-PQD for FairSMoE DeiT-S, a full-data, full-scale number we
have not reached.
"""

from fairmoe_jax.paper_config import paper_config
from trainkit.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(
      arg, method="fairsmoe", backbone="deit_s", size="full", epochs=0, seed=0, psi="pqd+dp"
  )
  epochs = arg.epochs or (500 if arg.size == "full" else 8)
  config = paper_config(
      dataset="celeba",
      method=arg.method,
      backbone=arg.backbone,
      size=arg.size,
      epochs=epochs,
      seed=arg.seed,
  )
  config.data.target = "Attractive"
  config.data.sensitive = "Male,Chubby,Goatee"
  config.data.num_classes = 2
  config.fair.psi = arg.psi
  return config
