"""The launchers' --dry-run output and usage errors, and trainkit.distributed.distributed_args."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from gcs_server import gcs, gcs_server  # noqa: F401
from trainkit.distributed import distributed_args, expand_nodelist
from trainkit.errors import UserError

REPO = REPO_ROOT


def _run(script, *args, env=None):
  return subprocess.run(
      ["bash", str(REPO / "launch" / script), *args],
      capture_output=True,
      text=True,
      timeout=30,
      env=env,
  )


@pytest.mark.parametrize(
    "script",
    [
        "tpu_pod.sh",
        "tpu_worker_venv.sh",
        "slurm.sh",
        "local_multiprocess.sh",
        "slurm_gpu.sbatch",
        "slurm_array.sh",
        "slurm_array.sbatch",
        "testing/local_slurm.sh",
    ],
)
def test_scripts_parse(script):
  assert subprocess.run(["bash", "-n", str(REPO / "launch" / script)]).returncode == 0


def test_tpu_pod_dry_run_prints_create_install_run_delete():
  result = _run(
      "tpu_pod.sh",
      "--dry-run",
      "--name",
      "moe-16",
      "--zone",
      "us-west4-a",
      "--accelerator",
      "v5litepod-16",
      "--project",
      "proj",
      "--delete-after",
      "--",
      "--config=configs/quickstart.py",
      "--workdir=gs://bucket/run",
  )
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert all(line.startswith("+ ") for line in lines)
  assert lines[0] == (
      "+ gcloud compute tpus tpu-vm create moe-16 --zone=us-west4-a --project=proj "
      "--accelerator-type=v5litepod-16 --version=tpu-ubuntu2204-base"
  )
  ssh = [line for line in lines if "tpu-vm ssh moe-16" in line]
  assert len(ssh) == 2 and all("--worker=all" in line for line in ssh)
  assert "pip install -q -e . " in ssh[0] and "jax[tpu]" in ssh[0]
  assert (
      "TRAINKIT_DISTRIBUTED=auto python3 -m fairmoe_jax.main --config=configs/quickstart.py "
      "--workdir=gs://bucket/run"
  ) in ssh[1]
  assert any("tpu-vm scp" in line and "--worker=all" in line for line in lines)
  assert (
      lines[-1]
      == "+ gcloud compute tpus tpu-vm delete moe-16 --zone=us-west4-a --project=proj --quiet"
  )


def test_tpu_pod_module_and_no_delete():
  result = _run(
      "tpu_pod.sh",
      "--dry-run",
      "--name",
      "n",
      "--zone",
      "z",
      "--accelerator",
      "v4-32",
      "--module",
      "causal_attn_jax.main",
      "--",
      "--workdir=gs://b/a b",
  )
  assert result.returncode == 0, result.stderr
  assert "python3 -m causal_attn_jax.main '\\''--workdir=gs://b/a b'\\''" in result.stdout
  assert "delete" not in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--name", "n", "--zone", "z"],  # No --accelerator.
        ["--name", "n", "--zone", "z", "--accelerator", "v4-8", "--bogus"],
        ["--name"],
    ],
)
def test_tpu_pod_bad_args(args):
  result = _run("tpu_pod.sh", "--dry-run", *args)
  assert result.returncode == 2
  assert "usage: " in result.stderr and result.stdout == ""


def test_slurm_dry_run_prints_sbatch():
  result = _run(
      "slurm.sh",
      "--dry-run",
      "--nodes",
      "2",
      "--gpus-per-node",
      "8",
      "--partition",
      "gpu",
      "--time",
      "04:00:00",
      "--module",
      "causal_attn_jax.main",
      "--",
      "--config=configs/quickstart.py",
      "--workdir=/shared/run",
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout == (
      "+ sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-task=1 "
      "--export=ALL,MODULE=causal_attn_jax.main --cpus-per-task=11 --partition=gpu "
      f"--time=04:00:00 {REPO}/launch/slurm_gpu.sbatch --config=configs/quickstart.py "
      "--workdir=/shared/run\n"
  )
  given = _run("slurm.sh", "--dry-run", "--nodes", "1", "--gpus-per-node", "1",
               "--cpus-per-task", "6", "--", "--workdir=/shared/run")  # fmt: skip
  assert " --cpus-per-task=6 " in given.stdout and "=11" not in given.stdout


def test_a_gpu_task_gets_the_cores_that_feed_a_measured_h200_step():
  """slurm.sh's default --cpus-per-task: the lent H200's measured CelebA step (images/s) over
  the input pipeline's measured rate per core."""
  from fairmoe_jax.preflight import IMAGES_PER_S_PER_CORE

  text = (REPO / "launch/slurm.sh").read_text()
  default = int(re.search(r"^DEFAULT_CPUS_PER_GPU_TASK=(\d+)$", text, re.M)[1])
  record = json.loads((REPO / "benchmarks/results/h200_2026-11-27/device.json").read_text())
  step = record["parts"]["train_step"]["measured"]
  assert default == math.ceil(step["images_per_s"] / IMAGES_PER_S_PER_CORE)
  assert f"by default {default}," in text  # The usage text says so.


