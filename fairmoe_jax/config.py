"""Default config of a fairmoe_jax run and its validation (before anything is compiled)."""

from __future__ import annotations

import ml_collections

from fairmoe_jax.data import GENERATED_INFO
from fairmoe_jax.data.pipeline import TRAIN_RESAMPLING
from fairmoe_jax.fairness.surrogates import PSI_RULES
from fairmoe_jax.methods import METHODS
from fairmoe_jax.methods.fairsmoe import FairSMoE
from fairmoe_jax.metrics.intersections import parse_intersections
from fairmoe_jax.models.backbones import BACKBONES
from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS
from fairmoe_jax.moe.dispatch.expert_parallel import EP_ALGORITHMS
from fairmoe_jax.moe.layer import ROUTERS
from fairmoe_jax.moe.routers.fair import ROUTE_BY, SPECIALIZATIONS
from trainkit import config as cfg
from trainkit.config import parse_arg
from trainkit.errors import ConfigError
from trainkit.optim import default_optimizer_config, validate_optimizer_config
from trainkit.preflight.compile import preflight_config, validate_preflight
from trainkit.remat import validate_remat

DATASETS = (*GENERATED_INFO, "celeba", "celeba_tfds", "isic2019")


def base_config() -> ml_collections.ConfigDict:
  """Every key a run reads, with defaults; config files override what they need."""
  config = ml_collections.ConfigDict()
  config.method = "fairsmoe"  # fairmoe_jax/methods/: METHODS
  cfg.add_run_keys(config, batch_size=128, eval_batch_size=256, num_epochs=0)
  config.preflight = preflight_config()  # --mode=compile (docs/scaling.md).
  config.analysis_batches = 4  # Validation batches for the gradient-conflict analysis (Fig. 6).
  config.plots = True  # The finished run's PNGs (fairmoe_jax.analysis): a sweep may skip them.
  # The test report (report.json, README "Reading the fairness report").
  config.eval = ml_collections.ConfigDict(
      dict(
          # Intersections of sensitive attributes to score too, e.g. "sex*age,age*site".
          intersections="",
          # Smaller intersection groups are listed as small_groups; metrics also without them.
          min_group_size=30,
      )
  )

  config.data = ml_collections.ConfigDict(
      dict(
          name="synthetic",
          image_size=32,
          num_classes=4,
          seed=0,
          train_size=8000,
          val_size=1000,
          test_size=2000,
          # synthetic: each sensitive group also tints the image (data/synthetic.py `cue_colours`;
          # the quickstart's data). False: the original benchmark (the results tables' data).
          attribute_cues=False,
          num_threads=2,
          prefetch_buffer_size=4,
          # Batch-preparing worker processes (grain's mp_prefetch; 0: in-process). Decoding
          # files needs about one core per 500 images/s (docs/benchmarks.md, "Input pipeline").
          num_workers=0,
          # preload=False: "one_pass" resamples the crop from the file, "two_pass" via a square.
          train_resampling="one_pass",
          # Decode the validation split's image files once, into memory, rather than at every
          # evaluation (preload=False; uint8 at image_size: 3 GB for CelebA's 19,867 at 224 px).
          cache_eval_images=True,
          # Real datasets (celeba, celeba_tfds, isic2019): see fairmoe_jax/data/.
          root="",  # Directory of the official layout.
          tfds_data_dir="",  # celeba_tfds: where tfds prepared celeb_a.
          target="Attractive",  # celeba: target attribute column.
          sensitive="",  # Comma-separated; "" = the dataset's paper default.
          attr_file="list_attr_celeba.txt",
          missing="unknown",  # isic2019: missing metadata as an "unknown" group, or "exclude".
          split="random",  # isic2019: "random" (paper's 80:20, 5% val) or a split dir / CSV.
          split_seed=0,
          test_fraction=0.2,
          val_fraction=0.05,
          preload=True,  # Decode all images once at load (small data); False decodes per step.
          max_examples_per_split=0,  # > 0 truncates each split (small runs).
      )
  )
  config.data.augment = ml_collections.ConfigDict(
      dict(
          random_resized_crop=True,
          crop_scale=(0.35, 1.0),
          crop_ratio=(3 / 4, 4 / 3),
          horizontal_flip=True,
      )
  )

  config.model = ml_collections.ConfigDict(
      dict(
          backbone="vit",  # fairmoe_jax/models/backbones.py: vit (shape below), deit_s, swin_s, ...
          pretrained="",  # A timm checkpoint (.safetensors / .npz) to start from.
          patch_size=4,
          dim=64,
          depth=4,
          num_heads=4,
          mlp_dim=128,
          dropout_rate=0.0,
          # Block rematerialisation in training (trainkit/remat.py, docs/design.md): none |
          # dots (keep the linear layers' outputs) | block (keep only each block's input).
          remat="none",
      )
  )
  config.moe = ml_collections.ConfigDict(
      dict(
          blocks=(-1,),
          num_experts=4,
          top_k=2,
          capacity_factor=1.25,
          eval_capacity_factor=2.0,
          # Token choice's C rounded up to a multiple of it. 1, the papers' C: a rounding
          # changes which tokens drop, which only a validation split may choose, and at 8 (a
          # float32 TPU tile) the default TPU dispatch's bytes are unchanged (docs/benchmarks.md,
          # "Capacity granularity and routing groups"); 8 helps einsum_fused.
          capacity_multiple_of=1,
          # Examples whose tokens compete for the same expert slots (token choice); 1 is the
          # papers' reading, V-MoE groups several images per device.
          group_size=1,
          # auto | dense | einsum | sort | dropless (moe/dispatch) | einsum_fused | sort_blocks |
          # blocksparse (moe/experimental); auto: sort on CPU and GPU, einsum on TPU
          # (methods/base.py AUTO_DISPATCH).
          dispatch="auto",
          router="topk",  # topk | noisy_topk | expert_choice (fairmoe_jax/moe/layer.py)
          batch_priority=False,  # V-MoE batch-priority routing
          # For every MoE method; none, as the paper's SMoE ("excluding any auxiliary loss or
          # noisy gating") and FairSMoE's total loss (Sec. 5.3).
          aux_loss_weight=0.0,
          z_loss_weight=0.0,
      )
  )
  config.fair = ml_collections.ConfigDict(
      dict(
          # L_Psi (Eq. 3-4), one rule for every dataset and method (docs/design.md, "One L_Psi
          # rule"): pqd | dp | pqd+dp, each with its lambda (results/lambda_tuning.py).
          psi="pqd+dp",
          lambda_pqd=0.1,
          lambda_dp=0.1,
          alpha=0.6,  # Eq. 8 focus weight, paper Sec. 6.1.
          # Reading of Eq. 8 (moe/routers/fair.py): expert_competence (the literal one; their
          # comparison is undecided, results/fair_comparison_*.py) | attribute_routing |
          # class_routing.
          specialization="expert_competence",
          # FGR's attribute vector from the SA classifiers ("predicted", Algorithm 1: no
          # sensitive label at inference) or from the true class ("label", a training study).
          route_by="predicted",
          feature_dim=0,  # Width of FGR's feature extractor phi; 0 = model width.
          confusion_weight=1.0,
          attribute_ce_weight=1.0,
          specialization_weight=1.0,
          dynamic_allocation=True,  # FEM: grow/shrink each attribute's experts at reviews.
          review_every_steps=50,  # FEM reviews on the validation split; 0 disables them.
          patience=2,  # Reviews SF_a must hold or improve before a growth (n, Sec. 5.3).
          tolerance=0.01,  # A drop of SF_a up to this still counts as "stable".
      )
  )
  config.muffin = ml_collections.ConfigDict(
      # One backbone per listed attribute index; () = the first two (or the only one).
      dict(attributes=(), pretrain_fraction=0.5)
  )
  config.multifair = ml_collections.ConfigDict(dict(mixup_alpha=1.0, weight=1.0))
  config.optimizer = default_optimizer_config()
  # None in the paper (Sec. 6.1); a shared clip norm would touch only FairSMoE's larger gradients.
  config.optimizer.grad_clip_norm = 0.0
  return config


