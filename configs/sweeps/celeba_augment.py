r"""Sweep: the augmentation strength of the CelebA sample at the chosen budget, on validation.

  python -m paper_runner.sweep --sweep=configs/sweeps/celeba_augment.py --workdir=/tmp/celeba_augment

Vanilla SMoE as in configs/sweeps/celeba_budget.py, at its chosen budget, under four strengths;
the rule that reads them is docs/protocol.md section 7:
  none     no crop and no flip: the image is only resized
  weak     random resized crop of 0.7 to 1 of the area, horizontal flips
  shipped  random resized crop of 0.35 to 1 of the area, horizontal flips (size=small's)
  strong   random resized crop of 0.08 to 1 of the area (torchvision's default), flips

Arguments, e.g. `:seeds=2`:
  epochs  the budget (default 3)
  seeds   seeds 0..seeds-1 per strength (default 1)
  target  the target attribute (default Attractive)
"""

import importlib.util
import os

import ml_collections

from trainkit.config import parse_arg

# The budget curve's sweep file, beside this one (configs/sweeps is a folder of files, not a
# package): both curves are its fold-0 setting, varied along one axis each.
_BUDGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "celeba_budget.py")
_spec = importlib.util.spec_from_file_location("_celeba_budget", _BUDGET)
celeba_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(celeba_budget)

_CROP = "data.augment.crop_scale"
# Each strength is a value of the crop scale; "none" also turns the crop and the flip off.
STRENGTHS = {
    "none": "(1.0, 1.0)@data.augment.random_resized_crop=False@data.augment.horizontal_flip=False",
    "weak": "(0.7, 1.0)",
    "shipped": "(0.35, 1.0)",
    "strong": "(0.08, 1.0)",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, epochs=3, seeds=1, target="Attractive")
  return celeba_budget.fold0_curve(
      {_CROP: tuple(STRENGTHS.values()), "seed": tuple(range(arg.seeds))},
      arg.target,
      num_epochs=arg.epochs,
  )
