"""gs:// workdirs against a GCS API server: the real clients, as a user runs them.

fake-gcs-server (tests/gcs_server.py) serves GCS's JSON API on localhost; gcsfs (every file of
the run) and TensorStore's GCS driver (Orbax's arrays) reach it through the variables a user
sets for any GCS endpoint. Each run is `python -m ...` in a working directory and a $TMPDIR of
its own, both empty and checked to stay so; what the bucket holds is listed and read over the
server's HTTP API, never through our code. tests/e2e/test_remote_workdir.py covers the same runs
against an in-process fake, faster, without the network clients.

One module fixture trains the quickstart (tiny) as a user would sweep it, on a gs:// workdir:
`paper_runner.sweep --mode=commands` writes the commands of two runs that differ only in how
often they save a checkpoint, so they train alike. The first is run; the second is stopped by
SIGTERM midway and its command run again resumes it: its losses are the first's. Then
`--mode=collect` reads their reports back from the bucket, and eval, predict and export run from
the resumed run's workdir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import ONE_DEVICE_XLA_FLAGS, REPO_ROOT, without_cuda_plugin_log
from event_files import scalar_events
from gcs_server import Bucket, gcs, gcs_server, guard_variables, new_bucket  # noqa: F401
from trainkit.errors import USER_ERROR_EXIT_CODE

STEPS = 12
SIGNAL_AFTER = 4  # Logged steps before the SIGTERM.
CHECKPOINT_EVERY = (STEPS, 6)  # The sweep's grid: the uninterrupted run, the stopped one.
RUNS = [f"sweep/runs/checkpoint_every_steps={steps}" for steps in CHECKPOINT_EVERY]
RESUMED = RUNS[1]  # Its path in the bucket.
# The quickstart cut to seconds: a tiny model and dataset, a line per step, no evaluation during
# training nor gradient analysis at the end.
TINY = {
    "data.train_size": 256,
    "data.val_size": 32,
    "data.test_size": 64,
    "model.dim": 32,
    "model.depth": 2,
    "model.num_heads": 2,
    "model.mlp_dim": 64,
    "batch_size": 32,
    "eval_batch_size": 64,
    "analysis_batches": 0,
    "log_every_steps": 1,
    "eval_every_steps": 0,
    "fair.review_every_steps": 6,
}
SWEEP = f"""
import ml_collections
from paper_runner.spec import dotted

def get_config(arg=None):
  return ml_collections.ConfigDict(dict(
      module="fairmoe_jax.main",
      config="{REPO_ROOT / 'configs' / 'quickstart.py'}:steps={STEPS}",
      grid=dotted({{"checkpoint_every_steps": {CHECKPOINT_EVERY!r}}}),
      overrides=dotted({TINY!r}),
      metrics=("accuracy", "mf.pqd"),
  ))
