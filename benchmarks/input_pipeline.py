"""Training input pipeline throughput at 224 px on real CelebA files: images/s per core, over
worker processes, host-to-device bytes per batch, and cores needed per accelerator.

  python benchmarks/input_pipeline.py --workers=0,1,2

Rows, all on the paper's augmentation (`configs/celeba.py`): `uint8_two_pass` (decoded, resized
to the 258 square, cropped to 224: `data.train_resampling=two_pass`) and `uint8_one_pass` (the
default: the crop resampled from the file's pixels). Each reads `--batches` batches after a
warm-up, one core per process. Cores per accelerator: the preflight's step rate
(`--preflight_cell`) over the per-core rate. Writes JSON (default
benchmarks/results/input_pipeline.json).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench_utils  # noqa: E402
from bench_utils import write_results  # noqa: E402
from fairmoe_jax.data import augment, pipeline  # noqa: E402

# configs/celeba.py at size=full (fairmoe_jax/paper_config.py).
PAPER_AUGMENT = augment.AugmentConfig(crop_scale=(0.08, 1.0))
GOAL_IMAGES_PER_CORE = 400.0


def measure(row: str, split, args, workers: int) -> dict:
  iterator = pipeline.train_iterator(
      split,
      global_batch_size=args.batch_size,
      image_size=args.image_size,
      seed=0,
      augment=PAPER_AUGMENT,
      num_threads=0,
      prefetch_buffer_size=2,
      num_workers=workers,
      resampling=row.split("_", 1)[1],
  )
  first = next(iterator)  # Warm-up: worker start-up and first decodes.
  start = time.perf_counter()
  for _ in range(args.batches):
    next(iterator)
  seconds = time.perf_counter() - start
  if hasattr(iterator, "close"):
    iterator.close()
  cores, images_per_s = max(1, workers), args.batches * args.batch_size / seconds
  result = dict(row=row, workers=workers, cores=cores, images_per_s=round(images_per_s, 1))
  result.update(images_per_s_per_core=round(images_per_s / cores, 1))
  result.update(image_dtype=str(first["image"].dtype))
  result.update(bytes_per_batch=int(sum(v.nbytes for v in first.values())))
  return dict(result, image_bytes_per_batch=int(first["image"].nbytes))


def synthetic_jpegs(folder: str, count: int, size: tuple[int, int] = (178, 218)) -> None:
  """Writes `count` JPEG files of CelebA's width and height into `folder`/img_align_celeba:
  smooth shapes and mild noise, about a photograph's entropy (white noise decodes slower)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  os.makedirs(os.path.join(folder, "img_align_celeba"), exist_ok=True)
  rng = np.random.default_rng(0)
  yy, xx = np.mgrid[0 : size[1], 0 : size[0]]
  for i in range(count):
    phase = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack(
        [127 + 80 * np.sin(xx / (17 + 5 * c) + yy / (23 + 3 * c) + phase[c]) for c in range(3)],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    path = os.path.join(folder, "img_align_celeba", f"{i:06d}.jpg")
    Image.fromarray(pixels).save(path, quality=90)


def accelerator_images_per_s(cell: str) -> tuple[float, dict]:
  """Images/s one accelerator consumes at the preflight's step time of `cell`."""
  record = json.load(open(os.path.join(ROOT, "results", "records", "preflight_paper.json")))
  entry = record["cells"][cell]
  batch = 256  # The paper's batch (the record's command sets --config.batch_size=256).
  per_accelerator = batch / entry["step_s"] / entry["devices"]
  return per_accelerator, {"cell": cell, "step_s": entry["step_s"], "devices": entry["devices"]}


def main() -> None:
  parser = bench_utils.parser(__doc__, "input_pipeline")
  parser.add_argument(
      "--data_root", default=os.path.join(os.path.dirname(ROOT), "shared", "data", "celeba")
  )
  parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
  parser.add_argument("--rows", default="uint8_two_pass,uint8_one_pass")
  parser.add_argument("--batch_size", type=int, default=256)
  parser.add_argument("--batches", type=int, default=6)
  parser.add_argument("--image_size", type=int, default=224)
  parser.add_argument("--preflight_cell", default="fairsmoe/deit_s@h100x8")
  parser.add_argument(
      "--synthetic",
      action="store_true",
      help="where --data_root holds fewer than 2 batches of files, time synthetic JPEG files of "
      "CelebA's size instead (written to a temporary folder)",
  )
  args = parser.parse_args()
  flags.FLAGS.mark_as_parsed()  # grain hands its absl flags to worker processes.

  args.source = f"CelebA JPEG files in {args.data_root}"
  found = glob.glob(os.path.join(args.data_root, "img_align_celeba", "*.jpg"))
  if args.synthetic and len(found) < 2 * args.batch_size:
    args.data_root = tempfile.mkdtemp(prefix="input_pipeline_")
    atexit.register(shutil.rmtree, args.data_root, True)
    synthetic_jpegs(args.data_root, 2 * args.batch_size)
    args.source = f"{2 * args.batch_size} synthetic 178x218 JPEG files (no CelebA files found)"
  paths = sorted(glob.glob(os.path.join(args.data_root, "img_align_celeba", "*.jpg")))
  if len(paths) < args.batch_size:
    sys.exit(f"{args.data_root}/img_align_celeba holds {len(paths)} JPEG files, fewer than a batch")
  n = len(paths)
  split = dict(path=np.array(paths, dtype=object), label=np.zeros(n, np.int32))
  split["attributes"] = np.zeros((n, 1), np.int32)
  per_accelerator, source = accelerator_images_per_s(args.preflight_cell)
  rows = []
  for row in args.rows.split(","):
    for workers in (int(w) for w in args.workers.split(",")):
      result = measure(row, split, args, workers)
      result["cores_per_accelerator"] = round(per_accelerator / result["images_per_s_per_core"], 1)
      rows.append(result)
      print(json.dumps(result), flush=True)
  by = {(r["row"], r["workers"]): r for r in rows}
  targets = []

  def target(name: str, value: float, reached: bool) -> None:
    targets.append({"target": name, "value": value, "reached": reached})

  new = [r for r in rows if r["row"] == "uint8_one_pass"]
  if new:
    best = max(r["images_per_s_per_core"] for r in new)
    target(f">= {GOAL_IMAGES_PER_CORE:g} images/s per core", best, best >= GOAL_IMAGES_PER_CORE)
    one, two = by.get(("uint8_one_pass", 1)), by.get(("uint8_one_pass", 2))
    if one and two:
      scaling = two["images_per_s"] / one["images_per_s"]
      target("linear in workers (2 workers / 1 worker = 2)", round(scaling, 2), scaling >= 1.8)
  args.accelerator = {**source, "images_per_s": round(per_accelerator, 1)}
  write_results(args.output, args, rows, targets)


if __name__ == "__main__":
  main()
