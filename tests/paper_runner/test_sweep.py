"""The experiment runner (`paper_runner`) with a stub training module: grid, `@` values, commands,
run/resume, tables and table collectors, plots, errors."""

import csv
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import matplotlib.pyplot as plt
import ml_collections
import numpy as np
import pytest

from conftest import ONE_DEVICE_XLA_FLAGS
from paper_runner import collect, commands, spec
from paper_runner import sweep as sweep_cli
from trainkit import storage
from trainkit.errors import USER_ERROR_EXIT_CODE, UserError

# A stand-in for a package's main: parses the flags, counts its invocations, writes
# metrics.jsonl and a report whose accuracy is a function of the flags; batch_size=13 fails.
STUB = textwrap.dedent("""
    import json, os, sys

    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = flags["workdir"]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "calls.txt"), "a") as f:
      f.write("call\\n")
    config = {k[len("config."):]: v for k, v in flags.items() if k.startswith("config.")}
    batch, experts, seed = int(config["batch_size"]), int(config["moe.num_experts"]), int(config["seed"])
    if batch == 13:
      print("stub: batch_size 13 is unlucky", file=sys.stderr)
      sys.exit(1)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      for i, step in enumerate(range(10, 70, 10)):
        f.write(json.dumps({"step": step, "loss": 1.0 / step,
                            "examples_per_second": batch * (1 + i) + experts + seed}) + "\\n")
    accuracy = batch / 1000 + experts / 100 + seed / 10000
    report = {"accuracy": accuracy, "mf": {"pqd": 0.5 + seed / 100}, "step": 60,
              "flags": config}
    with open(os.path.join(workdir, "report.json"), "w") as f:
      json.dump(report, f)
    """)


def _accuracy(batch, experts, seed):
  return batch / 1000 + experts / 100 + seed / 10000


def _throughput(batch, experts, seed):
  steps = np.arange(10, 70, 10)
  values = batch * (1 + np.arange(len(steps))) + experts + seed
  return float(np.median(values[steps > steps.max() / 2]))


def _sweep(batch_sizes=(16, 32), **extra):
  return ml_collections.ConfigDict(
      dict(
          module="stub_main",
          config="configs/quickstart.py",
          grid=spec.dotted({"batch_size": batch_sizes, "moe.num_experts": (2, 4), "seed": (0, 1)}),
          overrides=spec.dotted({"use_flag": True, "data.name": "synthetic", "lr": 1e-3}),
          metrics=("accuracy", "mf.pqd", "mf.missing"),
          **extra,
      )
  )


@pytest.fixture
def stub_env(tmp_path):
  (tmp_path / "stub_main.py").write_text(STUB)
  return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_grid_points_names_and_order():
  sweep = spec.validate_sweep(_sweep())
  points = spec.grid_points(sweep)
  assert len(points) == 8
  assert points[0] == {"batch_size": 16, "moe.num_experts": 2, "seed": 0}
  assert points[1] == {"batch_size": 16, "moe.num_experts": 2, "seed": 1}
  assert points[-1] == {"batch_size": 32, "moe.num_experts": 4, "seed": 1}
  assert spec.run_name(points[0]) == "batch_size=16,moe.num_experts=2,seed=0"
  assert spec.run_name({"method": "a b/c", "x": (1, 2)}) == "method=a_b_c,x=_1,_2_"


def test_command_formats_values(tmp_path):
  raw = _sweep()
  raw.overrides = spec.dotted({"flag": False, "name": "fair smoe", "lr": 0.0003, "t": (1, 2)})
  sweep = spec.validate_sweep(raw)
  point = {"batch_size": 16, "moe.num_experts": 2, "seed": 0}
  command = spec.run_command(sweep, point, "/w/r")
  assert command == [
      sys.executable,
      "-m",
      "stub_main",
      "--config=configs/quickstart.py",
      "--workdir=/w/r",
      "--config.flag=False",
      "--config.name=fair smoe",
      "--config.lr=0.0003",
      "--config.t=(1, 2)",
      "--config.batch_size=16",
      "--config.moe.num_experts=2",
      "--config.seed=0",
  ]


