"""A small generated multi-attribute fairness benchmark in the spirit of ISIC 2019.

Each image shows a "lesion" (a soft ellipse) on skin; the class is the orientation (up to
mirroring) of the striped texture inside it. Three sensitive attributes with ISIC 2019's
cardinalities, ``sex`` (2), ``age`` (5) and ``site`` (8), are sampled with skewed frequencies
and make a plain classifier unfair: ``age`` lowers the texture contrast, ``site`` adds noise and
blur and shifts the label prior, ``sex`` sets hair occlusion, and a corner marker shows the
class with a probability that depends on ``site`` and ``sex``: a shortcut that works for common
groups and misleads on rare ones.

With ``attribute_cues=True`` (the quickstart's data) each group also tints the photograph
(``cue_colours``), so FairSMoE's sensitive-attribute classifiers have something to learn; the
cues draw no random numbers, so everything else is the data without them.

Generation is vectorised numpy, determined by ``seed`` (seeding: ``generate_splits``;
rationale: ``docs/dataset.md``).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import numpy as np

from fairmoe_jax.data.types import DatasetInfo, Splits

DEFAULT_SIZES = {"train": 8000, "val": 1000, "test": 2000}
ATTRIBUTE_NAMES = ("sex", "age", "site")
SEX_GROUPS = ("male", "female")
AGE_GROUPS = ("<30", "30-44", "45-59", "60-74", "75+")
SITE_GROUPS = (
    "anterior_torso",
    "lower_extremity",
    "upper_extremity",
    "posterior_torso",
    "head_neck",
    "lateral_torso",
    "palms_soles",
    "oral_genital",
)

# Per-group generation factors, indexed by group id. Pixels and noise std (uint8 units) are for a
# 32x32 image; other sizes scale spatially.
SEX_FREQ = (0.56, 0.44)
SEX_HAIR = (0.45, 0.08)  # probability of each of 3 candidate hairs
SEX_CUE = (0.6, 1.0)  # multiplies the site's marker reliability

AGE_FREQ = (0.08, 0.20, 0.32, 0.27, 0.13)
AGE_CONTRAST = (1.0, 0.9, 0.75, 0.55, 0.4)  # multiplies the texture contrast
AGE_LABEL_TILT = 0.35  # logit slope: older groups favour higher classes

SITE_FREQ = (0.25, 0.20, 0.16, 0.12, 0.10, 0.07, 0.06, 0.04)
SITE_NOISE = (6.0, 7.0, 8.0, 10.0, 12.0, 15.0, 18.0, 21.0)  # noise std
SITE_BLUR = (0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55)  # 3x3 box-blur mix
SITE_CUE = (0.9, 0.85, 0.75, 0.65, 0.5, 0.35, 0.2, 0.1)  # P(marker = class)
SITE_LABEL_BIAS = 0.9  # logit bonus of class ``site % num_classes``

# Nuisance factors shared by all groups.
ORIENTATION_JITTER = 0.18  # std of the stripe angle, in class spacings
STRIPE_PERIOD_PX = (3.5, 6.0)
BASE_CONTRAST = (0.25, 0.4)
LESION_RADIUS = (0.45, 0.75)  # semi-axes, in units of half the image side
LESION_DARKNESS = (0.45, 0.7)  # lesion brightness relative to the skin
LESION_TINT = np.array([1.0, 0.85, 0.75], np.float32)
SKIN_LIGHT = np.array([232.0, 194.0, 172.0], np.float32)
SKIN_DARK = np.array([140.0, 96.0, 72.0], np.float32)
VIGNETTE = (0.0, 0.35)  # darkening at the corners
NUM_HAIRS = 3
HAIR_WIDTH_PX = 0.8
MARKER_PX = 6

# The attribute cues (``attribute_cues=True``): colour casts, in uint8 units, in the two
# chromatic directions of RGB (orthogonal to brightness, along which the skin tone varies).
CHROMA = np.array([[1.0, -1.0, 0.0], [1.0, 1.0, -2.0]], np.float32) / np.array(
    [[np.sqrt(2.0)], [np.sqrt(6.0)]], np.float32
)
SEX_SKIN_CAST = (-12.0, 12.0)  # the skin, along CHROMA[0]
AGE_SKIN_CAST = (-24.0, -12.0, 0.0, 12.0, 24.0)  # the skin, along CHROMA[1]
SITE_LESION_CAST = 30.0  # the lesion, at hue angle 2 pi site / 8 in the chromatic plane

CHUNK_SIZE = 1024


def class_names(num_classes: int) -> tuple[str, ...]:
  """Names of the classes' stripe angles, evenly spaced over [0, 90] degrees: ``stripes_30deg``.

  Class ``k`` shows stripes at +-angle (sign random per image): horizontal flips keep the label.
  """
  angles = 90.0 * np.arange(num_classes) / (num_classes - 1)
  return tuple(f"stripes_{round(a):02d}deg" for a in angles)


def marker_palette(num_classes: int) -> np.ndarray:
  """The marker colour of each class: evenly spaced hues, float32 [K, 3]."""
  hue = np.arange(num_classes, dtype=np.float32)[:, None] / num_classes
  rgb = np.clip(np.abs((hue * 6 + np.array([0.0, 4.0, 2.0])) % 6 - 3) - 1, 0, 1)
  return (40 + 190 * rgb).astype(np.float32)


def marker_distances(images: np.ndarray, num_classes: int) -> np.ndarray:
  """Distance of each image's marker colour to each palette colour, float64 [N, K].

  The colour is the mean over the marker's interior (rows and columns ``2 .. m - 1``), which the
  3x3 blur leaves untouched: only the per-pixel noise remains, which the mean averages out.
  """
  m = marker_side(images.shape[1])
  lo, hi = (2, m) if m > 2 else (1, m + 1)  # A 2 px marker has no interior: use all of it.
  colour = images[:, lo:hi, lo:hi].astype(np.float64).mean(axis=(1, 2))  # [N, 3]
  palette = marker_palette(num_classes).astype(np.float64)  # [K, 3]
  return np.sqrt(((colour[:, None, :] - palette[None]) ** 2).sum(-1))


def read_marker(images: np.ndarray, num_classes: int) -> np.ndarray:
  """The class each image's corner marker shows (the nearest palette colour), int32 [N]: the
  shortcut a model can learn instead of the texture, read from the pixels alone."""
  return np.argmin(marker_distances(images, num_classes), axis=1).astype(np.int32)


def label_probs(num_classes: int) -> np.ndarray:
  """P(label | age, site) as float64 [5, 8, K]: the attribute-label correlation."""
  classes = np.arange(num_classes)
  centred = 2 * classes / (num_classes - 1) - 1  # -1 (class 0) ... +1
  age_logit = AGE_LABEL_TILT * (np.arange(len(AGE_GROUPS)) - 2)[:, None] * centred
  site_logit = SITE_LABEL_BIAS * (np.arange(len(SITE_GROUPS))[:, None] % num_classes == classes)
  logits = age_logit[:, None, :] + site_logit[None, :, :]
  probs = np.exp(logits)
  return probs / probs.sum(-1, keepdims=True)


def synthetic_info(image_size: int = 32, num_classes: int = 4) -> DatasetInfo:
  return generated_info("synthetic", class_names(num_classes), image_size)


def generated_info(name: str, classes: tuple[str, ...], image_size: int) -> DatasetInfo:
  """The DatasetInfo of a generated dataset with this module's sensitive attributes."""
  return DatasetInfo(
      name=name,
      num_classes=len(classes),
      class_names=classes,
      attribute_names=ATTRIBUTE_NAMES,
      group_names=(SEX_GROUPS, AGE_GROUPS, SITE_GROUPS),
      image_size=image_size,
  )


