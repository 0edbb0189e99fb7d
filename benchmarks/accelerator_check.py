r"""One command for a lent GPU: each figure the preflight and dispatch choice rest on, by its own
benchmark (docs/benchmarks.md, "Accelerator check"); failures kept; JSON and .md after each unit.

  python benchmarks/accelerator_check.py --out=$OUT/accelerator_check.json    # a lent GPU, < 9 min
  python benchmarks/accelerator_check.py --size=tiny --out=/tmp/ac/check.json  # any CPU: the path
"""

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[1:1] = [ROOT, os.path.join(ROOT, "benchmarks")]  # Importable without an install.
import moe_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import train_step  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from bench_utils import fmt, markdown_table, pytest_summary, read_json, run_command  # noqa: E402
from trainkit.distributed import child_environment  # noqa: E402  pylint: disable=g-import-not-at-top
from trainkit.storage import write_atomically  # noqa: E402  pylint: disable=g-import-not-at-top

# A google-research/vmoe checkout and CelebA's JPEGs: beside the repository, or in .carry/.
PEERS = (os.path.join(ROOT, "..", "shared", "peers", "vmoe"), os.path.join(ROOT, ".carry/vmoe"))
CELEBA = (os.path.join(ROOT, "..", "shared", "data", "celeba"), os.path.join(ROOT, ".carry/celeba"))
PACKAGES = "jax jaxlib flax optax orbax-checkpoint grain array-record ml-collections tensorboardX"
PACKAGES += " tokamax"  # None: `dropless` ran XLA's dense ragged_dot on the GPU.
PARTS = ("train_step", "moe_layer", "input_pipeline", "tests", "quickstart")
# The test files a lent device runs (docs/benchmarks.md, "The tests on a lent GPU").
DEVICE_TESTS = [f"tests/{d}/test_{name}.py" for d, name in (t.split("/") for t in """
fairmoe_jax/moe_algorithms fairmoe_jax/moe fairmoe_jax/routers fairmoe_jax/gelu fairmoe_jax/vit
fairmoe_jax/swin fairmoe_jax/fairness_metrics fairmoe_jax/remat fairmoe_jax/moe_layer_options
fairmoe_jax/dropless_tpu fairmoe_jax/methods fairmoe_jax/fairness_training
causal_attn_jax/causal_attention causal_attn_jax/decoding causal_attn_jax/causal_models
causal_attn_jax/constraints trainkit/optim""".split())]
OURS = ("sort", "einsum", "dropless")  # What `moe.dispatch=auto` may choose on a GPU.
TRAIN = {"batch_size": 256, "compute_dtype": "bfloat16", "preflight.eval_step": False}
SIZES = {  # moe: shape, experts, top-k, rounds; pipeline: image size, batch, batches, workers.
    "full": dict(
        train_config="configs/celeba.py",
        train=TRAIN,
        steps=(3, 30),  # Warm-up and timed.
        moe=("deit_s", (4, 64), 2, 20),
        pipeline=(224, 256, 4, ("0", "cores")),
        quickstart=("configs/quickstart.py",),
        tests=DEVICE_TESTS,
        budget_s=480.0,
    ),
    "tiny": dict(
        train_config="configs/celeba.py:size=small,method=vanilla_smoe",
        train=dict(TRAIN, batch_size=8, **{"model.depth": 1}),
        steps=(1, 2),
        moe=("tiny", (4,), 2, 2),
        pipeline=(32, 8, 2, ("0",)),
        quickstart=(  # test_cli's.
            "configs/quickstart.py:steps=2 --config.method=vanilla_smoe "
            "--config.data.train_size=64 --config.data.val_size=32 --config.data.test_size=32 "
            "--config.model.dim=16 --config.model.depth=1 --config.model.num_heads=2 "
            "--config.model.mlp_dim=32 --config.batch_size=16 --config.eval_batch_size=32 "
            "--config.log_every_steps=1 --config.analysis_batches=0"
        ).split(),
        tests="tests/fairmoe_jax/test_gelu.py -k float64_reference".split(),
        budget_s=900.0,
    ),
}
# Each unit's command: a token that is one field of a list stands for its items.
COMMANDS = {
    "probe": "-c {probe} {out} {packages}",
    "prediction": "-m fairmoe_jax.main --config={train_config} --mode=compile "
    "--config.preflight.target={target} {flags} --workdir={out}",
    "measured": "benchmarks/train_step.py --program={train_config} --set={train_json} "
    "--warmup={steps[0]} --steps={steps[1]} --output={out}",
    "layer": "benchmarks/moe_layer.py --shape={moe[0]} --top_k={moe[2]} --dtype=bfloat16 "
    "--repeats={moe[3]} --experts {experts} --dispatch {ours} {peer} --output={out}",
    "throughput": "benchmarks/input_pipeline.py --data_root={root} --synthetic --workers={workers} "
    "--rows=uint8_one_pass --batch_size={pipeline[1]} --image_size={pipeline[0]} --output={out} "
    "--batches={batches}",
    # No pytest-benchmark (the GPU image has it): under xdist it warns once per worker.
    "tests": "-m pytest -q -rfE -p no:cacheprovider -p no:benchmark {xdist} {tests}",
    "quickstart": "-m fairmoe_jax.main --config={quickstart[0]} --workdir={out} {quickstart_flags}",
}
# (part, name, seconds at most and of the budget to start at full size, platform), decisive first.
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
# The environment unit: the device, and the versions of the packages the others import.
PROBE = """import importlib.metadata as m, jax, json, os, platform, sys
d, v = jax.devices()[0], {x.metadata["Name"].lower(): x.version for x in m.distributions()}
json.dump(dict(packages={p: v.get(p.lower()) for p in sys.argv[2:]}, device_kind=d.device_kind,
  platform=d.platform, device_count=jax.device_count(), jax=jax.__version__, host=platform.node(),
  python=platform.python_version(), host_cores=len(os.sched_getaffinity(0)),
  memory_stats=d.memory_stats() is not None), open(sys.argv[1], "w"))"""


