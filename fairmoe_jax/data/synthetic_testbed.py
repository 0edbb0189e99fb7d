"""The synthetic testbed: a generated multi-attribute fairness task whose signal a small model
learns, unlike the orientation of ``synthetic``'s stripes.

Attributes, label priors, hair, noise, blur and corner marker are ``synthetic``'s (its drawing
helpers are used). The class is the lesion's tint: its log-colour is the skin's shifted in the
chroma plane (orthogonal to grey, so brightness, darkness and vignette leave it alone) by
``amplitude = SIGNAL_STRENGTH x AGE_SIGNAL[age] x SITE_SIGNAL[site]`` along the class's
direction, plus jitter; ``sex`` only sets the hair. So attributes differ in difficulty (the
paper's Sec. 3.1), and ``read_lesion_tint`` is the oracle reader. docs/dataset.md ("The
synthetic testbed") gives the design argument and measured numbers.
"""

from __future__ import annotations

import numpy as np

from fairmoe_jax.data import synthetic
from fairmoe_jax.data.types import DatasetInfo

NAME = "synthetic_testbed"

# The signal: log-colour shift of the lesion in the chroma plane (natural-log units: 0.1 is
# about a 10% change of a channel), and the group factors that wash it out.
SIGNAL_STRENGTH = 0.16
TINT_JITTER = 0.055  # std of the class-independent tint shift, per chroma coordinate
AGE_SIGNAL = (1.0, 0.95, 0.85, 0.72, 0.6)  # by age group, youngest first
SITE_SIGNAL = (1.0, 1.0, 0.95, 0.85, 0.75, 0.62, 0.52, 0.42)  # by site, most common first

# Nuisance factors shared by all groups. Skin varies in brightness only, so that the lesion's
# chroma is the skin's plus the signal: a reader needs no skin estimate.
SKIN_BRIGHTNESS = (0.7, 1.0)  # multiplies synthetic.SKIN_LIGHT
LESION_DARKNESS = (0.55, 0.75)
LESION_RADIUS = (0.6, 0.85)  # semi-axes, in units of half the image side
CENTRE_STD, CENTRE_MAX = 0.05, 0.1  # lesion centre offset, normal, clipped
READ_RADIUS = 0.45  # the oracle reads the disk of this radius at the centre: inside the lesion

# Orthonormal basis of the chroma plane in log-RGB: red-green and yellow-blue.
CHROMA_BASIS = np.array([[1.0, -1.0, 0.0], [1.0, 1.0, -2.0]]) / np.sqrt([[2.0], [6.0]])


def tint_angles(num_classes: int) -> np.ndarray:
  """The chroma direction of each class in degrees, evenly spaced over the circle."""
  return 360.0 * np.arange(num_classes) / num_classes


def tint_directions(num_classes: int) -> np.ndarray:
  """Unit chroma direction of each class, float64 [K, 2] (coordinates in CHROMA_BASIS)."""
  angle = np.deg2rad(tint_angles(num_classes))
  return np.stack([np.cos(angle), np.sin(angle)], axis=1)


def class_names(num_classes: int) -> tuple[str, ...]:
  """Names of the tint classes, e.g. ``tint_090deg``."""
  return tuple(f"tint_{round(a):03d}deg" for a in tint_angles(num_classes))


def signal_amplitude(age: np.ndarray, site: np.ndarray) -> np.ndarray:
  """The class signal's amplitude for each example's groups, float64 [n]."""
  return SIGNAL_STRENGTH * np.take(AGE_SIGNAL, age) * np.take(SITE_SIGNAL, site)


def testbed_info(image_size: int = 32, num_classes: int = 4) -> DatasetInfo:
  return synthetic.generated_info(NAME, class_names(num_classes), image_size)


def lesion_chroma(images: np.ndarray) -> np.ndarray:
  """The lesion's tint read from uint8 images [N, S, S, 3]: chroma of the log mean colour of
  the central disk of radius READ_RADIUS, relative to the skin's, float64 [N, 2]."""
  y, x = synthetic.pixel_grid(images.shape[1])
  disk = (x * x + y * y)[0] <= READ_RADIUS**2  # [S, S]
  colour = images[:, disk].astype(np.float64).mean(axis=1)  # [N, 3]
  log_ratio = np.log(np.maximum(colour, 1.0)) - np.log(synthetic.SKIN_LIGHT.astype(np.float64))
  return log_ratio @ CHROMA_BASIS.T