def test_sbatch_script_runs_the_module_under_srun():
  text = (REPO / "launch/slurm_gpu.sbatch").read_text()
  assert "#SBATCH --gpus-per-task=1" in text and "#SBATCH --ntasks-per-node=" in text
  assert "module_name=${MODULE:-fairmoe_jax.main}" in text
  assert 'python -m "${module_name}" "$@"' in text
  # srun passes the job's --cpus-per-task on to each task (it no longer inherits it).
  assert '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}' in text


def test_slurm_cpu_job_dry_run_asks_for_no_gpu():
  result = _run(
      "slurm.sh",
      "--dry-run",
      "--nodes",
      "1",
      "--gpus-per-node",
      "0",
      "--tasks-per-node",
      "2",
      "--",
      "--workdir=/shared/run",
  )
  assert result.returncode == 0, result.stderr
  # --gpus-per-task=0 overrides the batch script's `#SBATCH --gpus-per-task=1`.
  assert result.stdout == (
      "+ sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-task=0 "
      "--export=ALL,MODULE=fairmoe_jax.main,JAX_PLATFORMS=cpu "
      f"{REPO}/launch/slurm_gpu.sbatch --workdir=/shared/run\n"
  )


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--nodes", "2"],
        ["--nodes", "0", "--gpus-per-node", "8"],
        ["--nodes", "2", "--gpus-per-node", "x"],
        ["--nodes", "2", "--gpus-per-node", "8", "--time", "soon"],
        ["--nodes", "2", "--gpus-per-node", "8", "extra"],
        ["--nodes", "1", "--gpus-per-node", "0"],  # A CPU job needs --tasks-per-node.
        ["--nodes", "1", "--gpus-per-node", "8", "--tasks-per-node", "2"],  # One task per GPU.
        ["--nodes", "1", "--gpus-per-node", "8", "--cpus-per-task", "0", "--", "--workdir=/w"],
        # No workdir: the job would wait in the queue for its nodes, only to fail.
        ["--nodes", "1", "--gpus-per-node", "8"],
        ["--nodes", "1", "--gpus-per-node", "8", "--", "--config=configs/quickstart.py"],
    ],
)
def test_slurm_bad_args(args):
  result = _run("slurm.sh", "--dry-run", *args)
  assert result.returncode == 2
  assert "usage: " in result.stderr and result.stdout == ""