@pytest.mark.slow
def test_run_collect_resume_and_plots(tmp_path, stub_env, capsys, monkeypatch):
  sweep = spec.validate_sweep(_sweep(batch_sizes=(16, 13, 32)))
  sweep_path = tmp_path / "sweep.py"
  workdir = tmp_path / "sweep"
  monkeypatch.setattr(sweep_cli, "load_sweep", lambda _: sweep)  # No file: this definition.
  # An environment variable of the runs' numerics, which their provenance must name.
  env = {**stub_env, "JAX_DEFAULT_MATMUL_PRECISION": "float32"}
  status = sweep_cli.execute(str(sweep_path), str(workdir), env=env)
  assert status == 1
  out = capsys.readouterr().out
  assert "[1/12] batch_size=16,moe.num_experts=2,seed=0: ok" in out
  assert "[5/12] batch_size=13,moe.num_experts=2,seed=0: failed (exit code 1" in out

  runs = workdir / "runs"
  failed = runs / "batch_size=13,moe.num_experts=2,seed=0"
  error = (failed / "error.txt").read_text()
  assert error.startswith("exit code 1") and "batch_size 13 is unlucky" in error
  assert not (failed / "report.json").exists()
  report = json.loads((runs / "batch_size=16,moe.num_experts=2,seed=0" / "report.json").read_text())
  assert report["flags"]["use_flag"] == "True" and report["flags"]["lr"] == "0.001"
  # Each run's commit and host, for its table's record (the runs' own XLA_FLAGS included).
  started = json.loads(
      (runs / "batch_size=16,moe.num_experts=2,seed=0" / "provenance.json").read_text()
  )
  assert started["commit"] and started["host"]["environment"]["JAX_DEFAULT_MATMUL_PRECISION"] == (
      "float32"
  )

  with open(workdir / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 12
  assert list(rows[0]) == [
      "batch_size",
      "moe.num_experts",
      "seed",
      "status",
      "accuracy",
      "mf.pqd",
      "mf.missing",
      "examples_per_second",
  ]
  markdown = (workdir / "sweep.md").read_text()
  assert str(sweep_path) in markdown.splitlines()[0]
  for row in rows:
    b, e, s = int(row["batch_size"]), int(row["moe.num_experts"]), int(row["seed"])
    if b == 13:
      assert row["status"] == "failed" and row["accuracy"] == "" and row["mf.missing"] == ""
      continue
    assert row["status"] == "ok" and row["mf.missing"] == ""
    assert float(row["accuracy"]) == pytest.approx(_accuracy(b, e, s))
    assert float(row["examples_per_second"]) == pytest.approx(_throughput(b, e, s))
    cells = [f"{v:.4g}" for v in (_accuracy(b, e, s), 0.5 + s / 100, _throughput(b, e, s))]
    line = f"| {b} | {e} | {s} | ok | {cells[0]} | {cells[1]} |  | {cells[2]} |"
    assert line in markdown
  saved = json.loads((workdir / "sweep.json").read_text())
  assert len(saved["rows"]) == 12 and saved["definition"]["module"] == "stub_main"

  plots = sorted(os.listdir(workdir / "plots"))
  assert plots == sorted(
      f"{m}_vs_{k}.png"
      for m in ("accuracy", "mf.pqd", "examples_per_second")
      for k in ("batch_size", "moe.num_experts")
  )

  # Rerun: finished runs are skipped (their stub is not called again), the failed one retried.
  calls = {d.name: (d / "calls.txt").read_text().count("call") for d in runs.iterdir()}
  assert set(calls.values()) == {1}
  assert sweep_cli.execute(str(sweep_path), str(workdir), env=stub_env) == 1
  out = capsys.readouterr().out
  assert out.count("skipped (report.json exists)") == 8
  for d in runs.iterdir():
    expected = 2 if d.name.startswith("batch_size=13") else 1
    assert (d / "calls.txt").read_text().count("call") == expected

  # Dry run prints the commands, runs nothing, then counts the runs and estimates their time.
  assert sweep_cli.execute(str(sweep_path), str(workdir), dry_run=True) == 0
  *lines, count, estimate = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 12 and sum(line.startswith("# skipped") for line in lines) == 8
  assert count == "dry run: 12 run(s) in the sweep, 4 to run, 8 finished (skipped)"
  assert estimate.startswith("estimate: about "), estimate

  # Other settings: the finished runs would be stale, so nothing runs and the error says why.
  changed = spec.validate_sweep(_sweep(batch_sizes=(16, 13, 32)))
  changed.overrides["lr"] = 1e-2
  monkeypatch.setattr(sweep_cli, "load_sweep", lambda _: changed)
  with pytest.raises(UserError, match=r"8 finished run\(s\) .*lr: '0.001' -> '0.01'.*--retrain"):
    sweep_cli.execute(str(sweep_path), str(workdir), env=stub_env)
  assert all((d / "calls.txt").read_text().count("call") <= 2 for d in runs.iterdir())
  # --retrain moves them aside (kept) and runs them with the new settings.
  assert sweep_cli.execute(str(sweep_path), str(workdir), retrain=True, env=stub_env) == 1
  stale = sorted(d.name for d in runs.iterdir() if ".stale-" in d.name)
  assert len(stale) == 8 and stale[0].endswith(".stale-1")
  redone = json.loads((runs / "batch_size=16,moe.num_experts=2,seed=0" / "report.json").read_text())
  assert redone["flags"]["lr"] == "0.01"


def test_at_values_set_config_keys_and_name_the_run():
  raw = _sweep()
  raw.grid = spec.dotted({"method": ("plain", "fair @ fair.alpha=0.5@lr=0.1"), "seed": (0,)})
  raw.overrides = spec.dotted({"use_flag": True, "lr": 1e-3})
  sweep = spec.validate_sweep(raw)
  plain, fair = spec.grid_points(sweep)
  assert fair == {"method": "fair @ fair.alpha=0.5@lr=0.1", "seed": 0}
  assert spec.run_name(fair) == "method=fair_@_fair.alpha=0.5@lr=0.1,seed=0"
  command = spec.run_command(sweep, fair, "/w/r")
  # The value sets its key, its settings follow; an @ setting replaces the override of its key.
  assert command[5:] == [
      "--config.use_flag=True",
      "--config.lr=0.1",
      "--config.method=fair",
      "--config.fair.alpha=0.5",
      "--config.seed=0",
  ]
  assert spec.run_command(sweep, plain, "/w/r")[5:] == [
      "--config.use_flag=True",
      "--config.lr=0.001",
      "--config.method=plain",
      "--config.seed=0",
  ]
  record = spec.run_record(sweep, fair)["settings"]
  assert record == {
      "use_flag": "True",
      "lr": "0.1",
      "method": "fair",
      "fair.alpha": "0.5",
      "seed": "0",
  }


@pytest.mark.parametrize(
    "value, message",
    [
        ("fair@alpha", "'alpha' is not KEY=VALUE"),
        ("fair@=1", "'=1' is not KEY=VALUE"),
        ("fair@a b=1", "'a b=1' is not KEY=VALUE"),
        ("@a=1", "nothing before the first '@'"),
        ("fair@a=1@a=2", "'a' is set twice"),
        ("fair@seed=1", "sets 'seed', a grid key"),
    ],
)
def test_bad_at_values_name_the_grid_key_and_value(value, message):
  raw = _sweep()
  raw.grid = spec.dotted({"method": ("plain", value), "seed": (0,)})
  with pytest.raises(spec.SweepError, match=f"sweep key 'grid.method': value '{value}'.*{message}"):
    spec.validate_sweep(raw)


COLLECTOR = textwrap.dedent("""
    import json, os

    def write(workdir, runs):
      path = os.path.join(workdir, "collected.json")
      with open(path, "w") as f:
        json.dump([dict(name=r.name, point=r.point, status=r.status, report=r.report,
                        error=r.error, run_dir=r.run_dir) for r in runs], f)
      return [path]

    not_callable = 3
    """)


@pytest.mark.slow
def test_spec_tables_collector_gets_the_run_results(tmp_path, stub_env, capsys, monkeypatch):
  (tmp_path / "stub_collector.py").write_text(COLLECTOR)
  monkeypatch.syspath_prepend(str(tmp_path))
  raw = _sweep(batch_sizes=(16, 13), tables=("stub_collector:write",))
  # An @ value through the stub: the key's value and its setting reach the run as flags.
  raw.grid["moe.num_experts"] = ("2@lr=0.5",)
  raw.grid["seed"] = (0,)
  sweep = spec.validate_sweep(raw)
  workdir = tmp_path / "sweep"
  monkeypatch.setattr(sweep_cli, "load_sweep", lambda _: sweep)
  assert sweep_cli.execute("s.py", str(workdir), env=stub_env) == 1
  collected = json.loads((workdir / "collected.json").read_text())
  assert f"Wrote {workdir / 'collected.json'}" in capsys.readouterr().out
  ok, failed = collected
  assert ok["point"] == {"batch_size": 16, "moe.num_experts": "2@lr=0.5", "seed": 0}
  assert ok["name"] == "batch_size=16,moe.num_experts=2@lr=0.5,seed=0"
  assert ok["run_dir"] == str(workdir / "runs" / ok["name"])
  assert ok["status"] == "ok" and ok["error"] is None
  assert ok["report"]["flags"]["moe.num_experts"] == "2" and ok["report"]["flags"]["lr"] == "0.5"
  assert ok["report"]["accuracy"] == pytest.approx(_accuracy(16, 2, 0))
  assert failed["status"] == "failed" and failed["report"] is None
  # error.txt's first line: the exit code and the main's last words.
  assert failed["error"] == "exit code 1: stub: batch_size 13 is unlucky"


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_module_xyz:write", "cannot import 'no_such_module_xyz'"),
        ("os:no_such_function", "'os' has no 'no_such_function'"),
        ("os:sep", "'os:sep' is not callable"),
        ("os.path.join", "'os.path.join' is not 'module:function'"),
        ("os:system", r"'os:system' cannot be called as system\(workdir, results\)"),
    ],
)
def test_bad_table_collectors_are_sweep_errors(name, message):
  with pytest.raises(spec.SweepError, match=f"sweep key 'tables': {message}"):
    spec.validate_sweep(_sweep(tables=(name,)))