"""
# stderr lines that are warnings or errors: absl's W/E lines (Python and C++), Python's warnings
# and logging, and gcsfs's credential complaint however it is printed.
_WARNING = re.compile(r"^[WEF]\d{4} |warning|error|credentials", re.IGNORECASE)


def warnings_in(stderr: str, expected: str = "") -> list[str]:
  """The warning lines of `stderr` but those of the CUDA plugin (conftest.py) and those that
  `expected` (a regex) matches."""
  lines = without_cuda_plugin_log(stderr).splitlines()
  return [l for l in lines if _WARNING.search(l) and not (expected and re.search(expected, l))]


@dataclasses.dataclass
class Places:
  """A run's own working directory and $TMPDIR (both empty), and the bucket's variables."""

  root: Path
  bucket: Bucket

  def __post_init__(self) -> None:
    self.cwd, self.tmp = self.root / "cwd", self.root / "tmp"
    self.cwd.mkdir(parents=True)
    self.tmp.mkdir()

  def env(self) -> dict[str, str]:
    env = dict(self.bucket.env, XLA_FLAGS=ONE_DEVICE_XLA_FLAGS)  # One device.
    # The JAX compilation cache (conftest.py) stays where the suite keeps it: a cache we name.
    env.update(PYTHONPATH=str(REPO_ROOT), TMPDIR=str(self.tmp), PYTHONUNBUFFERED="1")
    return env

  def command(self, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]

  def run(self, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        self.command(module, *args),
        cwd=self.cwd,
        env=self.env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return self.checked(result)

  def checked(
      self, result: subprocess.CompletedProcess[str], expected: str = "", code: int = 0
  ) -> subprocess.CompletedProcess[str]:
    """`result` of a run that exited `code`, wrote nothing locally and printed no warning but
    those `expected` matches."""
    assert result.returncode == code, result.stderr[-3000:]
    assert sorted(self.cwd.rglob("*")) == [], "the run wrote into its working directory"
    assert sorted(self.tmp.rglob("*")) == [], "the run wrote into $TMPDIR"
    assert warnings_in(result.stderr, expected) == [], result.stderr[-3000:]
    return result


def _args(settings: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in settings.items()]


def _losses(bucket: Bucket, run: str) -> dict[int, float]:
  """{step: loss} of `run`'s metrics.jsonl, as the bucket serves it."""
  lines = bucket.read(f"{run}/metrics.jsonl").decode().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _command_lines(bucket: Bucket, sweep: str) -> list[list[str]]:
  """The runs of the bucket's `sweep/commands.sh`, each as the argv `python -m ...`."""
  text = bucket.read(f"{sweep}/commands.sh").decode()
  return [shlex.split(line) for line in text.splitlines() if line.startswith("python -m ")]


@dataclasses.dataclass
class Trained:
  bucket: Bucket
  root: Path  # Where each group of runs has its own working directory and $TMPDIR.
  sweep_file: Path
  sweep_runs: list[list[str]]  # The runs' argv, as commands.sh gives them.
  collected: str  # --mode=collect's stdout.
  stopped: subprocess.CompletedProcess[str]
  stopped_at: int
  resumed: subprocess.CompletedProcess[str]
  stderrs: list[str]  # Of every run, for the warnings test.


@pytest.fixture(scope="module")
def trained(gcs_server, tmp_path_factory) -> Trained:  # noqa: F811
  bucket = new_bucket(gcs_server)
  root = tmp_path_factory.mktemp("gcs_runs")
  sweep_file = root / "sweep.py"
  sweep_file.write_text(SWEEP)
  places = Places(root / "sweep", bucket)

  # The sweep's commands, written into the bucket; the first run as commands.sh has it.
  workdir = f"{bucket.uri}/sweep"
  written = places.run(
      "paper_runner.sweep", f"--sweep={sweep_file}", f"--workdir={workdir}", "--mode=commands"
  )
  assert written.stdout.strip() == f"{workdir}/commands.sh"
  runs = _command_lines(bucket, "sweep")
  assert [argv[:3] for argv in runs] == [["python", "-m", "fairmoe_jax.main"]] * 2
  stderrs = [places.run(*runs[0][2:]).stderr]

  # The second: SIGTERM once SIGNAL_AFTER steps are logged (one object per logged step:
  # metrics.jsonl.parts/), then the same command resumes it.
  process = subprocess.Popen(
      places.command(*runs[1][2:]),
      cwd=places.cwd,
      env=places.env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and process.poll() is None:
    if len(bucket.objects(f"{RESUMED}/metrics.jsonl.parts/")) >= SIGNAL_AFTER:
      process.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  stdout, stderr = process.communicate(timeout=300)
  stopped = places.checked(
      subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr),
      expected=r"\] SIGTERM received: saved a checkpoint at step \d+; stopping$",
      code=128 + signal.SIGTERM,
  )
  stopped_at = int(re.search(r"Stopped at step (\d+)", stopped.stdout).group(1))
  resumed = places.run(*runs[1][2:])
  stderrs += [stopped.stderr, resumed.stderr]
  collected = places.run(
      "paper_runner.sweep", f"--sweep={sweep_file}", f"--workdir={workdir}", "--mode=collect"
  )
  return Trained(
      bucket, root, sweep_file, runs, collected.stdout, stopped, stopped_at, resumed, stderrs
  )