def run_unit(unit: tuple, args: argparse.Namespace, scratch: str, timeout: float) -> dict:
  """One unit in a process of its own: its record, with status, seconds and any error."""
  (part, name, *_, where), size, cores = unit, SIZES[args.size], len(os.sched_getaffinity(0))
  path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])  # The project, installed or not.
  env = child_environment({"PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
  env.update({"JAX_PLATFORMS": "cpu"} if where == "cpu" else {})
  out, record, failed = os.path.join(scratch, f"{part}.{name}"), {}, ""
  shape, experts, top_k, repeats = size["moe"]
  image_size, _, batches, workers = size["pipeline"]
  workers = [max(1, cores - 1) if w == "cores" else int(w) for w in workers]
  peer = next((p for p in PEERS if os.path.isfile(os.path.join(p, "vmoe", "moe.py"))), None)
  xdist = ["-n", str(min(12, cores - 1))] if args.size == "full" and cores > 2 else []
  if part == "tests" and xdist:  # Processes that share the device share its memory.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  fields = dict(size, out=out, probe=PROBE, packages=[*PACKAGES.split(), "numpy"], ours=list(OURS))
  fields.update(target=args.target, flags=[f"--config.{k}={v}" for k, v in size["train"].items()])
  fields.update(train_json=json.dumps(size["train"]), experts=list(map(str, experts)))
  root = next((r for r in CELEBA if os.path.isdir(f"{r}/img_align_celeba")), CELEBA[0])
  fields.update(peer=[f"--peer-vmoe={peer}"] if peer else ["vmoe_ref"], root=root)
  fields.update(workers=",".join(map(str, workers)), batches=batches + 2 * max(workers))
  fields.update(quickstart_flags=list(size["quickstart"][1:]), xdist=xdist)
  command = []
  for token in COMMANDS[name if name in COMMANDS else part].split():
    items = fields.get(token.strip("{}"))
    command += items if isinstance(items, list) else [token.format(**fields)]
  if part != "environment":
    record["command"] = shlex.join(["python", *command]).replace(out, "DIR")
  code, output, seconds = run_command([sys.executable, *command], env, timeout, ROOT)
  found = read_json(f"{out}/preflight.json" if name == "prediction" else out)
  rows = found.get("rows", [])
  if name == "prediction":
    record.update(train_step.prediction_summary(found), source="compiled in this run")
  elif part == "moe_layer":
    auto = moe_layer.fastest_dispatch(rows, OURS, found.get("platform"))
    record.update(shape=shape, top_k=top_k, repeats=repeats, rows=rows, peer=peer, **auto)
  elif part == "input_pipeline":
    source = found.get("args", {}).get("source")
    record.update(source=source, host_cores=cores, image_size=image_size, rows=rows)
  elif part == "tests":
    record.update(pytest_summary(output))
    failed = "" if record.get("tests") else "no test report"
    if code == 1 and not failed:  # Tests failed: counted, not a crash.
      code, failed = 0, f"{record['failed'] + record['errors']} of {record['tests']} tests failed"
  elif part == "quickstart":
    report = read_json(os.path.join(out, "report.json"))
    with open(f"{out}/metrics.jsonl" if report else os.devnull) as f:  # The last training line.
      last = ([m for m in map(json.loads, f) if "loss" in m] or [{}])[-1]
    record.update(wall_seconds=round(seconds, 1), test_accuracy=report.get("accuracy"))
    record.update(test_examples=report.get("num_examples"), final_loss=last.get("loss"))
    record.update(examples_per_second=last.get("examples_per_second"), mf=report.get("mf"))
    record.update(routing_by_group=report.get("routing_by_group"))
    failed = "" if report else "no report.json"
  else:
    record.update((rows or [found])[0])
  if code == 0 and not failed:
    return dict(record, status="ok", seconds=round(seconds, 1))
  last_line = (output.strip().splitlines() or ["no output"])[-1].strip()
  error = failed or f"exit code {code}: {last_line}"
  error = f"stopped after {seconds:.0f} s, its share of the budget" if code is None else error
  status, tail = "timeout" if code is None else "error", output[-2000:]
  return dict(record, status=status, error=error, seconds=round(seconds, 1), output_tail=tail)


def derive(result: dict) -> None:
  """Each part's status, the measured step over its prediction, and the pipeline beside it."""
  parts = result["parts"]
  for units in parts.values():  # ok, skipped, error (one failed or timed out) or partial.
    got = {u["status"] for u in units.values() if isinstance(u, dict) and "status" in u}
    mixed = "pending" if not got else "error" if got & {"error", "timeout"} else "partial"
    units["status"] = got.pop() if got in ({"ok"}, {"skipped"}) else mixed
  train, pipeline = parts["train_step"], parts["input_pipeline"]
  measured, predicted = train.get("measured") or {}, train.get("prediction") or {}
  if measured.get("step_seconds") and predicted.get("step_seconds"):
    train["ratios"] = train_step.compare_with_prediction(measured, predicted)
  rows, step = (pipeline.get("throughput") or {}).get("rows"), measured.get("images_per_s")
  if rows and step:
    best = max(rows, key=lambda r: r["images_per_s"])
    vs = dict(step_images_per_s=step, pipeline_images_per_s=best["images_per_s"])
    vs.update(pipeline_workers=best["workers"], pipeline_over_step=best["images_per_s"] / step)
    per_core = max(r["images_per_s_per_core"] for r in rows)  # The cores at the best rate.
    pipeline["vs_step"] = dict(vs, cores_to_feed_step=step / per_core)


def markdown(result: dict) -> str:
  """The docs/benchmarks.md section of a result: each part's main figures, what was not measured."""
  env, parts = result.get("environment") or {}, result["parts"]
  train, moe, pipeline, tests, quick = (parts[p] for p in PARTS)
  measured, predicted = train.get("measured") or {}, train.get("prediction") or {}
  ratios, layer, run = train.get("ratios") or {}, moe.get("layer") or {}, tests.get("device") or {}
  flow, vs = pipeline.get("throughput") or {}, pipeline.get("vs_step") or {}
  fastest = ", ".join(
      f"E={e}: `{x['ours']}` ({x['ours_ms']:.2f} ms; of all rows `{x['overall']}`)"
      for e, x in layer.get("fastest", {}).items()
  )
  layer_columns = [("E", "num_experts"), ("dispatch", "dispatch"), ("fwd+bwd (ms)", "time_ms")]
  layer_columns += [("vs dense", "vs_dense"), ("scratch (MiB)", "temp_size_in_bytes", 1, 2**-20)]
  per_s = [("images/s", "images_per_s", 0), ("per core", "images_per_s_per_core", 0)]
  other_chip = " **The prediction is for another chip.**" * (ratios.get("same_chip") is False)
  counts = "tests passed failed errors skipped ran_before_stop failed_before_stop".split()
  quickstarts = "; ".join(
      f"{k} {fmt(r.get('wall_seconds'), 1)} s, test accuracy "
      f"{fmt(r.get('test_accuracy'), 4)}, last loss {fmt(r.get('final_loss'), 4)}"
      for k, r in quick.items()
      if isinstance(r, dict)
  )
  problems = "".join(
      f"\n- `{part}.{name}`: {r['status']}: {r.get('error') or r.get('reason', '')}"
      for part, units in [("environment", {"probe": env}), *parts.items()]
      for name, r in units.items()
      if isinstance(r, dict) and r.get("status") in ("error", "timeout", "skipped")
  )
  return f"""### Accelerator check: {env.get('device_kind', 'unknown device')}, {result['date']}

Device: {env.get('device_kind', 'unknown device')} ({env.get('platform')}, \
{env.get('device_count')} device(s)); host {env.get('host_cores')} cores; JAX {env.get('jax')}; \
size `{result['size']}`; {result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget.

```bash
{result['command']}
```

**Train step** ({train.get('status')}): `{measured.get('config')}`, batch \
{measured.get('batch_size')}, dispatch `{measured.get('dispatch')}`, cuDNN attention \
{measured.get('cudnn_attention')}, median of \
{measured.get('timed_steps')} steps; predicted for `{predicted.get('target')}`: \
{predicted.get('source')}.{other_chip}

{train_step.comparison_table(measured, predicted, ratios)}

**MoE layer** ({moe.get('status')}): `{layer.get('shape')}`, top-{layer.get('top_k')}, bfloat16, \
forward and backward, median of {layer.get('repeats')} alternated rounds; V-MoE: \
{layer.get('peer')}. Fastest of ours: {fastest}; `auto` today: \
`{layer.get('auto', {}).get('current')}`.{markdown_table(layer.get('rows', []), layer_columns)}

**Input pipeline** ({pipeline.get('status')}): `uint8_one_pass`, {flow.get('image_size')} px, \
{flow.get('source')}; the step takes {fmt(vs.get('step_images_per_s'), 0)} images/s: \
{fmt(vs.get('cores_to_feed_step'), 1)} cores at the best per-core rate.\
{markdown_table(flow.get('rows', []), [('workers', 'workers'), *per_s])}

**Tests on the device** ({tests.get('status')}): \
{', '.join(f'{run[k]} {k}' for k in counts if k in run)}; `{run.get('command')}`\
{markdown_table(run.get('failures', []), [('failing test', 'test'), ('message', 'message')])}

**Quickstart** ({quick.get('status')}): `{(quick.get('device') or {}).get('command')}`: \
{quickstarts}.
""" + (f"\nNot measured, or not all of it:\n{problems}\n" if problems else "")


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=f"{ROOT}/benchmarks/results/accelerator_check.json")
  parser.add_argument("--size", default="full", choices=sorted(SIZES))
  parser.add_argument("--budget_s", type=float, help="seconds for all units (480 at full size)")
  parser.add_argument("--target", default="auto", help="the prediction's; auto: the chip's")
  parser.add_argument("--preflight_json", default="", help="predictions made beforehand, by target")
  args = parser.parse_args(argv := sys.argv[1:] if argv is None else argv)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  size, start, now = SIZES[args.size], time.perf_counter(), datetime.datetime.now()
  budget = size["budget_s"] if args.budget_s is None else args.budget_s
  result = dict(command=shlex.join(["python", "benchmarks/accelerator_check.py", *argv]))
  result.update(date=now.date().isoformat(), started=now.isoformat(timespec="seconds"))
  result.update(size=args.size, target=args.target, budget_s=budget, environment={})
  result["parts"] = {p: {} for p in PARTS}
  with tempfile.TemporaryDirectory(prefix="accelerator_check_") as scratch:
    paths, batch = [p for p in args.preflight_json.split(",") if p], size["train"]["batch_size"]
    for part, name, cap, minimum, where in UNITS:
      left = max(0.0, budget - (time.perf_counter() - start))
      given = name == "prediction" and train_step.find_prediction(paths, args.target, batch)
      if left < max(minimum if args.size == "full" else 0.0, 1.0):
        record = dict(status="skipped", reason=f"time budget: {left:.0f} of {budget:.0f} s left")
      elif name == "cpu" and result["environment"].get("platform") == "cpu":  # The same run.
        record = dict(result["parts"]["quickstart"].get("device") or {}, same_as_device=True)
      elif given:
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
      why, tail = record.get("error") or record.get("reason") or "", record.get("output_tail", "")
      now = f"[{time.perf_counter() - start:4.0f} s] {part}.{name}"
      print(f"{now}: {record['status']} {why}\n{tail}", flush=True)
      result["elapsed_s"] = round(time.perf_counter() - start, 1)
      derive(result)
      write_atomically(args.out, json.dumps(result, indent=2, default=str))  # Whole or not at all.
      write_atomically(os.path.splitext(args.out)[0] + ".md", markdown(result))
  print(f"\nwrote {args.out}\n\n{markdown(result)}", flush=True)
  return result


if __name__ == "__main__":
  main()