def test_a_collector_that_raises_is_one_error_that_keeps_the_runs(tmp_path, monkeypatch):
  from paper_runner import collect

  (tmp_path / "buggy_collector.py").write_text(
      "def write(workdir, results):\n  return sorted(results)[0]['missing']\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  sweep = spec.validate_sweep(_sweep(tables=("buggy_collector:write",)))
  with pytest.raises(spec.SweepError, match="buggy_collector:write failed: .*Error") as e:
    collect.write_spec_tables(sweep, str(tmp_path), [{"a": 1}, {"b": 2}])
  assert "rerun the same sweep command" in str(e.value)


# A run that trains until stopped: it records a SIGTERM (as the mains checkpoint on it) and exits,
# or with `stubborn` ignores it and must be killed.
SLOW_STUB = textwrap.dedent("""
    import os, signal, sys, time

    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = flags["workdir"]
    os.makedirs(workdir, exist_ok=True)

    def on_sigterm(signum, frame):
      open(os.path.join(workdir, "sigterm.txt"), "w").close()
      sys.exit(0)

    if flags["config.mode"] == "stubborn":
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
      signal.signal(signal.SIGTERM, on_sigterm)
    print("training", flush=True)
    with open(os.path.join(workdir, "started.txt"), "w") as f:
      f.write(str(os.getpid()))
    time.sleep(120)
    """)


@pytest.fixture
def slow_env(tmp_path):
  (tmp_path / "slow_main.py").write_text(SLOW_STUB)
  return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _slow_sweep(**extra):
  return dict(
      module="slow_main",
      config="configs/quickstart.py",
      grid=spec.dotted({"mode": ("checkpoint", "stubborn")}),
      **extra,
  )


@pytest.mark.slow
def test_timeouts_terminate_then_kill_and_leave_error_txt(tmp_path, slow_env, monkeypatch, capsys):
  from paper_runner import supervise

  monkeypatch.setattr(supervise, "TERMINATE_GRACE_S", 1)
  sweep = spec.validate_sweep(_slow_sweep(timeout_s=2))
  statuses = supervise.run_sweep(sweep, str(tmp_path / "w"), env=slow_env)
  assert statuses == {"mode=checkpoint": "failed", "mode=stubborn": "failed"}
  runs = tmp_path / "w" / "runs"
  assert (runs / "mode=checkpoint" / "sigterm.txt").exists()  # SIGTERM first: it checkpoints.
  assert not (runs / "mode=stubborn" / "sigterm.txt").exists()
  for name, code in (("mode=checkpoint", 0), ("mode=stubborn", -9)):  # -9: SIGKILL after grace.
    error = (runs / name / "error.txt").read_text()
    assert error.startswith(f"timeout after 2 s (exit code {code})"), error
    assert "training" in error  # The log's tail.
  assert "failed (timeout after 2 s" in capsys.readouterr().out


def _start_slow_sweep(tmp_path, slow_env, repo_root, modes, **popen):
  """Starts a sweep of `slow_main` runs over `modes`; returns the runner and the first run's
  started.txt (it holds the run's pid once the run is training)."""
  sweep_file = tmp_path / "slow_sweep.py"
  sweep_file.write_text(
      "from paper_runner.spec import dotted\n"
      "def get_config(arg=None):\n"
      "  return dict(module='slow_main', config='configs/quickstart.py',\n"
      f"              grid=dotted({{'mode': {tuple(modes)!r}}}))\n"
  )
  workdir = tmp_path / "w"
  runner = subprocess.Popen(
      [sys.executable, "-m", "paper_runner.sweep", f"--sweep={sweep_file}", f"--workdir={workdir}"],
      cwd=repo_root,
      env={**os.environ, **slow_env},
      **popen,
  )
  return runner, workdir / "runs" / f"mode={modes[0]}" / "started.txt"


@pytest.mark.slow
def test_sigterm_to_the_runner_stops_the_running_run(tmp_path, slow_env, repo_root):
  runner, started = _start_slow_sweep(
      tmp_path,
      slow_env,
      repo_root,
      ("checkpoint", "stubborn"),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  workdir = tmp_path / "w"
  deadline = time.monotonic() + 60
  while not started.exists() and time.monotonic() < deadline and runner.poll() is None:
    time.sleep(0.1)
  assert started.exists()
  runner.send_signal(signal.SIGTERM)
  out, _ = runner.communicate(timeout=60)
  assert runner.returncode == 130, out
  assert (started.parent / "sigterm.txt").exists()  # The run was told, and checkpointed.
  assert "interrupted; rerun the same command to resume the sweep" in out
  assert not (workdir / "runs" / "mode=stubborn").exists()  # Nothing more was started.


def _running(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # Not a zombie.
  except FileNotFoundError:
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_dies_with_a_killed_runner(tmp_path, slow_env, repo_root):
  """A SIGKILL to the runner would leave its run (a session of its own) training on; instead it
  gets SIGTERM, so it checkpoints and stops."""
  runner, started = _start_slow_sweep(
      tmp_path,
      slow_env,
      repo_root,
      ("checkpoint",),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )
  deadline = time.monotonic() + 60
  while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
    time.sleep(0.1)
  run_pid = int(started.read_text())
  try:
    runner.kill()
    runner.wait(timeout=10)
    deadline = time.monotonic() + 20
    while _running(run_pid) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not _running(run_pid)
    assert (started.parent / "sigterm.txt").exists()  # SIGTERM: the mains checkpoint on it.
  finally:
    if _running(run_pid):
      os.kill(run_pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_failure_reason_is_the_error_line_not_what_followed_it(tmp_path):
  """A progress line written after the run's error (by a run left over from a killed
  runner, or a background thread) is not the reason: the error or exception line is."""
  from paper_runner import supervise

  progress = "[######..................] 10/40 | 120.5 ex/s | ETA 0m03s | loss 1.2"
  error = "error: the workdir is in use by pid 123 on host h since 12:00"
  traceback = [
      "Traceback (most recent call last):",
      '  File "m.py", line 1, in <module>',
      "    raise ValueError('boom')",
      "ValueError: boom",
  ]
  # Through the runner: error.txt's first line names the exception.
  stub = tmp_path / "failing_main.py"
  lines = [progress, *traceback, progress]
  stub.write_text(
      "import sys\n"
      f"print({chr(10).join(lines[:-1])!r}, file=sys.stderr, flush=True)\n"
      f"print({progress!r}, flush=True)\n"
      "sys.exit(1)\n"
  )
  env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
  sweep = spec.validate_sweep(
      dict(module="failing_main", config="configs/quickstart.py", grid=spec.dotted({"seed": (0,)}))
  )
  assert supervise.run_sweep(sweep, str(tmp_path / "w"), env=env) == {"seed=0": "failed"}
  error_txt = (tmp_path / "w" / "runs" / "seed=0" / "error.txt").read_text()
  assert error_txt.splitlines()[0] == "exit code 1: ValueError: boom"
  # The choice, line by line.
  assert supervise.failure_line(["step", error, progress, progress]) == error
  assert supervise.failure_line([progress, *traceback, progress, ""]) == "ValueError: boom"
  custom = [*traceback[:3], "trainkit.errors.OutOfSpace: the disk is full", progress]
  assert supervise.failure_line(custom) == "trainkit.errors.OutOfSpace: the disk is full"
  assert supervise.failure_line(["loading", progress]) == "loading"
  assert supervise.failure_line([progress]) == ""


def test_commands_mode_with_launcher(tmp_path):
  sweep = spec.validate_sweep(_sweep())
  workdir = tmp_path / "w d"  # A space, so quoting matters.
  launcher = "launch/slurm.sh --nodes 2 --gpus-per-node 8 --"
  path = commands.write_commands(sweep, str(workdir), shlex.split(launcher), "s.py")
  assert path == str(workdir / "commands.sh") and os.access(path, os.X_OK)
  lines = open(path).read().splitlines()
  assert lines[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in lines
  runs = lines[lines.index("set -euo pipefail") + 2 :]
  assert len(runs) == 8
  for line, point in zip(runs, spec.grid_points(sweep)):
    run_dir = workdir / "runs" / spec.run_name(point)
    assert shlex.split(line) == [
        "launch/slurm.sh",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--module",
        "stub_main",
        "--",
        "--config=configs/quickstart.py",
        f"--workdir={run_dir}",
        "--config.use_flag=True",
        "--config.data.name=synthetic",
        "--config.lr=0.001",
        f"--config.batch_size={point['batch_size']}",
        f"--config.moe.num_experts={point['moe.num_experts']}",
        f"--config.seed={point['seed']}",
    ]
  plain = commands.write_commands(sweep, str(workdir))
  first = shlex.split(open(plain).read().splitlines()[-8])
  assert first[:3] == ["python", "-m", "stub_main"]


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"grid": {"batch_size": []}}, "grid.batch_size"),
        ({"grid": {"batch_size": 64}}, "grid.batch_size"),
        ({"grid": {"a": (1, 1)}}, "grid.a"),
        ({"grid": {}}, "grid"),
        ({"module": None}, "module"),
        ({"metrics": "accuracy"}, "metrics"),
        ({"gird": {"a": (1,)}}, "gird"),
        ({"overrides": {"seed": 3}}, "overrides.seed"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"tables": "m:f"}, "tables"),
        ({"row_settings": (("batch_size", 64, "lr=1"),)}, r"row_settings\[0\]"),  # Not a value.
        ({"row_settings": (("batch_size", 16, "seed=1"),)}, r"row_settings\[0\]"),  # A grid key.
        ({"row_settings": (("batch_size", 16, "lr"),)}, r"row_settings\[0\]"),
    ],
)
def test_bad_sweeps_name_the_key(changes, key):
  raw = {**dict(_sweep().items()), **changes}
  if raw["module"] is None:
    del raw["module"]
  with pytest.raises(UserError, match=f"sweep key '{key}'"):
    spec.validate_sweep(raw)


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path, repo_root):
  bad = tmp_path / "bad.py"
  bad.write_text(
      "def get_config(arg=None):\n"
      "  return {'module': 'm', 'config': 'c.py', 'grid': {'batch_size': []}}\n"
  )
  cases = [
      (["--mode=bogus", f"--sweep={bad}"], "--mode: unknown mode 'bogus'"),
      ([f"--sweep={bad}"], "sweep key 'grid.batch_size': must be a non-empty list"),
      ([f"--sweep={tmp_path / 'absent.py'}"], "no such file"),
  ]
  for args, message in cases:
    result = subprocess.run(
        [sys.executable, "-m", "paper_runner.sweep", f"--workdir={tmp_path / 'w'}", *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_shipped_sweeps():
  batch = spec.load_sweep("configs/sweeps/batch_experts.py")
  assert len(spec.grid_points(batch)) == 12
  assert list(batch.grid) == ["batch_size", "moe.num_experts", "method", "seed"]
  assert batch.overrides["optimizer.lr_scaling"] == "sqrt"
  scaling = spec.load_sweep("configs/sweeps/scaling_cpu8.py")
  assert len(spec.grid_points(scaling)) == 8
  assert scaling.overrides["moe.num_experts"] == 8 and scaling.overrides["mesh.data"] == -1
  assert "optimizer.lr_scaling" not in scaling.overrides
  wider = spec.load_sweep("configs/sweeps/batch_experts.py:steps=5,seeds=2")
  assert len(spec.grid_points(wider)) == 24
  assert wider.overrides["num_train_steps"] == 5


def test_the_runner_is_a_typed_package_of_its_own(repo_root):
  setup = (repo_root / "setup.py").read_text()
  assert re.search(r"^CODE_PACKAGES = \[.*\"paper_runner\".*\]$", setup, re.M)
  assert (repo_root / "paper_runner" / "py.typed").is_file()
  assert not (repo_root / "trainkit" / "sweep.py").exists()  # One runner, outside the kit.


def test_sweep_plot_draws_categories_as_points_and_numbers_as_lines():
  """Methods (categories) are points with error bars and nothing joining them, each series moved
  aside so its bars stay visible; a numeric key keeps its lines."""
  from paper_runner import plots

  methods = ("fairsmoe", "vanilla_smoe@moe.top_k=1")
  sweep = spec.validate_sweep(
      ml_collections.ConfigDict(
          dict(
              module="stub_main",
              config="configs/quickstart.py",
              grid=spec.dotted({"method": methods, "batch_size": (16, 64), "seed": (0, 1)}),
              metrics=("accuracy",),
          )
      )
  )
  rows = [
      {"method": m, "batch_size": b, "seed": s, "status": "ok", "accuracy": i / 10 + b / 1000 + s}
      for i, m in enumerate(methods)
      for b in (16, 64)
      for s in (0, 1)
  ]
  ax = plots.sweep_figure(sweep, rows, "accuracy", "method").axes[0]
  # One errorbar per series: its label and its data line (caps and bars are separate artists).
  series = {bars.get_label(): bars.lines[0] for bars in ax.containers}
  assert set(series) == {"batch_size=16", "batch_size=64"}
  assert all(line.get_linestyle() == "None" for line in ax.lines)  # No line anywhere.
  # A value's `@` settings go on lines of their own, keyed by the key's last part.
  assert [t.get_text() for t in ax.get_xticklabels()] == ["fairsmoe", "vanilla_smoe\ntop_k=1"]
  assert plots.tick_label("0.02@constraints.dual_start_step=0@optimizer.lr=0.001") == (
      "0.02\ndual_start_step=0\nlr=0.001"
  )
  x16, y16 = series["batch_size=16"].get_data()
  x64, y64 = series["batch_size=64"].get_data()
  assert list(y16) == pytest.approx([0.516, 0.616]) and list(y64) == pytest.approx([0.564, 0.664])
  # Around their category's position (0, 1), and apart from each other.
  assert all(abs(a - i) < 0.5 and abs(b - i) < 0.5 for i, (a, b) in enumerate(zip(x16, x64)))
  assert all(a < b for a, b in zip(x16, x64))
  ax = plots.sweep_figure(sweep, rows, "accuracy", "batch_size").axes[0]
  series = {bars.get_label(): bars.lines[0] for bars in ax.containers}
  assert set(series) == {f"method={m}" for m in methods}
  for line in series.values():
    assert line.get_linestyle() == "-" and list(line.get_xdata()) == [16, 64]


# Each package's tiny run for a real sweep: the config file the sweep points to (a shipped one,
# with the learning rate set where an edit can change it), then the flags that keep it small.
REAL_RUNS = {
    "fairmoe_jax.main": (
        "configs/quickstart.py",
        "steps=2",
        dict(
            batch_size=32,
            eval_batch_size=64,
            eval_every_steps=0,
            analysis_batches=0,
            plots=False,
            **{
                "data.train_size": 128,
                "data.val_size": 64,
                "data.test_size": 64,
                "model.depth": 1,
                "model.dim": 32,
                "model.num_heads": 2,
                "model.mlp_dim": 64,
            },
        ),
    ),
    "causal_attn_jax.main": (
        "configs/ood_pairs.py",
        "size=small,steps=2,attention=vanilla",
        dict(
            batch_size=16,
            eval_batch_size=32,
            eval_every_steps=0,
            **{
                "model.dim": 16,
                "model.num_layers": 1,
                "model.num_heads": 2,
                "model.mlp_dim": 16,
                "data.max_train_examples": 64,
                "data.max_eval_examples": 32,
                "plots.num_examples": 1,
            },
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("module", list(REAL_RUNS))
def test_an_edited_config_file_makes_finished_runs_stale(module, repo_root, tmp_path, capsys):
  """The flags alone (sweep_run.json) do not see an edit of the config file the
  sweep points to; the run's config.json against the config the same flags give now does."""
  shipped, arg, overrides = REAL_RUNS[module]
  config_file = tmp_path / "base.py"

  def write_config(learning_rate):
    config_file.write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('shipped', {str(repo_root / shipped)!r})\n"
        "_shipped = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_shipped)\n"
        "def get_config(arg=None):\n"
        "  config = _shipped.get_config(arg)\n"
        f"  config.optimizer.learning_rate = {learning_rate!r}\n"
        "  return config\n"
    )

  write_config(0.001)
  sweep = spec.validate_sweep(
      dict(
          module=module,
          config=f"{config_file}:{arg}",
          grid=spec.dotted({"seed": (0,)}),
          overrides=spec.dotted(overrides),
      )
  )
  workdir = tmp_path / "sweep"
  env = {"XLA_FLAGS": ONE_DEVICE_XLA_FLAGS}  # One CPU device, not conftest's eight: faster.
  assert sweep_cli.execute_sweep(sweep, str(workdir), env=env) == 0, capsys.readouterr().out
  run = workdir / "runs" / "seed=0"
  assert json.loads((run / "config.json").read_text())["optimizer"]["learning_rate"] == 0.001
  report = (run / "report.json").stat().st_mtime_ns

  # Nothing changed: the finished run is reused.
  capsys.readouterr()
  assert sweep_cli.execute_sweep(sweep, str(workdir), env=env) == 0
  assert "[1/1] seed=0: skipped (report.json exists)" in capsys.readouterr().out

  # The config file's learning rate changed, the flags did not: stale, and the key is named.
  write_config(0.002)
  with pytest.raises(
      UserError,
      match=r"1 finished run\(s\) .*optimizer\.learning_rate: 0\.001 -> 0\.002.*--retrain",
  ):
    sweep_cli.execute_sweep(sweep, str(workdir), env=env)
  assert (run / "report.json").stat().st_mtime_ns == report
  assert sweep_cli.execute_sweep(sweep, str(workdir), dry_run=True) == 0
  assert "# stale, trained with another config (optimizer.learning_rate" in capsys.readouterr().out
  # A config file that no longer loads is one sweep error naming the run, not a traceback.
  config_file.write_text("def get_config(arg=None):\n  raise ValueError('half-edited')\n")
  with pytest.raises(UserError, match=r"sweep key 'config': .*seed=0.*ValueError: half-edited"):
    sweep_cli.execute_sweep(sweep, str(workdir), env=env)


def test_planted_links_in_a_sweep_workdir_are_replaced_not_written_through(tmp_path):
  sweep = spec.validate_sweep(_sweep(batch_sizes=(16,)))
  workdir = tmp_path / "sweep"
  (workdir / "plots").mkdir(parents=True)
  outside = tmp_path / "outside.txt"
  outside.write_text("precious")
  names = ["sweep.md", "sweep.csv", "sweep.json", "plots/accuracy_vs_seed.png"]
  for name in names:
    (workdir / name).symlink_to(outside)
  collect.write_tables(sweep, str(workdir), [])
  figure = plt.figure()
  storage.save_figure(figure, str(workdir / "plots/accuracy_vs_seed.png"), dpi=10)
  plt.close(figure)
  assert outside.read_text() == "precious"
  for name in names:
    assert not (workdir / name).is_symlink() and (workdir / name).stat().st_size > 0, name


def test_only_keeps_the_named_values_and_the_run_names(tmp_path):
  sweep = spec.validate_sweep(_sweep(batch_sizes=(16, 13, 32)))
  names = {spec.run_name(p) for p in spec.grid_points(sweep)}
  sweep_cli.restrict_grid(sweep, ["batch_size=32", "batch_size=16", "seed=1"])
  kept = spec.grid_points(sweep)
  # The grid's order, not the flags'; the other keys untouched.
  assert [(p["batch_size"], p["seed"]) for p in kept] == [(16, 1), (16, 1), (32, 1), (32, 1)]
  assert {p["moe.num_experts"] for p in kept} == {2, 4}
  # The same run directories as the full sweep's: a later full sweep reuses them.
  assert {spec.run_name(p) for p in kept} <= names


@pytest.mark.parametrize(
    "only, message",
    [
        ("batch_size", "not KEY=VALUE"),
        ("lr=0.1", "'lr' is not a grid key; grid keys: batch_size, moe.num_experts, seed"),
        ("batch_size=64", "'64' is not a value of batch_size; values: 16, 32"),
    ],
)
def test_only_names_an_unknown_key_or_value(only, message):
  sweep = spec.validate_sweep(_sweep())
  with pytest.raises(UserError, match=re.escape(f"--only={only}: {message}")):
    sweep_cli.restrict_grid(sweep, [only])


@pytest.mark.slow
def test_collect_of_a_subset_writes_its_tables_beside_the_full_sweep_s(
    tmp_path, stub_env, monkeypatch, capsys
):
  """`--mode=collect --only=KEY=VALUE` on a finished sweep overwrote its
  sweep.md/.csv/.json (and plots) with the subset's, without a word."""
  # restrict_grid edits the sweep it is given: a fresh one per command, as from the file.
  monkeypatch.setattr(
      sweep_cli, "load_sweep", lambda _: spec.validate_sweep(_sweep(batch_sizes=(16,)))
  )
  workdir = tmp_path / "sweep"
  assert sweep_cli.execute(str(tmp_path / "sweep.py"), str(workdir), env=stub_env) == 0
  names = ("sweep.md", "sweep.csv", "sweep.json")
  full = {name: (workdir / name).read_bytes() for name in names}
  plots = {p: (workdir / "plots" / p).read_bytes() for p in os.listdir(workdir / "plots")}
  capsys.readouterr()
  assert (
      sweep_cli.execute(str(tmp_path / "sweep.py"), str(workdir), mode="collect", only=["seed=0"])
      == 0
  )
  out = capsys.readouterr().out
  assert {name: (workdir / name).read_bytes() for name in names} == full
  assert {p: (workdir / "plots" / p).read_bytes() for p in os.listdir(workdir / "plots")} == plots
  subset = workdir / "only-seed=0"
  assert "2 of 2 runs finished" in (subset / "sweep.md").read_text()
  assert "4 of 4 runs finished" in full["sweep.md"].decode()
  assert f"--only: these are the tables of 2 of the sweep's runs, in {subset}; " in out
  assert "sweep.md, sweep.csv, sweep.json and plots/ are left as they were" in out


def test_collect_tells_running_from_missing_and_refuses_empty_or_non_numeric_reports(
    tmp_path, monkeypatch, capsys
):
  """A run training now was "missing", an empty report.json "ok", and a
  metric "high" was written into sweep.csv."""
  sweep = spec.validate_sweep(_sweep(batch_sizes=(16,)))
  monkeypatch.setattr(sweep_cli, "load_sweep", lambda _: sweep)
  workdir = tmp_path / "sweep"
  running, empty, word, good = [spec.run_dir(str(workdir), p) for p in spec.grid_points(sweep)]
  for directory, report in ((empty, {}), (word, {"accuracy": "high"}), (good, {"accuracy": 0.5})):
    os.makedirs(directory)
    with open(os.path.join(directory, spec.REPORT), "w") as f:
      json.dump(report, f)
  os.makedirs(running)  # An earlier attempt's error; this process holds the lock now.
  with open(os.path.join(running, spec.ERROR), "w") as f:
    f.write("killed\n")
  lock = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
  with open(os.path.join(running, ".run.lock"), "w") as f:
    json.dump(lock, f)
  status = sweep_cli.execute("sweep.py", str(workdir), mode="collect")
  out = capsys.readouterr().out
  rows = {r["run_dir"]: r for r in json.loads((workdir / "sweep.json").read_text())["rows"]}
  assert status == 1
  statuses = [rows[d]["status"] for d in (running, empty, word, good)]
  assert statuses == ["running", "failed", "failed", "ok"]
  assert "high" not in (workdir / "sweep.csv").read_text()
  name = os.path.basename(word)
  assert f"{name}: failed: unreadable {word}/report.json: metric accuracy is 'high'" in out
  assert f"{os.path.basename(running)}: running: training now (pid {os.getpid()}" in out