def test_quickstart_on_gs_stopped_by_sigterm_resumes_with_the_uninterrupted_losses(trained):
  assert SIGNAL_AFTER <= trained.stopped_at < STEPS, "the signal came after the run ended"
  assert (
      f"Resumed from the checkpoint at step {trained.stopped_at} in {trained.bucket.uri}/{RESUMED}/"
      "checkpoints" in trained.resumed.stdout
  )
  reference = _losses(trained.bucket, RUNS[0])
  assert sorted(reference) == list(range(1, STEPS + 1))
  assert _losses(trained.bucket, RESUMED) == reference
  # The log was written one object per flush and folded into metrics.jsonl at the end.
  assert trained.bucket.objects(f"{RESUMED}/metrics.jsonl.parts/") == {}


def test_checkpoint_steps_are_objects_in_the_bucket(trained):
  """Listed over the server's HTTP API: Orbax's arrays (TensorStore's OCDBT files) are there,
  with the bytes our manifest recorded; an Orbax that wrote them elsewhere fails this."""
  bucket = trained.bucket
  listed = bucket.objects(f"{RESUMED}/checkpoints/")
  steps = {name.split("/")[4] for name in listed}
  assert {str(trained.stopped_at), str(STEPS)} <= steps, sorted(steps)
  for step in (trained.stopped_at, STEPS):
    prefix = f"{RESUMED}/checkpoints/{step}/"
    names = {name[len(prefix) :]: size for name, size in listed.items() if name.startswith(prefix)}
    assert {"commit_success.txt", "trainkit_manifest.json", "state/manifest.ocdbt"} <= set(names)
    arrays = {n: s for n, s in names.items() if re.fullmatch(r"state/(ocdbt\.process_0/)?d/\w+", n)}
    # The train state's parameters and Adam moments: tens of kilobytes even for this model.
    assert sum(arrays.values()) > 100_000, names
    manifest = json.loads(bucket.read(prefix + "trainkit_manifest.json"))["files"]
    assert set(manifest) == set(names) - {"trainkit_manifest.json"}
    for name in arrays:
      data = bucket.read(prefix + name)
      assert manifest[name] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_a_healthy_bucket_gives_no_credential_or_other_warning(trained):
  # Each run was checked as it ran (Places.checked); here the lines gcsfs used to print, a few
  # per file written ("Could not determine bucket type ... credentials were not found").
  assert len(trained.stderrs) == 3
  for stderr in trained.stderrs:
    assert "bucket type" not in stderr and "credentials" not in stderr.lower()


def test_eval_predict_and_export_run_from_the_bucket(trained):
  bucket, workdir = trained.bucket, f"{trained.bucket.uri}/{RESUMED}"
  places = Places(trained.root / "modes", bucket)
  # Without --config: each mode reads the run's config.json from the bucket.
  evaluated = places.run("fairmoe_jax.main", f"--workdir={workdir}", "--mode=eval")
  assert f"in {workdir}" in evaluated.stdout
  report = json.loads(bucket.read(f"{RESUMED}/report.json"))
  assert report["step"] == STEPS and 0.0 <= report["accuracy"] <= 1.0
  images = trained.root / "images"  # The inputs are local files, outside the run's places.
  images.mkdir()
  for i in range(3):
    Image.new("RGB", (32, 32), (40 * i, 90, 200 - 40 * i)).save(images / f"{i}.png")
  predict = ("--mode=predict", f"--config.predict.input={images}")
  predicted = places.run("fairmoe_jax.main", f"--workdir={workdir}", *predict)
  assert f"{workdir}/predict/predictions.csv" in predicted.stdout
  rows = bucket.read(f"{RESUMED}/predict/predictions.csv").decode().splitlines()
  assert len(rows) == 1 + 3 and all(f"{i}.png" in rows[1 + i] for i in range(3))
  places.run("fairmoe_jax.main", f"--workdir={workdir}", "--mode=export")
  exported = bucket.objects(f"{RESUMED}/export/")
  assert exported.get(f"{RESUMED}/export/model.safetensors", 0) > 100_000, exported


