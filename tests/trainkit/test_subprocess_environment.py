"""Processes that start others after touching JAX hand on a clean environment: libtpu's placeholders never make a child a TPU pod worker.

libtpu, loaded by JAX's backend initialisation wherever it is importable (jax[tpu] on a TPU VM),
sets TPU_WORKER_ID, CLOUD_TPU_TASK_ID and CLOUD_TPU_ACCELERATOR_TYPE to "WARNING: could not
determine ..." with setenv. A training subprocess that inherited them took itself for a Cloud TPU
pod worker and failed in `jax.distributed.initialize` ("coordinator_address should be defined").
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from trainkit.distributed import child_environment, distributed_args, is_libtpu_placeholder

# What libtpu 0.0.42 writes, verbatim.
WORKER = (
    "WARNING: could not determine TPU worker number, please set env var `TPU_WORKER_ID` "
    "manually, otherwise libtpu.so may not properly initialize."
)
ACCELERATOR = (
    "WARNING: could not determine TPU accelerator type, please set env var `TPU_ACCELERATOR_TYPE` "
    "manually, otherwise libtpu.so may not properly initialize."
)
LEAKED = {
    "TPU_WORKER_ID": WORKER,
    "CLOUD_TPU_TASK_ID": WORKER,
    "CLOUD_TPU_ACCELERATOR_TYPE": ACCELERATOR,
}


def test_libtpu_s_placeholders_are_not_a_tpu_pod():
  assert is_libtpu_placeholder(WORKER) and not is_libtpu_placeholder("3")
  assert distributed_args(LEAKED) is None
  assert distributed_args({**LEAKED, "HOME": "/root"}) is None
  # A real value beside them still is a pod; our explicit variables still win.
  assert distributed_args({**LEAKED, "CLOUD_TPU_TASK_ID": "1"}) == {}
  explicit = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
  assert distributed_args({**LEAKED, **explicit})["process_id"] == 1
  # The environment handed to a child leaves them out, keeps the rest, and adds what is asked.
  clean = child_environment({"PYTHONUNBUFFERED": "1"}, env={**LEAKED, "HOME": "/root"})
  assert clean == {"HOME": "/root", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs libtpu (python -m trainkit.preflight.compilers)",
)
def test_a_reproduction_started_after_jax_loaded_libtpu_trains_as_one_process(tmp_path, repo_root):
  # What `python -m paper_runner.tables --reproduce=NAME` does, with JAX_PLATFORMS unset as a
  # user runs it: the parent's machine() loads libtpu before it starts the run. A tiny spec and a record of
  # its first run (the values do not matter: the run must train and report, not match).
  results = tmp_path / "results"
  (results / "records").mkdir(parents=True)
  tiny = {
      "num_train_steps": 2,
      "eval_every_steps": 0,
      "data.train_size": 64,
      "data.val_size": 32,
      "data.test_size": 32,
      "model.dim": 16,
      "model.depth": 1,
      "model.num_heads": 2,
      "model.mlp_dim": 16,
      "batch_size": 16,
      "eval_batch_size": 32,
      "fair.review_every_steps": 0,
  }
  (results / "tiny.py").write_text(
      "from paper_runner.spec import dotted\n"
      "TABLE = dict(rows='method', columns=(('accuracy', 'Acc.', 1.0, 3),), claims=())\n"
      "def get_config(arg=None):\n"
      "  return dict(module='fairmoe_jax.main', config='configs/quickstart.py',\n"
      "              grid=dotted({'seed': (0,), 'method': ('vanilla_smoe_psi',)}),\n"
      f"              overrides=dotted({tiny!r}))\n"
  )
  record = {
      "runs": [
          {"row": "vanilla_smoe_psi", "seed": 0, "status": "ok", "metrics": {"accuracy": 0.5}}
      ],
      "provenance": {"machine": {}, "data": {}},
  }
  (results / "records" / "tiny.json").write_text(json.dumps(record))
  script = textwrap.dedent(f"""
      import os, sys
      from trainkit.preflight import compilers
      compilers.add_to_path()  # libtpu importable here, as where jax[tpu] is installed.
      from paper_runner import table_reproduce, table_spec
      table_spec.RESULTS_DIR = {str(results)!r}
      table_spec.RECORDS_DIR = {str(results / "records")!r}
      import json
      with open({str(results / "records" / "tiny.json")!r}) as f:
        record = json.load(f)
      try:
        ok, lines = table_reproduce.reproduce(table_spec.load_table("tiny"), record, {str(tmp_path / "again")!r})
        print(*lines, sep=chr(10))
      except Exception as e:  # The verdict does not matter here, only that the run trained.
        print("reproduce:", e)
      # Evidence that libtpu did set its placeholders in this process (else the test proves
      # nothing here): the C library's environment, which os.environ does not see.
      import ctypes
      libc = ctypes.CDLL(None)
      libc.getenv.restype = ctypes.c_char_p
      print("leaked:", libc.getenv(b"TPU_WORKER_ID"))
  """)
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  result = subprocess.run(
      [sys.executable, "-c", script],
      cwd=repo_root,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  output = result.stdout + result.stderr
  assert "leaked: b'WARNING: could not determine" in result.stdout, output
  # The rerun's log (where the reproduction keeps it: the run's folder, or beside it).
  log = "".join(p.read_text() for p in sorted((tmp_path / "again").rglob("log.txt")))
  assert log and "coordinator_address" not in log, log + output
  assert (tmp_path / "again" / "run" / "report.json").is_file(), log + output
