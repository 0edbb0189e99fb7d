r"""The paper's configurations compiled for GPU nodes and TPU slices: the table of docs/scaling.md.

  python -m paper_runner.preflight_table --compile              # compile the missing cells
  python -m paper_runner.preflight_table --compile --only=deit_s   # cells whose name matches
  python -m paper_runner.preflight_table --compile --only=@h100 --skip=deit_s   # ... and not
  python -m paper_runner.tables --write=docs/scaling.md   # render the table (and --check)

Each cell is one `--mode=compile` of a main (`trainkit/preflight`) in a subprocess, train step
only; its summary goes to `results/records/preflight_paper.json` as soon as it is compiled, so
`--compile` resumes where it stopped, and the table is rendered from that record alone.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

from paper_runner.provenance import source_state
from paper_runner.spec import REPO_ROOT
from trainkit.distributed import child_environment
from trainkit.errors import exit_on_user_error
from trainkit.storage import write_atomically

NAME = "preflight_paper"
RECORD = os.path.join("results", "records", f"{NAME}.json")
BATCH = 256
CELEBA = dict(epochs=500, examples=162_770)
ISIC = dict(epochs=300, examples=19_245)
TARGETS = (
    ("h100x1", {}),
    ("h100x8", {}),
    ("h100x8", {"mesh.expert": 4}),
    ("v5e-16", {}),
    ("v4-32", {}),
)
METHODS = ("fairsmoe", "vanilla_smoe", "muffin", "multifair")
BACKBONES = ("deit_s", "deit_b", "swin_s", "swin_b")


def cells() -> list[dict[str, Any]]:
  """Every cell, in the order `--compile` runs them (DeiT-S first, then by backbone)."""
  found = []
  for backbone in BACKBONES:
    for method in METHODS:
      config = f"configs/celeba.py:method={method},backbone={backbone}"
      for target, overrides in TARGETS:
        if overrides.get("mesh.expert") and method in ("muffin", "multifair"):
          continue  # No MoE block (dense backbones): nothing to spread over an expert axis.
        found.append(_cell(f"{method}/{backbone}", "fairmoe_jax.main", config, target, overrides))
  # MNLI's config names no dataset size (its data is files): MNLI's 392,702 training pairs.
  for label, config, extra in (
      ("causal/wmt14_base", "configs/wmt14_ende.py:attention=causal", {}),
      ("causal/mnli", "configs/mnli_hans.py", {"preflight.train_examples": 392_702}),
  ):
    found += [
        _cell(label, "causal_attn_jax.main", config, t, {}, extra) for t, o in TARGETS if not o
    ]
  return found


def _cell(label: str, module: str, config: str, target: str, overrides: dict, extra: Any = None):
  """A cell: named `label@target` then `,key=value` per override; a causal cell (`extra`, the
  flags of its main) runs its config's steps, a FairSMoE cell the paper's epochs."""
  suffix = "".join(f",{k.split('.')[-1]}={v}" for k, v in overrides.items())
  cell = dict(name=f"{label}@{target}{suffix}", module=module, config=config, target=target)
  cell.update(overrides=overrides, **({} if extra is None else {"flags": extra}))
  return dict(cell, epochs=extra is None)


def compile_cell(cell: dict[str, Any]) -> dict[str, Any]:
  """Runs `--mode=compile` for one cell; the summary of its preflight.json, or its error."""
  with tempfile.TemporaryDirectory() as workdir:
    command = [
        sys.executable,
        "-m",
        cell["module"],
        f"--config={cell['config']}",
        "--mode=compile",
        f"--config.preflight.target={cell['target']}",
        "--config.preflight.eval_step=False",
        f"--workdir={workdir}/run",
    ]
    if cell["epochs"]:
      command.append(f"--config.batch_size={BATCH}")
    settings = {**cell["overrides"], **cell.get("flags", {})}
    command += [f"--config.{k}={v}" for k, v in settings.items()]
    start = time.perf_counter()
    env = child_environment({"TF_CPP_MIN_LOG_LEVEL": "1"})  # Without libtpu's placeholders.
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    path = os.path.join(workdir, "run", "preflight.json")
    shown = " ".join(
        c if " " not in c else repr(c) for c in command[1:] if not c.startswith("--workdir")
    )
    if not os.path.exists(path) and result.returncode < 0:
      # Killed from outside (SIGKILL is what the out-of-memory killer sends): a fact about this
      # host at that moment, not about the configuration, so nothing is recorded for the cell.
      name = signal.Signals(-result.returncode).name
      return dict(command=f"python {shown}", killed=name, seconds=round(seconds))
    if not os.path.exists(path):
      errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
      message = errors[-1] if errors else result.stderr.strip().splitlines()[-1:]
      return dict(command=f"python {shown}", error=str(message)[:400], seconds=round(seconds))
    with open(path) as f:
      record = json.load(f)
  return dict(brief(record), command=f"python {shown}", seconds=round(seconds))


# The train step's figures a table keeps as the preflight records them.
TRAIN_KEYS = """compiler_options refused_by_compiler flops_per_device flops_source
matmul_flops_per_example bytes_accessed_per_device bytes_accessed_source collective_seconds
compile_seconds""".split()


def brief(record: dict[str, Any]) -> dict[str, Any]:
  """What a table keeps of a preflight record (`trainkit.preflight.compile.preflight`)."""
  train, run, target = record["train_step"], record["run"], record["target"]
  roofline, collectives = train.get("roofline") or {}, train.get("collectives") or {}
  found = {key: train.get(key) for key in TRAIN_KEYS}
  found.update(fits=record["fits"], peak=train["memory"].get("peak"), mesh=record["mesh"])
  found.update(usable=target["usable_bytes"], devices=target["devices"])
  found.update(settings=record.get("settings", {}), provenance=record["provenance"])
  found.update(roofline_s=roofline.get("bound_s"), bound_by=roofline.get("bound_by"))
  found.update(step_s=run.get("step_seconds"), utilization=run.get("utilization"))
  found.update(collective_bytes={k: v["bytes"] for k, v in collectives.items()})
  return dict(found, num_train_steps=run.get("num_train_steps"))


def load(path: str = RECORD, key: str = "cells") -> dict[str, Any]:
  """A record (this table's or calibration's), `{key: {}}` before its first entry."""
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {key: {}}


def save(name: str, result: dict[str, Any], path: str = RECORD, key: str = "cells") -> None:
  """Adds one entry to the record on disk (read again first: two --compile may run at once)."""
  record = load(path, key)
  record[key][name] = result
  write_atomically(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def compile_missing(pattern: str, skip: str) -> None:
  for cell in cells():
    if not fnmatch.fnmatch(cell["name"], f"*{pattern}*") or (skip and skip in cell["name"]):
      continue
    if cell["name"] in load()["cells"]:
      continue
    print(f"compiling {cell['name']} ...", flush=True)
    result = compile_cell(cell)
    if "killed" in result:
      print(
          f"  killed by {result['killed']} after {result['seconds']} s (SIGKILL: most likely the "
          "out-of-memory killer); not recorded, so the next --compile tries it again",
          flush=True,
      )
      continue
    result.update(
        commit=source_state(REPO_ROOT)["commit"],
        date=datetime.date.today().isoformat(),
        host=platform.processor() or platform.machine(),
    )
    save(cell["name"], result)
    print(f"  {_row(cell, result)}", flush=True)


def _gib(n: float | None) -> str:
  return "-" if n is None else f"{n / 2**30:.1f}"


def _hours(result: dict[str, Any], dataset: dict[str, int] | None) -> str:
  step = result.get("step_s")
  if not step:
    return "-"
  steps = (
      result["num_train_steps"]
      if dataset is None
      else math.ceil(dataset["epochs"] * dataset["examples"] / BATCH)
  )
  return f"{steps * step * result['devices'] / 3600:,.1f}"


def _row(cell: dict[str, Any], result: dict[str, Any] | None) -> str:
  label, _, where = cell["name"].partition("@")
  dispatch = (result or {}).get("settings", {}).get("moe.dispatch")
  if dispatch and not label.startswith("muffin") and not label.startswith("multifair"):
    where += f" ({dispatch})"
  if result is None:
    return f"| {label} | {where} | not compiled yet | | | | | | | |"
  if "error" in result:
    return f"| {label} | {where} | error: {result['error'].replace('|', '/')} | | | | | | | |"
  fits = "yes" if result["fits"] else "**no**"
  step = f"{result['step_s'] * 1e3:.0f}" if result.get("step_s") else "-"
  bound = (
      f"{result['roofline_s'] * 1e3:.1f} ({result['bound_by']})"
      if result.get("roofline_s")
      else "-"
  )
  if cell["epochs"]:
    hours = f"{_hours(result, CELEBA)} / {_hours(result, ISIC)}"
  else:
    hours = f"{_hours(result, None)} ({result['num_train_steps']:,} steps)"
  return (
      f"| {label} | {where} | {fits} | {_gib(result['peak'])} / {_gib(result['usable'])} | "
      f"{(result.get('matmul_flops_per_example') or 0) / 1e9:.1f} | {bound} | {step} | "
      f"{_collectives(result)} | {hours} | {result['compile_seconds']}, {result.get('commit', '?')} |"
  )


def _collectives(result: dict[str, Any]) -> str:
  """MiB per device per step the train step's collectives produce, by kind (largest first)."""
  found = result["collective_bytes"]
  if not found:
    return "none"
  kinds = sorted(found.items(), key=lambda kv: -kv[1])
  total = sum(found.values()) / 2**20
  return f"{total:.1f} (" + ", ".join(f"{k} {b / 2**20:.1f}" for k, b in kinds) + ")"


