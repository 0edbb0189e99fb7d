r"""What the checkpoint checksum manifest costs: save, manifest and verify times at a model size.

  python benchmarks/checkpoint_hash.py                      # DeiT-S size: 22M parameters
  python benchmarks/checkpoint_hash.py --params_millions 86 # DeiT-B / ViT-B size

Parameters plus Adam's two moments in float32; medians of `--repeats` synchronous saves,
`write_manifest`, `verify_manifest` and `restore`. Writes JSON (default
benchmarks/results/checkpoint_hash.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import struct

from bench_utils import write_results
from trainkit.checkpoint import Checkpointer, verify_manifest, write_manifest


@struct.dataclass
class _State:
  step: jax.Array
  params: dict
  mu: dict
  nu: dict


def _state(params_millions: float) -> _State:
  # A ViT's parameters sit in a few dozen large matrices; 24 arrays of equal size.
  per_array = int(params_millions * 1e6 / 24)
  # Random values throughout: Adam's moments are not zeros, and zeros would compress.
  keys = jax.random.split(jax.random.key(0), 72)
  make = lambda ks: {
      f"w{i}": jax.random.normal(k, (per_array,), jnp.float32) for i, k in enumerate(ks)
  }
  return _State(
      step=jnp.zeros((), jnp.int32), params=make(keys[:24]), mu=make(keys[24:48]),
      nu=make(keys[48:]),
  )


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--params_millions", type=float, default=22.0)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--output", default="benchmarks/results/checkpoint_hash.json")
  args = parser.parse_args()
  state = _state(args.params_millions)
  times = {"save_s": [], "manifest_s": [], "verify_s": [], "restore_s": []}
  with tempfile.TemporaryDirectory() as directory:
    ckpt = Checkpointer(os.path.join(directory, "ckpt"), async_save=False, max_to_keep=2)
    size = 0
    for step in range(1, args.repeats + 1):
      t = time.perf_counter()
      ckpt.save(step, state, {"index": step}, force=True)
      ckpt._manager.wait_until_finished()  # pylint: disable=protected-access
      times["save_s"].append(time.perf_counter() - t)
      step_dir = os.path.join(ckpt.directory, str(step))
      t = time.perf_counter()
      write_manifest(step_dir)
      times["manifest_s"].append(time.perf_counter() - t)
      t = time.perf_counter()
      assert verify_manifest(step_dir) == ""
      times["verify_s"].append(time.perf_counter() - t)
      size = sum(
          os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(step_dir) for f in fs
      )
      t = time.perf_counter()
      ckpt.restore(state)
      times["restore_s"].append(time.perf_counter() - t)
    ckpt.close()
  row = {"params_millions": args.params_millions, "checkpoint_mib": size / 2**20}
  row.update({k: statistics.median(v) for k, v in times.items()})
  row["manifest_vs_save"] = row["manifest_s"] / row["save_s"]
  print(f"{'params (M)':>10} {'MiB':>8} {'save s':>8} {'manifest s':>11} {'verify s':>9} "
        f"{'restore s':>10} {'manifest/save':>14}")
  print(f"{row['params_millions']:>10.1f} {row['checkpoint_mib']:>8.1f} {row['save_s']:>8.3f} "
        f"{row['manifest_s']:>11.3f} {row['verify_s']:>9.3f} {row['restore_s']:>10.3f} "
        f"{row['manifest_vs_save']:>14.2f}")
  write_results(args.output, args, [row], [])


if __name__ == "__main__":
  main()