def quickstart_config(
    arg: str | None = None, *, data_name: str = "synthetic"
) -> ml_collections.ConfigDict:
  """configs/quickstart.py's run (`arg` as its); configs/synthetic_testbed.py's with `data_name`."""
  # `cues` (synthetic only): data.attribute_cues (docs/dataset.md, "Attribute cues").
  cues = {"cues": True} if data_name == "synthetic" else {}
  arg = parse_arg(arg, steps=350, experts=4, top_k=2, **cues)
  config = base_config()
  config.data.name = data_name
  config.data.attribute_cues = bool(arg.get("cues", False))
  config.num_train_steps = arg.steps
  config.log_every_steps = 20
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 200
  config.fair.review_every_steps = 50  # FEM reviews the allocation 6 times.
  config.batch_size = 128

  config.moe.num_experts = arg.experts
  config.moe.top_k = arg.top_k

  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 40
  config.optimizer.weight_decay = 0.05
  return config


def _missing_root_message(config: ml_collections.ConfigDict) -> str:
  """How to name the data directory, what it holds, and what the run would cost."""
  # Imported here, on this error path only: the readers pull in the input pipeline.
  from fairmoe_jax.data import celeba, isic  # pylint: disable=g-import-not-at-top

  name = config.data.name
  if name == "celeba":
    files = f"{celeba.IMAGE_DIR}/, {config.data.attr_file} and {celeba.PARTITION_FILE}"
    alternative = (
        "; or read tfds celeb_a (prepared beforehand, never downloaded) with "
        "--config.data.name=celeba_tfds --config.data.tfds_data_dir=DIR"
    )
  else:
    files = f"{isic.IMAGE_DIR}/, {isic.GROUND_TRUTH_FILE} and {isic.METADATA_FILE}"
    alternative = ""
  message = (
      f"{name} reads the official layout from a directory: add --config.data.root=DIR, where "
      f'DIR holds {files} (docs/running.md, "Datasets"){alternative}.'
  )
  if config.data.image_size > 64:  # The paper's scale, not the CPU-scale size=small.
    length = (
        f"{config.num_epochs} epochs" if config.num_epochs else f"{config.num_train_steps} steps"
    )
    message += (
        f" This config trains {config.model.backbone} at {config.data.image_size} px for "
        f"{length}, an accelerator job; configs/{name}.py:size=small is the CPU-scale run "
        "(64 px, a tiny backbone)."
    )
  return message