def render() -> str:
  results = load()["cells"]
  lines = [
      "| Run | Target | Fits | Peak / usable GiB per device | Matmul GFLOPs per example | "
      "Roofline ms per step (bound) | Est. ms per step | Collective MiB per step per device (by kind) | "
      "Device-hours (CelebA 500 ep. / ISIC 300 ep.; causal: its steps) | Compile s, commit |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  lines += [_row(cell, results.get(cell["name"])) for cell in cells()]
  done = [r for r in results.values() if "provenance" in r]
  misfits = [
      f"{name} needs {_gib(r['peak'])} GiB per device"
      + (
          " at least (the TPU compiler's count of its temporaries)"
          if r.get("refused_by_compiler")
          else ""
      )
      + f" of {_gib(r['usable'])} usable"
      for name, r in sorted(results.items())
      if "provenance" in r and not r["fits"]
  ]
  lines_fit = (
      "Do not fit: " + "; ".join(misfits) + ". Each is the whole global batch of 256 (its "
      "activations for the backward pass) on too few devices: more devices, a smaller "
      "`batch_size` or `model.remat` changes that."
      if misfits
      else "Every compiled cell fits."
  )
  versions = sorted({json.dumps(r["provenance"], sort_keys=True) for r in done})
  commits = sorted({r.get("commit", "?") for r in results.values()})
  dates = sorted({r.get("date", "?") for r in results.values()})
  utilization = sorted({r["utilization"] for r in done if r.get("utilization")})
  lines += [
      "",
      lines_fit,
      "",
      f"{len(results)} of {len(cells())} cells compiled. Est. = the roofline bound at "
      f"{', '.join(f'{u:.0%}' for u in utilization) or '40%'} of it (`preflight.utilization`); "
      "TPU rows use XLA's cost analysis; GPU rows, which have none, the HLO cost analysis of the "
      "GPU-optimised program read on this host (docs/scaling.md, what the figures can tell). "
      f"Provenance: commits {', '.join(commits)}, {', '.join(dates)}, compiled on a 2-core x86_64 "
      f"CPU; {'; '.join(versions)}. Each cell's command is in `{RECORD}`.",
  ]
  return "\n".join(lines) + "\n"


COMPILE = flags.DEFINE_bool("compile", False, "compile the cells (rows) missing from the record")
ONLY = flags.DEFINE_string("only", "", "with --compile: only cells whose name contains this")
SKIP = flags.DEFINE_string("skip", "", "with --compile: leave out cells whose name contains this")


@exit_on_user_error
def main(argv: list[str]) -> None:
  del argv
  if COMPILE.value:
    compile_missing(ONLY.value, SKIP.value)


if __name__ == "__main__":
  app.run(main)
