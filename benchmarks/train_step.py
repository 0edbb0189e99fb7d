r"""Throughput of the fairmoe_jax train step (ViT with a sparse-MoE last block) on this machine.

  python benchmarks/train_step.py                       # CPU-sized shapes
  python benchmarks/train_step.py --preset=deit_small --image_size=224 --batch_size=256   # accelerator

Prints a table and writes JSON (default benchmarks/results/train_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import flax.nnx as nnx
import jax
import numpy as np

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.train import build_model, make_loss_fn
from trainkit.mesh import make_mesh, shard_batch
from trainkit.optim import make_optimizer
from trainkit.train_state import create_train_state, jit_train_step, make_train_step

SIZES = {  # dim, depth, heads, mlp
    "quickstart": (64, 4, 4, 128),
    "deit_tiny": (192, 12, 3, 768),
    "deit_small": (384, 12, 6, 1536),
}


def benchmark(
    preset: str,
    image_size: int,
    patch_size: int,
    batch_size: int,
    num_experts: int,
    top_k: int,
    dispatch: str,
    compute_dtype: str,
    steps: int,
    method: str = "smoe",
) -> dict:
  config = fairmoe_config.base_config()
  config.method = method
  dim, depth, heads, mlp = SIZES[preset]
  config.model.update(dim=dim, depth=depth, num_heads=heads, mlp_dim=mlp, patch_size=patch_size)
  config.data.image_size = image_size
  config.moe.update(num_experts=num_experts, top_k=top_k, dispatch=dispatch)
  config.batch_size, config.compute_dtype = batch_size, compute_dtype
  fairmoe_config.validate(config, num_devices=jax.device_count())
  info = DatasetInfo(
      name="benchmark",
      num_classes=4,
      class_names=tuple("abcd"),
      attribute_names=("a",),
      group_names=(("0", "1"),),
      image_size=image_size,
  )
  mesh = make_mesh(config.mesh)
  tx = make_optimizer(config.optimizer, 1000)
  graphdef, state = create_train_state(lambda: build_model(config, info, nnx.Rngs(0)), tx, mesh, 0)
  step_fn = jit_train_step(make_train_step(graphdef, make_loss_fn(config, info), tx), state, mesh)
  rng = np.random.default_rng(0)
  batch = shard_batch(
      {
          "image": rng.normal(size=(batch_size, image_size, image_size, 3)).astype(np.float32),
          "label": rng.integers(0, 4, batch_size).astype(np.int32),
          "attributes": rng.integers(0, 2, (batch_size, 1)).astype(np.int32),
          "mask": np.ones(batch_size, np.float32),
      },
      mesh,
  )
  t0 = time.perf_counter()
  state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - t0) / steps
  memory = jax.devices()[0].memory_stats() or {}
  return dict(
      preset=preset,
      image_size=image_size,
      patch_size=patch_size,
      batch_size=batch_size,
      num_experts=num_experts,
      top_k=top_k,
      dispatch=dispatch,
      compute_dtype=compute_dtype,
      compile_s=round(compile_s, 2),
      step_ms=round(1e3 * step_s, 2),
      images_per_s=round(batch_size / step_s, 1),
      peak_device_bytes=memory.get("peak_bytes_in_use"),
      peak_host_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
  )


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--preset", default="quickstart", choices=sorted(SIZES))
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--patch_size", type=int, default=4)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--top_k", type=int, default=2)
  parser.add_argument(
      "--dispatch", nargs="+", default=["einsum"], choices=["dense", "einsum", "sort", "dropless"]
  )
  parser.add_argument("--compute_dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--method", default="smoe", help="fairmoe_jax.methods.METHODS key")
  parser.add_argument(
      "--output", default=os.path.join(os.path.dirname(__file__), "results", "train_step.json")
  )
  args = parser.parse_args()

  rows = [
      benchmark(
          args.preset,
          args.image_size,
          args.patch_size,
          args.batch_size,
          e,
          args.top_k,
          dispatch,
          args.compute_dtype,
          args.steps,
          args.method,
      )
      for dispatch in args.dispatch
      for e in args.experts
  ]
  columns = [
      "preset",
      "image_size",
      "batch_size",
      "num_experts",
      "top_k",
      "dispatch",
      "compute_dtype",
      "compile_s",
      "step_ms",
      "images_per_s",
      "peak_device_bytes",
      "peak_host_rss_mb",
  ]
  print(" | ".join(columns))
  for row in rows:
    print(" | ".join(str(row[c]) for c in columns))
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, "w") as f:
    json.dump(
        {
            "device": str(jax.devices()[0].device_kind),
            "num_devices": jax.device_count(),
            "jax": jax.__version__,
            "host": platform.node(),
            "rows": rows,
        },
        f,
        indent=2,
    )
  print(f"wrote {args.output}")


if __name__ == "__main__":
  main()
