"""The share of the roofline bound a real step reaches, per platform, from public step times
(docs/scaling.md, "Calibration"; `results/records/calibration.json`'s values, tests check)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Calibration:
  """One platform's calibration: the utilisation, the public rows it is from, and `band`, the
  utilisations that bound the printed step range (`paper_runner.calibration.band`: every
  calibration point, widened by the spread between jax versions; rounded outwards)."""

  utilization: float
  source: str
  band: tuple[float, float]


CALIBRATION: dict[str, Calibration] = {
    # big_vision's float32 ViT-S/16 on a TPU v3-8 (90 epochs in 6-7 h, 300 in under a day) and
    # deit3-jax's float32 DeiT-S/16 and DeiT-B/16 on a v4-64 (300 epochs in 2h43m and 4h40m).
    "tpu": Calibration(
        0.94,
        source="ViT-S/16 on a TPU v3-8 (big_vision) and DeiT-S/B on a v4-64 (deit3-jax), float32",
        band=(0.50, 1.61),
    ),
    # NVIDIA JAX-Toolbox's ViT-B/16 pre-training on 8 A100s and on 8 H100s (t5x, bfloat16); the
    # band also holds our CelebA DeiT-S step measured on two lent H200s.
    "gpu": Calibration(
        0.36, source="ViT-B/16 on 8 A100s and on 8 H100s (JAX-Toolbox t5x)", band=(0.30, 0.59)
    ),
}