def test_sweep_commands_put_every_run_under_the_gs_workdir_and_collect_reads_them(trained):
  bucket = trained.bucket
  # python -m MODULE --config=... --workdir=
  assert [argv[4] for argv in trained.sweep_runs] == [f"--workdir={bucket.uri}/{r}" for r in RUNS]
  table = bucket.read("sweep/sweep.md").decode()
  assert "2 of 2 runs finished" in table, table
  assert table in trained.collected
  for every, run in zip(CHECKPOINT_EVERY, RUNS):
    report = json.loads(bucket.read(f"{run}/report.json"))
    row = next(line for line in table.splitlines() if line.startswith(f"| {every} |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:3] == [str(every), "ok", f"{report['accuracy']:.4g}"], row
  rows = json.loads(bucket.read("sweep/sweep.json"))["rows"]
  assert [r["run_dir"] for r in rows] == [f"{bucket.uri}/{run}" for run in RUNS]
  assert all(r["examples_per_second"] > 0 for r in rows)  # Read from each run's metrics.jsonl.


def test_a_pod_runs_the_gs_sweep_on_one_slice_created_once(trained):
  """The bucket's commands.sh given to launch/tpu_pod.sh --commands, as a dry run."""
  commands = trained.bucket.read("sweep/commands.sh").decode()
  result = subprocess.run(
      ["bash", str(REPO_ROOT / "launch" / "tpu_pod.sh"), "--dry-run", "--name", "moe-16",
       "--zone", "us-west4-a", "--accelerator", "v5litepod-16", "--delete-after",
       "--commands", "-"],
      input=commands, capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert all(line.startswith("+ ") for line in lines)
  gcloud = [line for line in lines if line.startswith("+ gcloud ")]
  verbs = [line.split()[5] for line in gcloud]  # + gcloud compute tpus tpu-vm VERB
  assert verbs == ["create", "scp", "ssh", "ssh", "ssh", "delete"], lines
  assert gcloud[0].startswith("+ gcloud compute tpus tpu-vm create moe-16 --zone=us-west4-a ")
  assert "pip install" in gcloud[2] and "--worker=all" in gcloud[2]
  for line, argv in zip(gcloud[3:5], trained.sweep_runs):
    assert "--worker=all" in line
    assert f"TRAINKIT_DISTRIBUTED=auto python3 -m fairmoe_jax.main {shlex.join(argv[3:])}" in (
        shlex.split(line[2:])[-1]
    )
  assert gcloud[-1] == "+ gcloud compute tpus tpu-vm delete moe-16 --zone=us-west4-a --quiet"
  # A line that is not `python -m MODULE ...` (a launcher's) is refused before anything runs.
  refused = subprocess.run(
      ["bash", str(REPO_ROOT / "launch" / "tpu_pod.sh"), "--dry-run", "--name", "n", "--zone",
       "z", "--accelerator", "v4-8", "--commands", "-"],
      input="launch/slurm.sh --nodes 1 -- --workdir=x\n", capture_output=True, text=True,
      timeout=60,
  )  # fmt: skip
  assert refused.returncode == 2 and refused.stdout == "" and "line 1" in refused.stderr


def test_a_sweep_run_mode_on_gs_is_refused_pointing_to_commands(trained):
  places = Places(trained.root / "refused", trained.bucket)
  result = subprocess.run(
      places.command(
          "paper_runner.sweep", f"--sweep={trained.sweep_file}", f"--workdir={trained.bucket.uri}/x"
      ),
      cwd=places.cwd, env=places.env(), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "--mode=commands" in result.stderr and "Traceback" not in result.stderr
  assert trained.bucket.objects("x") == {}


def test_missing_credentials_are_one_clear_error_before_anything_is_written(tmp_path):
  """Without an emulator, on GCS itself: the credentials a user pointed at do not exist."""
  key = tmp_path / "absent-key.json"
  env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "XLA_FLAGS")}
  env.update(guard_variables(), GOOGLE_APPLICATION_CREDENTIALS=str(key), PYTHONPATH=str(REPO_ROOT))
  (tmp_path / "cwd").mkdir()
  result = subprocess.run(
      [sys.executable, "-m", "fairmoe_jax.main", f"--config={REPO_ROOT / 'configs/quickstart.py'}",
       "--workdir=gs://bucket/run"],
      cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert "no Google Cloud credentials" in lines[0] and str(key) in lines[0]
  assert "gs://bucket/run" in lines[0]
  assert list((tmp_path / "cwd").iterdir()) == []


def test_metrics_log_on_gs_uploads_one_small_object_per_flush(gcs):  # noqa: F811
  """metrics.jsonl on an object store: a flush uploads its line alone (rewriting the object
  whole made a run's uploads grow with the square of its logged steps); readers see the whole
  log at any time, and a resume or a close folds it into metrics.jsonl."""
  from trainkit import metric_writers
  from trainkit.metric_writers import MetricWriter, read_metrics

  workdir = f"{gcs.uri}/m"
  writer = MetricWriter(workdir, tensorboard=False)
  for step in range(1, 31):
    writer.write_scalars(step, {"loss": 1.0 / step, "accuracy": step / 100})
    writer.flush()
  parts = gcs.objects("m/metrics.jsonl.parts/")
  assert len(parts) == 30 and max(parts.values()) < 80, parts  # One line each.
  assert "m/metrics.jsonl" not in gcs.objects("m/")
  assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 31))
  # More scalars for the last step replace its line (its object), still one line per step.
  writer.write_scalars(30, {"test/accuracy": 0.5})
  writer.flush()
  assert read_metrics(workdir)[-1] == {"step": 30, "loss": 1 / 30, "accuracy": 0.3,
                                       "test/accuracy": 0.5}  # fmt: skip
  # A writer killed without closing leaves its parts; a resumed run's writer folds them in,
  # dropping the steps after its checkpoint.
  resumed = MetricWriter(workdir, tensorboard=False)
  resumed.truncate_after(20)
  assert set(gcs.objects("m/")) == {"m/metrics.jsonl"}
  assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 21))
  for step in range(21, 26):
    resumed.write_scalars(step, {"loss": 0.0})
  resumed.close()
  assert set(gcs.objects("m/")) == {"m/metrics.jsonl"}
  lines = gcs.read("m/metrics.jsonl").decode().splitlines()
  assert [json.loads(line)["step"] for line in lines] == list(range(1, 26))
  # Parts left behind by a fold that stopped before deleting them are not read twice.
  metric_writers.RemoteLog(f"{workdir}/metrics.jsonl").append(lines[-1])
  assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 26))