# A generator of CHUNK_SIZE examples: (chunk seed, image size, classes, missing rate) -> arrays.
ChunkGenerator = Callable[[np.random.SeedSequence, int, int, float], dict[str, np.ndarray]]


Loader = Callable[..., tuple[DatasetInfo, Splits]]


def generated_loader(
    name: str, classes: Callable[[int], tuple[str, ...]], generate_chunk: ChunkGenerator
) -> Loader:
  """The loader of a generated dataset ``name`` with this module's attributes and seeding:
  ``generate_chunk`` renders the examples, ``classes(num_classes)`` names the classes."""

  def load(
      *,
      image_size: int = 32,
      num_classes: int = 4,
      sizes: dict[str, int] | None = None,
      seed: int = 0,
      missing_rate: float = 0.0,
  ) -> tuple[DatasetInfo, Splits]:
    """``(info, splits)``, each split i.i.d. ``{"image": uint8 [N, S, S, 3], "label": int32
    [N], "attributes": int32 [N, 3]}``; ``missing_rate``: P(an attribute value is -1).
    """
    splits = generate_splits(generate_chunk, image_size, num_classes, sizes, seed, missing_rate)
    return generated_info(name, classes(num_classes), image_size), splits

  load.__name__ = load.__qualname__ = f"load_{name}"
  return load


