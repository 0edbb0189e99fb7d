r"""The rule that picks the CelebA sample's second target, before any comparison run on it.

  python scripts/celeba_target.py --root=../shared/data/celeba

The rule (docs/protocol.md, section 7, "Second target rule") reads fold 0's training and
validation folds only: candidates with a training positive rate in [20%, 80%] and |phi| <= 0.5
with every sensitive attribute, then the best validation balanced accuracy of a ridge probe on
16x16 pixels. Prints every candidate with its numbers, the excluded ones with the reason, and the
choice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

from fairmoe_jax.data import celeba, images
from trainkit.errors import exit_on_user_error

SENSITIVE = ("Male", "Chubby", "Goatee")
FIRST_TARGET = "Attractive"
POSITIVE_RATE = (0.2, 0.8)
MAX_PHI = 0.5
PROBE_SIZE = 16
RIDGE_LAMBDA = 100.0


def phi(a: np.ndarray, b: np.ndarray) -> float:
  """The correlation of two 0/1 arrays (0.0 where either is constant)."""
  return 0.0 if a.std() == 0 or b.std() == 0 else float(np.corrcoef(a, b)[0, 1])


def ridge_probe(
    train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, lam: float = RIDGE_LAMBDA
) -> np.ndarray:
  """0/1 predictions on `val_x` of a ridge regression of the -1/1 labels on standardised
  features (float64, closed form, with an unpenalised intercept)."""
  mean, std = train_x.mean(0), train_x.std(0) + 1e-8
  x, v = (train_x - mean) / std, (val_x - mean) / std
  y = 2.0 * train_y - 1.0
  w = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ (y - y.mean()))
  return (v @ w + y.mean() > 0).astype(np.int64)


def balanced_accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
  """Mean of the true-positive and true-negative rates (0.5 for a constant guess)."""
  rates = [np.mean(predictions[labels == c] == c) for c in (0, 1) if np.any(labels == c)]
  return float(np.mean(rates))


def rank_targets(root: str, fold: int = 0, num_folds: int = 5) -> list[dict[str, Any]]:
  """Every attribute with its training positive rate, max |phi| with a sensitive attribute,
  validation balanced accuracy of the probe (eligible ones) and `excluded` (the reason, or "")."""
  attr_path = os.path.join(root, "list_attr_celeba.txt")
  names = celeba.read_attribute_names(attr_path)
  _, splits = celeba.load_celeba(
      root=root,
      sensitive=("Male",),
      image_size=PROBE_SIZE,
      preload=False,
      num_folds=num_folds,
      fold=fold,
  )
  rows, values = celeba.read_attributes(attr_path, names)
  row_of = {image: i for i, image in enumerate(rows)}
  parts = {}
  for split in ("train", "val"):
    paths = splits[split]["path"]
    index = [row_of[os.path.basename(str(p))] for p in paths]
    pixels = images.load_images(paths, PROBE_SIZE).reshape(len(paths), -1).astype(np.float64)
    parts[split] = (pixels, values[index])
  (train_x, train_v), (val_x, val_v) = parts["train"], parts["val"]
  ranked = []
  for j, name in enumerate(names):
    if name == FIRST_TARGET or name in SENSITIVE:
      continue
    rate = float(train_v[:, j].mean())
    max_phi = max(abs(phi(train_v[:, j], train_v[:, names.index(s)])) for s in SENSITIVE)
    entry = dict(attribute=name, positive_rate=rate, max_phi=max_phi, excluded="")
    if not POSITIVE_RATE[0] <= rate <= POSITIVE_RATE[1]:
      entry["excluded"] = "positive rate"
    elif max_phi > MAX_PHI:
      entry["excluded"] = "|phi| with a sensitive attribute"
    else:
      predictions = ridge_probe(train_x, train_v[:, j], val_x)
      entry["validation_balanced_accuracy"] = balanced_accuracy(val_v[:, j], predictions)
    ranked.append(entry)
  ranked.sort(key=lambda e: (e["excluded"] != "", -e.get("validation_balanced_accuracy", 0.0)))
  return ranked


_ROOT = flags.DEFINE_string(
    "root", "../shared/data/celeba", "CelebA layout with identity_CelebA.txt"
)


@exit_on_user_error
def main(argv: Sequence[str]) -> None:
  del argv
  ranked = rank_targets(_ROOT.value)
  print(f"{'attribute':<22} {'pos. rate':>9} {'max |phi|':>9} {'val. bal. acc.':>14}  excluded")
  for e in ranked:
    score = e.get("validation_balanced_accuracy")
    shown = f"{score:14.3f}" if score is not None else f"{'':14}"
    print(
        f"{e['attribute']:<22} {e['positive_rate']:9.3f} {e['max_phi']:9.3f} {shown}  {e['excluded']}"
    )
  print(f"Second target: {ranked[0]['attribute']}")


if __name__ == "__main__":
  app.run(main)