def validate(
    config: ml_collections.ConfigDict,
    *,
    num_devices: int,
    num_processes: int = 1,
    check_data: bool = True,
) -> None:
  """Raises ConfigError naming the first key with a wrong type or an impossible value.

  `check_data=False` skips the keys that locate the dataset (`data.root`,
  `data.tfds_data_dir`): the modes that read only a trained workdir (predict, export) need none.
  """
  data_size, expert_size = cfg.validate_run(
      config, num_devices=num_devices, num_processes=num_processes
  )
  validate_preflight(config)
  cfg.require_int(config, "analysis_batches", minimum=0)
  cfg.require_float(config, "peak_flops_per_device", minimum=0.0)
  intersections = cfg.get(config, "eval.intersections")
  try:
    parse_intersections(intersections)
  except (ValueError, AttributeError, TypeError) as e:
    # Names are checked against the dataset's attributes once it is loaded (train._setup).
    raise ConfigError("eval.intersections", f"{e} (expected e.g. 'sex*age,age*site')") from None
  cfg.require_int(config, "eval.min_group_size", minimum=0)

  cfg.require_choice(config, "method", METHODS)
  cfg.require_choice(config, "model.backbone", BACKBONES)
  cfg.require_choice(config, "fair.psi", PSI_RULES)
  cfg.require_choice(config, "fair.route_by", ROUTE_BY)
  cfg.require_choice(config, "fair.specialization", SPECIALIZATIONS)
  cfg.require_int(config, "fair.review_every_steps", minimum=0)
  cfg.require_float(config, "fair.tolerance", minimum=0.0)
  for key in (
      "fair.lambda_pqd",
      "fair.lambda_dp",
      "fair.confusion_weight",
      "fair.attribute_ce_weight",
  ):
    cfg.require_float(config, key, minimum=0.0)
  cfg.require_float(config, "fair.specialization_weight", minimum=0.0)
  cfg.require_float(config, "fair.alpha", minimum=0.0, maximum=1.0)
  cfg.require_int(config, "fair.feature_dim", minimum=0)
  cfg.require_int(config, "fair.patience", minimum=1)
  cfg.require_float(config, "muffin.pretrain_fraction", minimum=0.0, maximum=1.0)
  cfg.require_float(config, "multifair.mixup_alpha", minimum=1e-6)
  cfg.require_float(config, "multifair.weight", minimum=0.0)
  cfg.require_choice(config, "data.name", DATASETS)
  if check_data and config.data.name in ("celeba", "isic2019") and not config.data.root:
    raise ConfigError("data.root", _missing_root_message(config))
  if check_data and config.data.name == "celeba_tfds" and not config.data.tfds_data_dir:
    raise ConfigError("data.tfds_data_dir", "celeba_tfds needs the tfds data_dir of celeb_a")
  if "identity_folds" in config.data:  # configs/celeba.py:split=identity_folds adds the section.
    if config.data.name != "celeba":
      raise ConfigError(
          "data.identity_folds",
          "identity folds read identity_CelebA.txt of the official layout: data.name must be "
          f"celeba, not {config.data.name}",
      )
    # A training, a validation and a test fold at least (fairmoe_jax/data/celeba.py).
    num_folds = cfg.require_int(config, "data.identity_folds.num_folds", minimum=3)
    cfg.require_int(config, "data.identity_folds.fold", minimum=0, maximum=num_folds - 1)
  cfg.require_choice(config, "data.missing", ("unknown", "exclude"))
  cfg.require_int(config, "data.max_examples_per_split", minimum=0)
  if not isinstance(config.data.attribute_cues, bool):
    raise ConfigError("data.attribute_cues", "must be True or False")
  if config.data.attribute_cues and config.data.name != "synthetic":
    raise ConfigError(
        "data.attribute_cues", f"only the synthetic data has them, not {config.data.name}"
    )
  image_size = cfg.require_int(config, "data.image_size", minimum=8)
  cfg.require_int(config, "data.num_classes", minimum=2)
  for key in ("data.train_size", "data.val_size", "data.test_size"):
    cfg.require_int(config, key, minimum=1)
  if config.data.name in GENERATED_INFO:  # uint8 images in memory, all splits at once.
    sizes = {k: config.data[k] for k in ("train_size", "val_size", "test_size")}
    cfg.require_fits_in_host_memory(
        f"data.{max(sizes, key=sizes.get)}",
        sum(sizes.values()) * image_size * image_size * 3,
        f"the {config.data.name} dataset ({sum(sizes.values())} images of {image_size}x{image_size})",
    )
  if config.data.name in GENERATED_INFO and config.data.train_size < config.batch_size:
    raise ConfigError(
        "data.train_size",
        f"{config.data.train_size} training examples are fewer "
        f"than one batch (batch_size={config.batch_size})",
    )
  cfg.require_int(config, "data.num_threads", minimum=0)
  cfg.require_int(config, "data.num_workers", minimum=0)
  cfg.require_choice(config, "data.train_resampling", TRAIN_RESAMPLING)

  patch = cfg.require_int(config, "model.patch_size", minimum=1)
  if image_size % patch:
    raise ConfigError("model.patch_size", f"{patch} does not divide data.image_size={image_size}")
  dim = cfg.require_int(config, "model.dim", minimum=1)
  heads = cfg.require_int(config, "model.num_heads", minimum=1)
  if dim % heads:
    raise ConfigError("model.num_heads", f"{heads} does not divide model.dim={dim}")
  depth = cfg.require_int(config, "model.depth", minimum=1)
  cfg.require_int(config, "model.mlp_dim", minimum=1)
  cfg.require_float(config, "model.dropout_rate", minimum=0.0, maximum=1.0)
  validate_remat(config)

  num_experts = cfg.require_int(config, "moe.num_experts", minimum=1)
  top_k = cfg.require_int(config, "moe.top_k", minimum=1)
  if top_k > num_experts:
    raise ConfigError("moe.top_k", f"{top_k} exceeds moe.num_experts={num_experts}")
  if num_experts % expert_size:
    raise ConfigError(
        "moe.num_experts",
        f"{num_experts} experts cannot be split over the "
        f"mesh's expert axis of size {expert_size}",
    )
  for block in cfg.get(config, "moe.blocks"):
    if isinstance(block, bool) or not isinstance(block, int) or not -depth <= block < depth:
      raise ConfigError("moe.blocks", f"block index {block!r} is outside a model of depth {depth}")
  cfg.require_choice(config, "moe.dispatch", ("auto", *DISPATCH_ALGORITHMS))
  router = cfg.require_choice(config, "moe.router", ROUTERS)
  if not isinstance(cfg.get(config, "moe.batch_priority"), bool):
    raise ConfigError("moe.batch_priority", "must be True or False")
  if isinstance(METHODS[config.method], FairSMoE) and router != "topk":
    raise ConfigError(
        "moe.router",
        f"{router!r} cannot be used with method={config.method!r}, which routes with its "
        "fairness-guided router; use method=smoe to train another router",
    )
  if router == "expert_choice" and config.moe.batch_priority:
    raise ConfigError("moe.batch_priority", "applies to token-choice routers, not expert_choice")
  if router == "expert_choice" and expert_size > 1:
    raise ConfigError(
        "moe.router", f"expert_choice has no expert-parallel version (mesh.expert={expert_size})"
    )
  # "auto" resolves to an algorithm with an expert-parallel version on every platform.
  if expert_size > 1 and config.moe.dispatch not in ("auto", *EP_ALGORITHMS):
    raise ConfigError(
        "moe.dispatch",
        f"{config.moe.dispatch!r} has no expert-parallel version (mesh.expert={expert_size}); "
        f"use one of {', '.join(EP_ALGORITHMS)}",
    )
  for key in ("moe.capacity_factor", "moe.eval_capacity_factor"):
    cfg.require_float(config, key, minimum=1e-6)
  for key in ("moe.aux_loss_weight", "moe.z_loss_weight"):
    cfg.require_float(config, key, minimum=0.0)
  cfg.require_int(config, "moe.capacity_multiple_of", minimum=1)
  group_size = cfg.require_int(config, "moe.group_size", minimum=1)
  if group_size > 1 and router == "expert_choice":
    raise ConfigError("moe.group_size", f"{group_size}: expert_choice routes each example alone")
  for key in ("batch_size", "eval_batch_size"):  # A routing group never spans two devices.
    per_device = config[key] // (data_size * expert_size)
    if per_device % group_size:
      raise ConfigError(
          "moe.group_size", f"{group_size} does not divide {key}'s {per_device} examples per device"
      )
  validate_optimizer_config(config)