def test_tensorboard_events_on_gs_upload_one_small_object_per_flush(gcs):  # noqa: F811
  """TensorBoard's event file on an object store: a flush uploads the events since the last one
  as an object of its own (the whole file at each flush grew with the square of the run);
  TensorBoard reads the parts in name order, and a close folds them into one event file."""
  from trainkit.metric_writers import MetricWriter

  writer = MetricWriter(f"{gcs.uri}/tb")
  for step in range(1, 31):
    writer.write_scalars(step, {"loss": 1.0 / step})
    writer.flush()
  parts = {k: v for k, v in gcs.objects("tb/tensorboard/").items() if "tfevents" in k}
  # One object per flush, each holding only the events since the one before: a flush writes
  # every event logged before it (a writer thread that a flush did not wait for, as
  # tensorboardX's SummaryWriter has, would leave fewer parts), and uploading the whole file at
  # each flush would leave one object, growing.
  assert len(parts) == 30 and max(parts.values()) < 2 * min(parts.values()), parts
  # Read in name order, as TensorBoard reads a folder, the parts are the run's events so far.
  events = scalar_events(b"".join(gcs.read(name) for name in sorted(parts)))
  expected = [(step, {"loss": pytest.approx(1.0 / step)}) for step in range(1, 31)]
  assert events == expected
  writer.close()
  (folded,) = [k for k in gcs.objects("tb/tensorboard/") if "tfevents" in k]
  assert scalar_events(gcs.read(folded)) == expected
