r"""One command for a lent GPU: the figures the preflight and the dispatch choice rest on.

  python benchmarks/accelerator_check.py --out=$OUT/accelerator_check.json    # a lent GPU, < 9 min
  python benchmarks/accelerator_check.py --size=tiny --out=/tmp/ac/check.json  # any CPU: the path

A driver of the commands that measure each figure (docs/benchmarks.md, "Accelerator check"): the
JSON and its markdown (`.md`) are rewritten after each, one failing is recorded with its error."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[1:1] = [ROOT, os.path.join(ROOT, "benchmarks")]  # Importable without an install.
import bench_utils  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import moe_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import train_step  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from trainkit.distributed import child_environment  # noqa: E402  pylint: disable=g-import-not-at-top

# A google-research/vmoe checkout and CelebA's JPEGs: beside the repository, or in .carry/.
PEERS = (os.path.join(ROOT, "..", "shared", "peers", "vmoe"), os.path.join(ROOT, ".carry/vmoe"))
CELEBA = (os.path.join(ROOT, "..", "shared", "data", "celeba"), os.path.join(ROOT, ".carry/celeba"))
PACKAGES = (
    "jax jaxlib flax optax orbax-checkpoint grain array-record ml-collections tensorboardX " "numpy"
).split()  # What the units import.
PARTS = ("train_step", "moe_layer", "input_pipeline", "tests", "quickstart")
# The test files a lent device runs (docs/benchmarks.md, "The tests on a lent GPU").
DEVICE_TESTS = tuple(
    f"tests/test_{name}.py"
    for name in (
        "moe_algorithms moe routers causal_attention gelu vit swin fairness_metrics decoding "
        "moe_layer_options remat optim causal_models dropless_tpu methods fairness_training "
        "constraints"
    ).split()
)
OURS = ("sort", "einsum", "dropless")  # What `moe.dispatch=auto` may choose on a GPU.
TRAIN = {"batch_size": 256, "compute_dtype": "bfloat16", "preflight.eval_step": False}
SIZES = {  # moe: shape, experts, top-k, rounds; pipeline: image size, batch, batches, workers.
    "full": dict(
        train_config="configs/celeba.py",
        train=TRAIN,
        warmup=3,
        timed=30,
        moe=("deit_s", (4, 64), 2, 20),
        pipeline=(224, 256, 4, ("0", "cores")),
        quickstart=("configs/quickstart.py",),
        tests=DEVICE_TESTS,
        budget_s=480.0,
    ),
    "tiny": dict(
        train_config="configs/celeba.py:size=small,method=vanilla_smoe",
        train=dict(TRAIN, batch_size=8, **{"model.depth": 1}),
        warmup=1,
        timed=2,
        moe=("tiny", (4,), 2, 2),
        pipeline=(32, 8, 2, ("0",)),  # Quickstart: test_cli's.
        quickstart=(
            "configs/quickstart.py:steps=2",
            *(
                f"--config.{o}"
                for o in (
                    "method=vanilla_smoe data.train_size=64 data.val_size=32 data.test_size=32 "
                    "model.dim=16 model.depth=1 model.num_heads=2 model.mlp_dim=32 batch_size=16 "
                    "eval_batch_size=32 log_every_steps=1 analysis_batches=0"
                ).split()
            ),
        ),
        tests=("tests/test_gelu.py", "-k", "float64_reference"),
        budget_s=900.0,
    ),
}
# (part, name, seconds at most and of budget needed to start, at full size; platform), in order
# of what the figures decide. From a cold compilation cache the tests took over 240 s on an H200.
UNITS = (
    ("environment", "probe", 60, 10, "device"),
    ("train_step", "prediction", 150, 30, "cpu"),
    ("train_step", "measured", 200, 60, "device"),
    ("moe_layer", "layer", 180, 45, "device"),
    ("input_pipeline", "throughput", 90, 20, "cpu"),
    ("tests", "device", 330, 60, "device"),
    ("quickstart", "device", 150, 30, "device"),
    ("quickstart", "cpu", 200, 45, "cpu"),
)
TRAIN_ROWS = (  # The train step's table: measured, predicted, their ratio, and the scale shown.
    (
        "peak memory (GiB), the step's program",
        "peak_bytes",
        "program_peak_bytes",
        "peak_over_program_peak",
        2**-30,
    ),
    ("peak memory (GiB), with the batches ahead", "", "peak_bytes", "peak_over_fit_peak", 2**-30),
    ("step time (ms)", "step_seconds", "step_seconds", "step_over_predicted_step", 1e3),
    ("roofline bound (ms)", "", "roofline_seconds", "step_over_roofline", 1e3),
    ("share of the roofline bound reached", "implied_utilization", "utilization", "", 1),
    ("images/s", "images_per_s", "", "", 1),
)
# The environment unit: the device, and the versions of the packages the others import.
PROBE = """import importlib.metadata as m, jax, json, os, platform, sys
d, v = jax.devices()[0], {x.metadata["Name"].lower(): x.version for x in m.distributions()}
json.dump(dict(packages={p: v.get(p.lower()) for p in sys.argv[2:]}, device_kind=d.device_kind,
  platform=d.platform, device_count=jax.device_count(), jax=jax.__version__, host=platform.node(),
  python=platform.python_version(), host_cores=len(os.sched_getaffinity(0)),
  memory_stats=d.memory_stats() is not None), open(sys.argv[1], "w"))"""


def read_json(path: str) -> dict:
  try:
    return json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError):
    return {}


def pytest_summary(output: str) -> dict:
  """pytest -q's counts and FAILED/ERROR lines; where it was stopped before its last line, how
  many tests had run, and failed, by its progress lines; {} if neither is there."""
  if last := re.findall(r"^=* ?(\d+ \w+.* in [\d.]+s)", output, re.M):
    found = {
        kind.replace("error", "errors"): int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", last[-1])
    }
    counts = {k: found.get(k, 0) for k in ("passed", "failed", "errors", "skipped")}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.{0,240}))?", output, re.M)
    return dict(
        counts,
        tests=sum(counts.values()),
        failures=[{"test": test, "message": message} for test, message in failures],
    )
  marks = "".join(re.findall(r"^([.sxXFE]+)(?: +\[ *\d+%\])?$", output, re.M))
  failed = marks.count("F") + marks.count("E")
  return {"ran_before_stop": len(marks), "failed_before_stop": failed} if marks else {}


def run_unit(unit: tuple, args: argparse.Namespace, scratch: str, timeout: float) -> dict:
  """One unit in a process of its own: its record, with status, seconds and any error."""
  (part, name, *_, where), size, cores = unit, SIZES[args.size], len(os.sched_getaffinity(0))
  path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])  # The project, installed or not.
  env = child_environment({"PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
  env.update({"JAX_PLATFORMS": "cpu"} if where == "cpu" else {})
  out, record, failed = os.path.join(scratch, f"{part}.{name}"), {}, ""
  shape, experts, top_k, repeats = size["moe"]
  image_size, batch, batches, workers = size["pipeline"]
  workers = [max(1, cores - 1) if w == "cores" else int(w) for w in workers]
  peer = next((p for p in PEERS if os.path.isfile(os.path.join(p, "vmoe", "moe.py"))), None)
  root = next((r for r in CELEBA if os.path.isdir(f"{r}/img_align_celeba")), CELEBA[0])
  test_workers = max(1, min(12, cores - 1)) if args.size == "full" else 1
  if part == "tests" and test_workers > 1:  # Processes that share the device share its memory.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  command = {
      "environment": ["-c", PROBE, out, *PACKAGES],
      "prediction": [
          "-m",
          "fairmoe_jax.main",
          f"--config={size['train_config']}",
          "--mode=compile",
          f"--config.preflight.target={args.target}",
          *(f"--config.{k}={v}" for k, v in size["train"].items()),
          f"--workdir={out}",
      ],
      "measured": [
          "benchmarks/train_step.py",
          f"--program={size['train_config']}",
          f"--set={json.dumps(size['train'])}",
          f"--warmup={size['warmup']}",
          f"--steps={size['timed']}",
          f"--output={out}",
      ],
      "moe_layer": [
          "benchmarks/moe_layer.py",
          f"--shape={shape}",
          f"--top_k={top_k}",
          "--dtype=bfloat16",
          f"--repeats={repeats}",
          "--experts",
          *map(str, experts),
          "--dispatch",
          *OURS,
          *([f"--peer-vmoe={peer}"] if peer else ["vmoe_ref"]),
          f"--output={out}",
      ],
      "input_pipeline": [
          "benchmarks/input_pipeline.py",
          f"--data_root={root}",
          "--synthetic",
          f"--workers={','.join(map(str, workers))}",
          "--rows=uint8_one_pass",
          f"--batch_size={batch}",
          f"--image_size={image_size}",
          f"--output={out}",
          f"--batches={batches + 2 * max(workers)}",
      ],  # Many workers: longer.
      # No pytest-benchmark (the GPU image has it): under xdist it warns once per worker.
      "tests": [
          "-m",
          "pytest",
          "-q",
          "-rfE",
          "-p",
          "no:cacheprovider",
          "-p",
          "no:benchmark",
          *(["-n", str(test_workers)] if test_workers > 1 else []),
          *size["tests"],
      ],
      "quickstart": [
          "-m",
          "fairmoe_jax.main",
          f"--config={size['quickstart'][0]}",
          f"--workdir={out}",
          *size["quickstart"][1:],
      ],
  }[name if name in ("measured", "prediction") else part]
  if part != "environment":
    record["command"] = shlex.join(["python", *command]).replace(out, "DIR")
  code, output, seconds = bench_utils.run_command([sys.executable, *command], env, timeout, ROOT)
  found = read_json(os.path.join(out, "preflight.json") if name == "prediction" else out)
  if name == "prediction":
    record.update(train_step.prediction_summary(found), source="compiled in this run")
  elif part == "moe_layer":
    record.update(
        shape=shape,
        top_k=top_k,
        repeats=repeats,
        rows=found.get("rows", []),
        peer=peer,
        **moe_layer.fastest_dispatch(found.get("rows", []), OURS, found.get("platform")),
    )
  elif part == "input_pipeline":
    record.update(
        source=found.get("args", {}).get("source"),
        host_cores=cores,
        image_size=image_size,
        rows=found.get("rows", []),
    )
  elif part == "tests":
    record.update(pytest_summary(output))
    if not record.get("tests"):
      failed = "no test report"
    elif code == 1:  # Tests failed: counted, not a crash.
      code, failed = 0, f"{record['failed'] + record['errors']} of {record['tests']} tests failed"
  elif part == "quickstart":
    report = read_json(os.path.join(out, "report.json"))
    with open(f"{out}/metrics.jsonl" if report else os.devnull) as f:  # The last training line.
      last = ([m for m in map(json.loads, f) if "loss" in m] or [{}])[-1]
    record.update(
        wall_seconds=round(seconds, 1),
        test_accuracy=report.get("accuracy"),
        test_examples=report.get("num_examples"),
        final_loss=last.get("loss"),
        examples_per_second=last.get("examples_per_second"),
        mf=report.get("mf"),
        routing_by_group=report.get("routing_by_group"),
    )
    failed = "" if report else "no report.json"
  else:
    record.update((found.get("rows") or [found])[0])
  if code == 0 and not failed:
    return dict(record, status="ok", seconds=round(seconds, 1))
  error = (
      f"stopped after {seconds:.0f} s, its share of the budget"
      if code is None
      else failed
      or f"exit code {code}: {(output.strip().splitlines() or ['no output'])[-1].strip()}"
  )
  return dict(
      record,
      status="timeout" if code is None else "error",
      error=error,
      seconds=round(seconds, 1),
      output_tail=output[-2000:],
  )


def derive(result: dict) -> None:
  """Each part's status, the measured step over its prediction, and the pipeline beside it."""
  parts = result["parts"]
  for units in parts.values():  # ok, skipped, error (one failed or timed out) or partial.
    got = {u["status"] for u in units.values() if isinstance(u, dict) and "status" in u}
    units["status"] = (
        "pending"
        if not got
        else "ok"
        if got == {"ok"}
        else "skipped"
        if got == {"skipped"}
        else "error"
        if got & {"error", "timeout"}
        else "partial"
    )
  train, pipeline = parts["train_step"], parts["input_pipeline"]
  measured, predicted = train.get("measured") or {}, train.get("prediction") or {}
  if measured.get("step_seconds") and predicted.get("step_seconds"):
    train["ratios"] = train_step.compare_with_prediction(measured, predicted)
  rows, step = (pipeline.get("throughput") or {}).get("rows"), measured.get("images_per_s")
  if rows and step:
    best = max(rows, key=lambda r: r["images_per_s"])
    pipeline["vs_step"] = dict(
        step_images_per_s=step,
        pipeline_images_per_s=best["images_per_s"],
        pipeline_workers=best["workers"],
        pipeline_over_step=best["images_per_s"] / step,
        cores_to_feed_step=step / max(r["images_per_s_per_core"] for r in rows),
    )