def generate_splits(
    generate_chunk: ChunkGenerator,
    image_size: int,
    num_classes: int,
    sizes: dict[str, int] | None,
    seed: int,
    missing_rate: float,
) -> Splits:
  """Each split of ``sizes`` (default ``DEFAULT_SIZES``) from chunks of ``CHUNK_SIZE`` examples.

  Every chunk has its own seed, from ``seed``, the split's name and the chunk's index only, so
  resizing one split changes no other split and growing a split keeps its examples as a prefix.
  """
  if num_classes < 2:
    raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
  if not 0.0 <= missing_rate < 1.0:
    raise ValueError(f"missing_rate must be in [0, 1), got {missing_rate}.")
  splits = {}
  for split, size in (DEFAULT_SIZES if sizes is None else sizes).items():
    chunks = [
        generate_chunk(_chunk_seed(seed, split, c), image_size, num_classes, missing_rate)
        for c in range(-(-size // CHUNK_SIZE))
    ] or [_empty_split(image_size)]
    splits[split] = {
        key: np.concatenate([chunk[key] for chunk in chunks])[:size] for key in chunks[0]
    }
  return splits


def _chunk_seed(seed: int, split: str, chunk: int) -> np.random.SeedSequence:
  # crc32 rather than hash(): it must not change between Python processes.
  return np.random.SeedSequence(seed, spawn_key=(zlib.crc32(split.encode()), chunk))


def _empty_split(image_size: int) -> dict[str, np.ndarray]:
  return {
      "image": np.zeros((0, image_size, image_size, 3), np.uint8),
      "label": np.zeros((0,), np.int32),
      "attributes": np.zeros((0, len(ATTRIBUTE_NAMES)), np.int32),
  }


def _categorical(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
  """One draw per row of ``probs`` [n, K], vectorised inverse-CDF sampling."""
  u = rng.random(probs.shape[0])[:, None]
  return np.minimum((u > np.cumsum(probs, axis=-1)).sum(-1), probs.shape[-1] - 1)


def draw_groups_and_label(
    rng: np.random.Generator, n: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """``sex, age, site, label`` of ``n`` examples: the attributes independent, with the
  nominal frequencies, and the label from ``label_probs`` (always drawn in this order)."""
  sex = rng.choice(len(SEX_GROUPS), n, p=SEX_FREQ)
  age = rng.choice(len(AGE_GROUPS), n, p=AGE_FREQ)
  site = rng.choice(len(SITE_GROUPS), n, p=SITE_FREQ)
  label = _categorical(rng, label_probs(num_classes)[age, site])
  return sex, age, site, label


def marker_side(image_size: int) -> int:
  """Side of the corner marker in pixels; it covers rows and columns ``1 .. side``."""
  return max(2, round(MARKER_PX * image_size / 32.0))


def per_image(values: np.ndarray) -> np.ndarray:
  """Per-image values [n] as float32 [n, 1, 1], to broadcast against [n, H, W] maps."""
  return np.asarray(values, np.float32)[:, None, None]


def pixel_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
  """``y`` [1, S, 1] and ``x`` [1, 1, S]: pixel centres in normalised [-1, 1] coordinates."""
  coords = (np.arange(size, dtype=np.float32) + 0.5) * (2.0 / size) - 1
  return coords[None, :, None], coords[None, None, :]


def lesion_weight(
    y: np.ndarray, x: np.ndarray, centre: np.ndarray, radius: np.ndarray, tilt: np.ndarray
) -> np.ndarray:
  """A soft, tilted ellipse per image (about 1 inside, 0 outside), float32 [n, H, W].

  ``centre`` and ``radius`` are [2, n] (x and y; the two semi-axes), ``tilt`` [n] radians.
  """
  dx, dy = x - per_image(centre[0]), y - per_image(centre[1])
  cos_t, sin_t = per_image(np.cos(tilt)), per_image(np.sin(tilt))
  r = np.hypot(
      (dx * cos_t + dy * sin_t) / per_image(radius[0]),
      (dy * cos_t - dx * sin_t) / per_image(radius[1]),
  )
  return 1 / (1 + np.exp(-8 * (1 - r)))


def hair_weight(
    y: np.ndarray,
    x: np.ndarray,
    hair_on: np.ndarray,
    hair_angle: np.ndarray,
    hair_offset: np.ndarray,
    width: float,
) -> np.ndarray:
  """Coverage by thin straight hairs (lines of ``width`` in normalised units), float32
  [n, H, W]; ``hair_on``, ``hair_angle`` and ``hair_offset`` are [n, hairs]."""
  per_hair = lambda a: np.asarray(a, np.float32)[:, :, None, None]
  hair_dist = np.abs(
      x[:, None] * per_hair(np.cos(hair_angle))
      + y[:, None] * per_hair(np.sin(hair_angle))
      - per_hair(hair_offset)
  )
  hair_w = np.clip(1 - hair_dist / width, 0, 1)
  return (hair_w * per_hair(hair_on)).max(axis=1)


def photograph(
    img: np.ndarray, blur: np.ndarray, noise: np.ndarray, noise_std: np.ndarray
) -> np.ndarray:
  """The scene ``img`` (float32 [n, H, W, 3], uint8 units; changed in place) mixed with its 3x3
  box blur by the per-image weight ``blur`` [n], plus ``noise`` (standard normal, [n, H, W, 3],
  scaled in place by ``noise_std`` [n]), rounded and clipped to uint8."""
  blurred = np.flatnonzero(blur > 0)
  sharp = img[blurred]
  padded = np.pad(sharp, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
  box = padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]  # separable 3x3 box
  box = (box[:, :, :-2] + box[:, :, 1:-1] + box[:, :, 2:]) / np.float32(9)
  blur_w = per_image(blur[blurred])[..., None]
  img[blurred] = sharp + blur_w * (box - sharp)

  noise *= per_image(noise_std)[..., None]
  img += noise
  return np.clip(np.rint(img, out=img), 0, 255, out=img).astype(np.uint8)


def attribute_array(
    seed: np.random.SeedSequence, columns: list[np.ndarray], missing_rate: float
) -> np.ndarray:
  """The attribute columns as int32 [n, m], each value ``-1`` with probability
  ``missing_rate``, drawn from a stream of its own (so nothing else depends on it)."""
  attributes = np.stack(columns, axis=1).astype(np.int32)
  if missing_rate > 0:
    missing_rng = np.random.default_rng(seed.spawn(1)[0])
    attributes[missing_rng.random(attributes.shape) < missing_rate] = -1
  return attributes


def cue_colours(
    skin: np.ndarray, lesion: np.ndarray, sex: np.ndarray, age: np.ndarray, site: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """The skin and lesion colours [n, 3] with the attribute cues: ``sex`` and ``age`` shift the
  skin along the chromatic directions ``CHROMA[0]`` and ``CHROMA[1]``, ``site`` shifts the lesion
  to one of eight hues (``SITE_LESION_CAST`` from its colour). Every attribute is then linearly
  readable from the mean colour of a skin or a lesion patch, whatever the skin tone."""
  skin = skin + np.take(SEX_SKIN_CAST, sex)[:, None] * CHROMA[0]
  skin = skin + np.take(AGE_SKIN_CAST, age)[:, None] * CHROMA[1]
  hue = 2 * np.pi * np.asarray(site, np.float32) / len(SITE_GROUPS)
  lesion = lesion + SITE_LESION_CAST * (
      np.cos(hue)[:, None] * CHROMA[0] + np.sin(hue)[:, None] * CHROMA[1]
  )
  return skin, lesion


def _generate_chunk(
    seed: np.random.SeedSequence,
    size: int,
    num_classes: int,
    missing_rate: float,
    attribute_cues: bool = False,
) -> dict[str, np.ndarray]:
  """Renders ``CHUNK_SIZE`` examples from one seed (``attribute_cues``: ``cue_colours``)."""
  rng = np.random.default_rng(seed)
  n, k = CHUNK_SIZE, num_classes
  pixel = 2.0 / size  # one pixel in normalised [-1, 1] coordinates
  scale = size / 32.0

  # --- Latent variables, always drawn in this order for reproducibility.
  sex, age, site, label = draw_groups_and_label(rng, n, k)

  spacing = np.pi / 2 / (k - 1)
  angle = spacing * (label + ORIENTATION_JITTER * rng.standard_normal(n))
  angle *= rng.choice([-1.0, 1.0], n)
  wavenumber = 2 * np.pi / (rng.uniform(*STRIPE_PERIOD_PX, n) * scale * pixel)
  phase = rng.uniform(0, 2 * np.pi, n)
  contrast = rng.uniform(*BASE_CONTRAST, n) * np.take(AGE_CONTRAST, age)
  centre = np.clip(rng.normal(0, 0.12, (2, n)), -0.3, 0.3)
  radius = rng.uniform(*LESION_RADIUS, (2, n))
  tilt = rng.uniform(0, np.pi, n)
  skin = SKIN_LIGHT + rng.uniform(0, 1, (n, 1)) * (SKIN_DARK - SKIN_LIGHT)
  lesion = skin * rng.uniform(*LESION_DARKNESS, (n, 1)) * LESION_TINT
  vignette = rng.uniform(*VIGNETTE, n)
  hair_on = rng.random((n, NUM_HAIRS)) < np.take(SEX_HAIR, sex)[:, None]
  hair_angle = rng.uniform(0, np.pi, (n, NUM_HAIRS))
  hair_offset = rng.uniform(-0.8, 0.8, (n, NUM_HAIRS))
  hair_colour = rng.uniform(20, 60, n)
  cue_ok = rng.random(n) < np.take(SITE_CUE, site) * np.take(SEX_CUE, sex)
  cue_class = np.where(cue_ok, label, rng.integers(0, k, n))
  noise_std = np.take(SITE_NOISE, site) * rng.uniform(0.8, 1.2, n)
  noise = rng.standard_normal((n, size, size, 3), dtype=np.float32)
  if attribute_cues:  # After every draw: the cues change no random number.
    skin, lesion = cue_colours(skin, lesion, sex, age, site)

  # --- Rendering, in float32 uint8 units. The scene is linear in the skin, lesion and hair
  # colours: their weights are [n, H, W] maps and the colour images [n, H, W, 3] are formed once.
  y, x = pixel_grid(size)
  lesion_w = lesion_weight(y, x, centre, radius, tilt)
  # Stripes run along ``angle``: the wave vector is perpendicular to it.
  along_wave = y * per_image(np.cos(angle)) - x * per_image(np.sin(angle))
  stripes = np.cos(per_image(wavenumber) * along_wave + per_image(phase))
  shade = 1 - per_image(vignette) * (x * x + y * y) / 2
  skin_w = (1 - lesion_w) * shade
  lesion_w *= shade * (1 + per_image(contrast) * stripes)

  # Hair: up to NUM_HAIRS thin dark straight lines across the image.
  hair_w = hair_weight(y, x, hair_on, hair_angle, hair_offset, HAIR_WIDTH_PX * scale * pixel)
  skin_w *= 1 - hair_w
  lesion_w *= 1 - hair_w

  img = skin_w[..., None] * skin[:, None, None].astype(np.float32)
  img += lesion_w[..., None] * lesion[:, None, None].astype(np.float32)
  img += (hair_w * per_image(hair_colour))[..., None]

  # The marker sits over the hair but is blurred and noised like the rest of the scene.
  m = marker_side(size)
  img[:, 1 : 1 + m, 1 : 1 + m] = marker_palette(k)[cue_class][:, None, None]
  image = photograph(img, np.take(SITE_BLUR, site), noise, noise_std)
  attributes = attribute_array(seed, [sex, age, site], missing_rate)
  return {"image": image, "label": label.astype(np.int32), "attributes": attributes}


_load_without_cues = generated_loader("synthetic", class_names, _generate_chunk)
_load_with_cues = generated_loader(
    "synthetic", class_names, functools.partial(_generate_chunk, attribute_cues=True)
)


def load_synthetic(*, attribute_cues: bool = False, **kwargs) -> tuple[DatasetInfo, Splits]:
  """Generates the synthetic benchmark (module doc); ``kwargs`` as ``generated_loader``'s."""
  return (_load_with_cues if attribute_cues else _load_without_cues)(**kwargs)