def read_lesion_tint(images: np.ndarray, num_classes: int) -> np.ndarray:
  """The oracle reader: the class whose tint direction is nearest the lesion's chroma, int32 [N]."""
  scores = lesion_chroma(images) @ tint_directions(num_classes).T
  return np.argmax(scores, axis=1).astype(np.int32)


def _generate_chunk(
    seed: np.random.SeedSequence, size: int, num_classes: int, missing_rate: float
) -> dict[str, np.ndarray]:
  """Renders ``synthetic.CHUNK_SIZE`` examples from one seed (a ``synthetic.ChunkGenerator``)."""
  rng = np.random.default_rng(seed)
  n, k = synthetic.CHUNK_SIZE, num_classes

  # --- Latent variables, always drawn in this order for reproducibility.
  sex, age, site, label = synthetic.draw_groups_and_label(rng, n, k)
  tint = signal_amplitude(age, site)[:, None] * tint_directions(k)[label]
  tint += TINT_JITTER * rng.standard_normal((n, 2))
  centre = np.clip(rng.normal(0, CENTRE_STD, (2, n)), -CENTRE_MAX, CENTRE_MAX)
  radius = rng.uniform(*LESION_RADIUS, (2, n))
  tilt = rng.uniform(0, np.pi, n)
  skin = synthetic.SKIN_LIGHT * rng.uniform(*SKIN_BRIGHTNESS, (n, 1))
  lesion = skin * rng.uniform(*LESION_DARKNESS, (n, 1)) * np.exp(tint @ CHROMA_BASIS)
  vignette = rng.uniform(*synthetic.VIGNETTE, n)
  hair_on = rng.random((n, synthetic.NUM_HAIRS)) < np.take(synthetic.SEX_HAIR, sex)[:, None]
  hair_angle = rng.uniform(0, np.pi, (n, synthetic.NUM_HAIRS))
  hair_offset = rng.uniform(-0.8, 0.8, (n, synthetic.NUM_HAIRS))
  hair_colour = rng.uniform(20, 60, n)
  cue_ok = rng.random(n) < np.take(synthetic.SITE_CUE, site) * np.take(synthetic.SEX_CUE, sex)
  cue_class = np.where(cue_ok, label, rng.integers(0, k, n))
  noise_std = np.take(synthetic.SITE_NOISE, site) * rng.uniform(0.8, 1.2, n)
  noise = rng.standard_normal((n, size, size, 3), dtype=np.float32)

  # --- Rendering, in float32 uint8 units, as in synthetic._generate_chunk (without stripes).
  y, x = synthetic.pixel_grid(size)
  lesion_w = synthetic.lesion_weight(y, x, centre, radius, tilt)
  shade = 1 - synthetic.per_image(vignette) * (x * x + y * y) / 2
  hair_w = synthetic.hair_weight(
      y, x, hair_on, hair_angle, hair_offset, synthetic.HAIR_WIDTH_PX * 2.0 / 32.0
  )
  skin_w = (1 - lesion_w) * shade * (1 - hair_w)
  lesion_w *= shade * (1 - hair_w)
  img = skin_w[..., None] * skin[:, None, None].astype(np.float32)
  img += lesion_w[..., None] * lesion[:, None, None].astype(np.float32)
  img += (hair_w * synthetic.per_image(hair_colour))[..., None]
  m = synthetic.marker_side(size)
  img[:, 1 : 1 + m, 1 : 1 + m] = synthetic.marker_palette(k)[cue_class][:, None, None]
  image = synthetic.photograph(img, np.take(synthetic.SITE_BLUR, site), noise, noise_std)
  attributes = synthetic.attribute_array(seed, [sex, age, site], missing_rate)
  return {"image": image, "label": label.astype(np.int32), "attributes": attributes}


load_synthetic_testbed = synthetic.generated_loader(NAME, class_names, _generate_chunk)