def markdown(result: dict) -> str:
  """The docs/benchmarks.md section of a result: device, date, JAX, command, each part's main
  figures (all are in the JSON), and what was not measured."""
  fmt, table = bench_utils.fmt, bench_utils.markdown_table
  env, parts = result.get("environment") or {}, result["parts"]
  train, moe, pipeline, tests, quick = (parts[p] for p in PARTS)
  measured, predicted = train.get("measured") or {}, train.get("prediction") or {}
  ratios, layer, run = train.get("ratios") or {}, moe.get("layer") or {}, tests.get("device") or {}
  flow, vs, device = (
      pipeline.get("throughput") or {},
      pipeline.get("vs_step") or {},
      env.get("device_kind", "unknown device"),
  )
  fastest = ", ".join(
      f"E={e}: `{x['ours']}` ({x['ours_ms']:.2f} ms; of all rows `{x['overall']}`)"
      for e, x in layer.get("fastest", {}).items()
  )
  lines = [
      f"### Accelerator check: {device}, {result['date']}",
      "",
      f"Device: {device} ("
      f"{env.get('platform')}, {env.get('device_count')} device(s)); host {env.get('host_cores')}"
      f" cores; JAX {env.get('jax')}; size `{result['size']}`; {result.get('elapsed_s', 0):.0f} "
      f"s of a {result['budget_s']:.0f} s budget.",
      "",
      "```bash",
      result["command"],
      "```",
      "",
      f"**Train step** ({train.get('status')}): `{measured.get('config')}`, batch "
      f"{measured.get('batch_size')}, dispatch `{measured.get('dispatch')}`, median of "
      f"{measured.get('timed_steps')} steps; predicted for `{predicted.get('target')}`: "
      f"{predicted.get('source')}."
      + " **The prediction is for another chip.**" * (ratios.get("same_chip") is False),
      "",
      "| | measured | predicted | measured / predicted |",
      "|---|---:|---:|---:|",
      *(
          f"| {label} | {fmt({**ratios, **measured}.get(a), 2, scale)} | "
          f"{fmt(predicted.get(b), 2, scale)} | {fmt(ratios.get(r))} |"
          for label, a, b, r, scale in TRAIN_ROWS
      ),
      "",
      f"**MoE layer** ({moe.get('status')}): `{layer.get('shape')}`, top-{layer.get('top_k')}, "
      f"bfloat16, forward and backward, median of {layer.get('repeats')} alternated rounds; "
      f"V-MoE: {layer.get('peer')}. Fastest of ours: {fastest}; `auto` today: "
      f"`{layer.get('auto', {}).get('current')}`.",
      *table(
          layer.get("rows", []),
          [
              ("E", "num_experts"),
              ("dispatch", "dispatch"),
              ("fwd+bwd (ms)", "time_ms"),
              ("vs dense", "vs_dense"),
              ("scratch (MiB)", "temp_size_in_bytes", 1, 2**-20),
          ],
      ),
      "",
      f"**Input pipeline** ({pipeline.get('status')}): `uint8_one_pass`, {flow.get('image_size')} "
      f"px, {flow.get('source')}; the step takes {fmt(vs.get('step_images_per_s'), 0)} images/s: "
      f"{fmt(vs.get('cores_to_feed_step'), 1)} cores at the best per-core rate.",
      *table(
          flow.get("rows", []),
          [
              ("workers", "workers"),
              ("images/s", "images_per_s", 0),
              ("per core", "images_per_s_per_core", 0),
          ],
      ),
      "",
      f"**Tests on the device** ({tests.get('status')}): "
      + ", ".join(
          f"{run[k]} {k}"
          for k in ("tests passed failed errors skipped ran_before_stop failed_before_stop".split())
          if k in run
      )
      + f"; `{run.get('command')}`",
      *table(run.get("failures", []), [("failing test", "test"), ("message", "message")]),
      "",
      f"**Quickstart** ({quick.get('status')}): `{(quick.get('device') or {}).get('command')}`: "
      + "; ".join(
          f"{k} {fmt(r.get('wall_seconds'), 1)} s, test accuracy "
          f"{fmt(r.get('test_accuracy'), 4)}, last loss {fmt(r.get('final_loss'), 4)}"
          for k, r in quick.items()
          if isinstance(r, dict)
      )
      + ".",
  ]
  problems = [
      f"- `{part}.{name}`: {r['status']}: {r.get('error') or r.get('reason', '')}"
      for part, units in [("environment", {"probe": env}), *parts.items()]
      for name, r in units.items()
      if isinstance(r, dict) and r.get("status") in ("error", "timeout", "skipped")
  ]
  return (
      "\n".join(lines + ["", "Not measured, or not all of it:", "", *problems] * bool(problems))
      + "\n"
  )


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=f"{ROOT}/benchmarks/results/accelerator_check.json")
  parser.add_argument("--size", default="full", choices=sorted(SIZES))
  parser.add_argument("--budget_s", type=float, help="seconds for all units (480 at full size)")
  parser.add_argument("--target", default="auto", help="the prediction's; auto: the chip's")
  parser.add_argument("--preflight_json", default="", help="predictions made beforehand, by target")
  args = parser.parse_args(argv)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  size, start, now = SIZES[args.size], time.perf_counter(), datetime.datetime.now()
  budget = size["budget_s"] if args.budget_s is None else args.budget_s
  flags = shlex.join(sys.argv[1:] if argv is None else argv)
  result = dict(
      command=f"python benchmarks/accelerator_check.py {flags}".strip(),
      date=now.date().isoformat(),
      started=now.isoformat(timespec="seconds"),
      size=args.size,
      target=args.target,
      budget_s=budget,
      environment={},
      parts={p: {} for p in PARTS},
  )
  with tempfile.TemporaryDirectory(prefix="accelerator_check_") as scratch:
    for part, name, cap, minimum, where in UNITS:
      left = budget - (time.perf_counter() - start)
      if left < max(minimum if args.size == "full" else 0.0, 1.0):
        record = {
            "status": "skipped",
            "reason": f"time budget: {max(left, 0):.0f} of " f"{budget:.0f} s left",
        }
      elif name == "cpu" and result["environment"].get("platform") == "cpu":  # The same run.
        record = dict(result["parts"]["quickstart"].get("device") or {}, same_as_device=True)
      elif (
          name == "prediction"
          and args.preflight_json
          and (
              given := train_step.find_prediction(
                  args.preflight_json.split(","), args.target, size["train"]["batch_size"]
              )
          )
      ):
        record = dict(given, status="ok", seconds=0.0)  # Made beforehand.
      else:
        print(f"[{time.perf_counter() - start:4.0f} s] {part}.{name}, at most {left:.0f} s")
        timeout = min(cap if args.size == "full" else left, left)
        record = run_unit((part, name, cap, minimum, where), args, scratch, timeout)
      if part == "environment":
        result["environment"] = record
        if args.target == "auto":  # The prediction is for the chip found.
          args.target = result["target"] = train_step.one_device_target(record.get("device_kind"))
      else:
        result["parts"][part][name] = record
      why = record.get("error") or record.get("reason") or ""
      print(
          f"[{time.perf_counter() - start:4.0f} s] {part}.{name}: {record['status']} {why}\n"
          f"{record.get('output_tail', '')}",
          flush=True,
      )
      result["elapsed_s"] = round(time.perf_counter() - start, 1)
      derive(result)
      for path, text in (
          (args.out, json.dumps(result, indent=2, default=str)),
          (os.path.splitext(args.out)[0] + ".md", markdown(result)),
      ):
        pathlib.Path(f"{path}.tmp").write_text(text)
        os.replace(f"{path}.tmp", path)  # Whole or not at all.
  print(f"\nwrote {args.out}\n\n{markdown(result)}", flush=True)
  return result


if __name__ == "__main__":
  main()
