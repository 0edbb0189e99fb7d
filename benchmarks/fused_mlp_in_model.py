r"""The fused expert MLP inside a whole train step: what `einsum_fused` changes in a paper config.

  python benchmarks/fused_mlp_in_model.py --out benchmarks/results/fused_mlp_in_model.json  # ~8 min
  python benchmarks/fused_mlp_in_model.py --backbone deit_b --target v5e-16

Compiles the train step with the preflight (deviceless) with `moe.dispatch=einsum` and with
`einsum_fused` under a few kernel layouts (`fused_mlp.MAX_ROW_BLOCK`, `fused_mlp.WEIGHT_BUFFERS`),
each in a child process (`--child` sets them); prints bytes accessed, FLOPs and peak per device.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile

# (MAX_ROW_BLOCK, WEIGHT_BUFFERS): the committed layout first, then the ones it was chosen over.
LAYOUTS = ((128, 1), (128, 2), (512, 2))


def _child(argv: list[str]) -> None:
  """`python -m fairmoe_jax.main ARGS` with the kernel layout set first."""
  from fairmoe_jax.moe.experimental import fused_mlp  # pylint: disable=import-outside-toplevel

  fused_mlp.MAX_ROW_BLOCK, fused_mlp.WEIGHT_BUFFERS = int(argv[0]), int(argv[1])
  sys.argv = ["fairmoe_jax.main", *argv[2:]]
  runpy.run_module("fairmoe_jax.main", run_name="__main__")


def _compile(backbone: str, target: str, dispatch: str, layout: tuple[int, int]) -> dict:
  row = dict(dispatch=dispatch, layout=layout)
  with tempfile.TemporaryDirectory() as workdir:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        *map(str, layout),
        f"--config=configs/celeba.py:backbone={backbone}",
        "--mode=compile",
        f"--config.preflight.target={target}",
        f"--config.moe.dispatch={dispatch}",
        f"--workdir={workdir}",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
      return dict(row, error=done.stderr.strip().splitlines()[-1])
    with open(os.path.join(workdir, "preflight.json")) as f:
      step = json.load(f)["train_step"]
  row.update(bytes_accessed=step["bytes_accessed_per_device"], flops=step["flops_per_device"])
  return dict(row, peak=step["memory"]["peak"])


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--backbone", default="deit_s")
  parser.add_argument("--target", default="v5e-16")
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  rows = [_compile(args.backbone, args.target, "einsum", LAYOUTS[0])]
  rows += [_compile(args.backbone, args.target, "einsum_fused", layout) for layout in LAYOUTS]
  base = rows[0].get("bytes_accessed")
  print(f"FairSMoE {args.backbone} train step on {args.target}, per device:")
  for row in rows:
    layout = f" (rows {row['layout'][0]}, {row['layout'][1]} buffer(s))"
    name = row["dispatch"] + (layout if row["dispatch"] == "einsum_fused" else "")
    if "error" in row:
      print(f"  {name}: {row['error']}")
      continue
    print(
        f"  {name}: {row['bytes_accessed']:.4g} bytes accessed"
        + (f" ({row['bytes_accessed'] / base:.3f}x einsum)" if base else "")
        + f", {row['flops']:.4g} FLOPs, peak {row['peak'] / 2**30:.2f} GiB",
        flush=True,
    )
  if args.out:
    # Imported after every child has run: this process initialises jax only now (on the CPU).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_utils  # pylint: disable=import-outside-toplevel

    bench_utils.write_results(args.out, args, rows, targets=[])
  return rows


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2:])
  else:
    main()