def test_slurm_through_a_symlink_submits_the_batch_script_beside_its_target(tmp_path):
  (tmp_path / "slurm.sh").symlink_to(REPO / "launch" / "slurm.sh")
  result = subprocess.run(
      ["bash", str(tmp_path / "slurm.sh"), "--dry-run", "--nodes", "1", "--gpus-per-node", "1",
       "--", "--workdir=/shared/run"],
      capture_output=True, text=True, timeout=30,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr
  assert f" {REPO}/launch/slurm_gpu.sbatch --workdir=/shared/run\n" in result.stdout


def _commands_file(tmp_path, done=()):
  """A commands.sh as `paper_runner.sweep --mode=commands` writes it: three runs, those in
  `done` with a report.json."""
  lines = ["#!/usr/bin/env bash", "# Sweep s.py: 3 runs.", "set -euo pipefail", "cd /repo  # Why."]
  for i in range(3):
    run_dir = tmp_path / "sweep" / "runs" / f"batch_size={i},x=a b"  # Quoted on the line.
    lines.append(f"python -m fairmoe_jax.main '--workdir={run_dir}' --config.batch_size={i}")
    if i in done:
      run_dir.mkdir(parents=True)
      (run_dir / "report.json").write_text("{}")
  path = tmp_path / "sweep" / "commands.sh"
  path.parent.mkdir(exist_ok=True)
  path.write_text("\n".join(lines) + "\n")
  return path


def test_slurm_array_submits_the_runs_without_a_report(tmp_path):
  commands = _commands_file(tmp_path, done=(1,))
  result = _run(
      "slurm_array.sh", "--dry-run", "--parallel", "2", "--time", "1:00:00", str(commands)
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout == (
      f"+ sbatch --array=0,2%2 --output={tmp_path}/sweep/slurm/%A_%a.out --ntasks=1 "
      "--cpus-per-task=1 --export=ALL,JAX_PLATFORMS=cpu --time=1:00:00 "
      f"{REPO}/launch/slurm_array.sbatch {commands}\n"
  )
  assert "3 runs: 2 without report.json, 1 done" in result.stderr
  assert f"done, skipped: {tmp_path}/sweep/runs/batch_size=1,x=a b" in result.stderr
  gpus = _run("slurm_array.sh", "--dry-run", "--gpus-per-run", "4", str(commands))
  assert " --nodes=1 --ntasks=4 --gpus-per-task=1 --cpus-per-task=1 --export=ALL " in gpus.stdout
  _commands_file(tmp_path, done=(0, 2))
  finished = _run("slurm_array.sh", "--dry-run", str(commands))
  assert finished.returncode == 0 and "nothing to submit" in finished.stdout
  assert "sbatch" not in finished.stdout


def test_slurm_array_task_runs_its_line_and_skips_a_done_run(tmp_path):
  commands = _commands_file(tmp_path, done=(0,))
  env = {"PATH": "/usr/bin:/bin", "SLURM_ARRAY_JOB_ID": "7"}
  script = ["bash", str(REPO / "launch" / "slurm_array.sbatch"), str(commands)]
  done = subprocess.run(
      script, env={**env, "SLURM_ARRAY_TASK_ID": "0"}, capture_output=True, text=True, timeout=30
  )
  assert done.returncode == 0 and "run 0 (7_0): done, skipped" in done.stdout, done.stderr
  # Run 1 starts: `cd /repo` fails here, after its directory and log were set up.
  started = subprocess.run(
      script, env={**env, "SLURM_ARRAY_TASK_ID": "1"}, capture_output=True, text=True, timeout=30
  )
  assert started.returncode != 0 and "/repo" in started.stderr
  assert (tmp_path / "sweep" / "runs" / "batch_size=1,x=a b").is_dir()
  beyond = subprocess.run(
      script, env={**env, "SLURM_ARRAY_TASK_ID": "3"}, capture_output=True, text=True, timeout=30
  )
  assert beyond.returncode == 2 and "has 3 runs" in beyond.stderr


@pytest.mark.slow
def test_slurm_array_asks_the_bucket_which_gs_runs_are_done_and_writes_no_local_tree(gcs, tmp_path):
  # Before: --pending looked for a gs:// run's report.json on the local disk, so every
  # resubmission resubmitted every run, and a task made a local gs:/bucket/... tree, then failed
  # on `>> gs://.../log.txt` before its run started.
  from trainkit import storage

  runs = [f"{gcs.uri}/sweep/runs/seed={i}" for i in range(3)]
  storage.write_atomically(f"{runs[1]}/report.json", "{}")
  (tmp_path / "fake_main.py").write_text("import sys\nprint('ran', *sys.argv[1:])\n")
  submit = tmp_path / "submit"
  submit.mkdir()
  commands = submit / "commands.sh"
  commands.write_text(
      "\n".join([f"cd {tmp_path}", *(f"python -m fake_main --workdir={run}" for run in runs)])
  )
  env = {**gcs.env, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}

  def launch(script, *args, **variables):
    return subprocess.run(
        ["bash", str(REPO / "launch" / script), *args, str(commands)],
        cwd=submit, env={**env, **variables}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip

  pending = launch("slurm_array.sh", "--dry-run")
  assert pending.returncode == 0, pending.stderr
  assert pending.stdout.startswith("+ sbatch --array=0,2 ")
  assert f"done, skipped: {runs[1]}" in pending.stderr
  done = launch("slurm_array.sbatch", SLURM_ARRAY_TASK_ID="1")
  assert done.returncode == 0 and "run 1 (?_1): done, skipped" in done.stdout, done.stderr
  ran = launch("slurm_array.sbatch", SLURM_ARRAY_TASK_ID="0")
  assert ran.returncode == 0, ran.stderr
  assert f"ran --workdir={runs[0]}" in ran.stdout  # In the task's SLURM output file.
  assert os.listdir(submit) == ["commands.sh"]  # No gs:/ folder.
  assert gcs.objects() == {"sweep/runs/seed=1/report.json": 2}


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--parallel", "0", "commands.sh"],
        ["--gpus-per-run", "x", "commands.sh"],
        ["--bogus", "commands.sh"],
        ["commands.sh", "other.sh"],
        ["missing.sh"],
    ],
)
def test_slurm_array_bad_args(tmp_path, args):
  (tmp_path / "commands.sh").write_text("cd /\npython -m m --workdir=/w\n")
  result = subprocess.run(
      ["bash", str(REPO / "launch" / "slurm_array.sh"), "--dry-run", *args],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=30,
  )
  assert result.returncode == 2
  assert "usage: " in result.stderr and result.stdout == ""


def test_local_multiprocess_dry_run_prints_every_process(tmp_path):
  env = {"PATH": "/usr/bin:/bin", "PYTHON": "python3"}
  result = _run(
      "local_multiprocess.sh",
      "--dry-run",
      "--processes",
      "2",
      "--port",
      "2222",
      "--",
      "--config=configs/quickstart.py",
      env=env,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == [
      f"+ env JAX_COORDINATOR_ADDRESS=localhost:2222 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID={i} "
      "JAX_PLATFORMS=cpu python3 -m fairmoe_jax.main --config=configs/quickstart.py"
      for i in range(2)
  ]
  result = _run(
      "local_multiprocess.sh", "--dry-run", "--processes", "1", env={**env, "JAX_PLATFORMS": "gpu"}
  )
  assert "JAX_PLATFORMS=gpu python3 -m fairmoe_jax.main\n" in result.stdout


def test_local_multiprocess_prefixes_output_and_stops_on_failure(tmp_path):
  (tmp_path / "fake_main.py").write_text(
      "import os, sys, time\n"
      "i = int(os.environ['JAX_PROCESS_ID'])\n"
      "print('hello from', i, 'of', os.environ['JAX_NUM_PROCESSES'], flush=True)\n"
      "if 'fail' in sys.argv:\n"
      "  sys.exit(3) if i == 1 else time.sleep(60)\n"
  )
  env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
  ok = _run("local_multiprocess.sh", "--processes", "2", "--module", "fake_main", env=env)
  assert ok.returncode == 0, ok.stderr
  assert "[0] hello from 0 of 2" in ok.stdout and "[1] hello from 1 of 2" in ok.stdout
  failed = _run(
      "local_multiprocess.sh", "--processes", "2", "--module", "fake_main", "--", "fail", env=env
  )
  assert failed.returncode == 3
  assert "process 1 exited with status 3" in failed.stderr


@pytest.mark.parametrize(
    "args", [[], ["--processes", "0"], ["--processes", "2", "--port", "99999"], ["--bad"]]
)
def test_local_multiprocess_bad_args(args):
  result = _run("local_multiprocess.sh", "--dry-run", *args)
  assert result.returncode == 2
  assert "usage: " in result.stderr and result.stdout == ""


def test_local_multiprocess_starts_at_most_one_process_per_cpu():
  result = _run("local_multiprocess.sh", "--dry-run", "--processes", str(os.cpu_count() + 1))
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.startswith(
      f"--processes {os.cpu_count() + 1}: at most this machine's {os.cpu_count()} CPUs\n"
  )


# distributed_args


def test_single_process():
  assert distributed_args({}) is None
  assert distributed_args({"HOME": "/root", "JAX_PLATFORMS": "cpu"}) is None
  assert distributed_args({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
  assert distributed_args({"TRAINKIT_DISTRIBUTED": "off"}) is None


def test_explicit_variables():
  env = {
      "JAX_COORDINATOR_ADDRESS": "localhost:1234",
      "JAX_NUM_PROCESSES": "4",
      "JAX_PROCESS_ID": "2",
  }
  assert distributed_args(env) == {
      "coordinator_address": "localhost:1234",
      "num_processes": 4,
      "process_id": 2,
      "cluster_detection_method": "deactivate",
  }


def test_explicit_variables_override_slurm():
  env = {
      "SLURM_NTASKS": "8",
      "SLURM_PROCID": "3",
      "SLURM_JOB_NODELIST": "gpu[01-02]",
      "JAX_COORDINATOR_ADDRESS": "head:999",
      "JAX_PROCESS_ID": "5",
  }
  assert distributed_args(env) == {
      "coordinator_address": "head:999",
      "num_processes": 8,
      "process_id": 5,
      "cluster_detection_method": "deactivate",
  }


def _slurm(**extra):
  return {"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", **extra}


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node[01-03,07]", "node01"),
        ("a1,b2", "a1"),
        ("node7", "node7"),
        ("gpu[008-010]-ib,cpu1", "gpu008-ib"),
        ("rack[2-3]-n[5,1]", "rack2-n5"),
    ],
)
def test_slurm_coordinator_is_the_first_node(nodelist, first):
  args = distributed_args(_slurm(SLURM_JOB_NODELIST=nodelist))
  assert args == {
      "num_processes": 16,
      "process_id": 9,
      "coordinator_address": f"{first}:12345",
      "cluster_detection_method": "deactivate",
  }


def test_slurm_step_nodelist_port_and_local_device():
  env = _slurm(
      SLURM_JOB_NODELIST="job[1-4]",
      SLURM_STEP_NODELIST="step[3-4]",
      JAX_COORDINATOR_PORT="4000",
      SLURM_GPUS_PER_TASK="1",
  )
  args = distributed_args(env)
  assert args["coordinator_address"] == "step3:4000" and args["local_device_ids"] == [1]
  # Slurm bound the task to one GPU: it is JAX's device 0.
  assert distributed_args({**env, "CUDA_VISIBLE_DEVICES": "5"})["local_device_ids"] == [0]
  assert "local_device_ids" not in distributed_args({**env, "SLURM_GPUS_PER_TASK": "2"})


def test_expand_nodelist():
  assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
  assert expand_nodelist("a1,b2") == ["a1", "b2"]
  assert expand_nodelist("n[8-10],x") == ["n8", "n9", "n10", "x"]
  assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]


@pytest.mark.parametrize(
    "env",
    [
        {"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2", "TPU_WORKER_ID": "0"},
        {"CLOUD_TPU_TASK_ID": "1"},
        {"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8080"},
        {"TRAINKIT_DISTRIBUTED": "auto"},
    ],
)
def test_tpu_pod_is_auto_detected_by_jax(env):
  assert distributed_args(env) == {}


@pytest.mark.parametrize(
    "env,variable",
    [
        (
            {"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "JAX_COORDINATOR_ADDRESS",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            "JAX_NUM_PROCESSES",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"},
            "JAX_PROCESS_ID",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            "JAX_PROCESS_ID",
        ),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES"),
        ({"SLURM_NTASKS": "x", "SLURM_PROCID": "0"}, "SLURM_NTASKS"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "4", "SLURM_JOB_NODELIST": "a"}, "SLURM_PROCID"),
        (
            {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-"},
            "SLURM_JOB_NODELIST",
        ),
        (
            {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[3-1]"},
            "SLURM_STEP_NODELIST",
        ),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "SLURM_JOB_NODELIST"),
        (_slurm(SLURM_JOB_NODELIST="a", JAX_COORDINATOR_PORT="http"), "JAX_COORDINATOR_PORT"),
        (
            _slurm(SLURM_JOB_NODELIST="a", SLURM_GPUS_PER_TASK="1", SLURM_LOCALID="?"),
            "SLURM_LOCALID",
        ),
        ({"TRAINKIT_DISTRIBUTED": "maybe"}, "TRAINKIT_DISTRIBUTED"),
    ],
)
def test_malformed_values_name_the_variable(env, variable):
  with pytest.raises(UserError, match=variable):
    distributed_args(env)


def test_a_late_process_is_named_as_the_cause_not_the_checkpoint_directory(tmp_path, monkeypatch):
  # On a busy host Gloo gave up on the first collective after its fixed 30 s, inside Orbax's
  # synchronisation when the checkpointer opened, and the run said "process 0 of 2: cannot open
  # checkpoint directory ...: Gloo context initialization failed".
  import orbax.checkpoint as ocp

  from trainkit import checkpoint
  from trainkit.distributed import STARTUP_TIMEOUT_KEY, describe_failure

  gloo = RuntimeError(
      "INTERNAL: Gloo context initialization failed: [gloo/rendezvous/context.cc:74] Timed out "
      "waiting for peer 1"
  )

  def failing_manager(*args, **kwargs):
    raise gloo

  monkeypatch.setattr(ocp, "CheckpointManager", failing_manager)
  monkeypatch.setattr(checkpoint.jax, "process_count", lambda: 2)
  with pytest.raises(RuntimeError) as raised:
    checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  assert not isinstance(raised.value, UserError)  # Not blamed on the directory.
  monkeypatch.undo()
  message, code, with_traceback = describe_failure(raised.value, "process 0 of 2", "Restart.")
  assert message.startswith(
      "error: process 0 of 2: the processes' CPU collectives could not "
      "connect (INTERNAL: Gloo context initialization failed"
  )
  assert "reached its first collective more than 30 s (Gloo's limit) after this one" in message
  assert STARTUP_TIMEOUT_KEY in message and (code, with_traceback) == (1, False)
  # The wait that keeps the processes together is a config key with a generous default.
  from causal_attn_jax.config import base_config as causal_base
  from fairmoe_jax.config import base_config as fair_base
  from trainkit import config as cfg
  from trainkit.errors import ConfigError

  for base in (fair_base(), causal_base()):
    assert base.distributed.startup_timeout_s == 600 and cfg.startup_timeout_s(base) == 600
    base.distributed.startup_timeout_s = 0.0
    with pytest.raises(ConfigError, match=STARTUP_TIMEOUT_KEY):
      cfg.validate_run(base, num_devices=1)
