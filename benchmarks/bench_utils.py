"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from trainkit.preflight import analysis


def parser(doc: str, output: str = "") -> argparse.ArgumentParser:
  """A benchmark's command line: `doc` as its help; with `output`, `--output` defaults to
  benchmarks/results/<output>.json."""
  found = argparse.ArgumentParser(
      description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  if output:
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    found.add_argument("--output", default=os.path.join(results, f"{output}.json"))
  return found


def memory_analysis(compiled: Any) -> dict[str, int | None]:
  fields = [f"{k}_size_in_bytes" for k in ("temp", "argument", "output", "alias", "generated_code")]
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    analysis = None
  return {f: (int(getattr(analysis, f)) if analysis is not None else None) for f in fields}


def cost(compiled: Any, key: str) -> float | None:
  """A figure of XLA's cost analysis of a compiled executable ("flops", "bytes accessed")."""
  return (analysis.cost(compiled) or {}).get(key)


def write_results(
    path: str, args: Any, rows: list[dict], targets: list[dict], quiet: bool = False, **extra: Any
) -> None:
  """Writes the rows, the evaluated targets, where they were measured and `extra` as JSON."""
  device = jax.devices()[0]
  record = dict(device=str(device.device_kind), platform=device.platform)
  record.update(num_devices=jax.device_count(), jax=jax.__version__, host=platform.node())
  record.update(date=datetime.date.today().isoformat(), args=vars(args), rows=rows)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(record, targets=targets, **extra), f, indent=2)
  if not quiet:
    print(f"wrote {path}")


def finish(args: Any, rows: list[dict], columns: Sequence, targets: list[dict], how: str) -> None:
  """Prints where and `how` the rows were measured, their table (`markdown_table`'s columns) and
  each target's verdict, then writes the JSON (`write_results`) to `args.output`."""
  device = jax.devices()[0]
  print(f"\ndevice: {device.device_kind} ({device.platform}), JAX {jax.__version__}, {how}")
  print(markdown_table(rows, columns).lstrip() + "\n" * bool(targets))
  for t in targets:
    case = f" ({t['case']})" if "case" in t else ""
    print(f"[{'PASS' if t['passed'] else 'FAIL'}] {t['target']}{case}: {t['detail']}")
  write_results(args.output, args, rows, targets)


def time_interleaved(
    calls: Sequence[Callable[[], Any]], repeats: int
) -> tuple[list[Any], list[list[float]]]:
  """Seconds of each call (to `block_until_ready` on its output), the calls alternated.

  Each call runs once first, as a warm-up whose time is left out (its output is returned); then
  `repeats` rounds run every call once, each round starting one call later, so that a slow phase
  of a shared machine does not fall on one case only and no case always follows the same one
  (e.g. the largest).

  Returns:
    The warm-up outputs, and each call's `repeats` times in seconds.
  """
  warm_up = [jax.block_until_ready(call()) for call in calls]
  times: list[list[float]] = [[] for _ in calls]
  for r in range(repeats):
    for i in [(r + j) % len(calls) for j in range(len(calls))]:
      t0 = time.perf_counter()
      jax.block_until_ready(calls[i]())
      times[i].append(time.perf_counter() - t0)
  return warm_up, times


def ratio(a: float | None, b: float | None) -> float | None:
  """a / b, None where either is missing (or b is 0)."""
  return a / b if a is not None and b else None


def fmt(value: Any, digits: int = 2, scale: float = 1.0) -> str:
  """A figure for a markdown table: `-` for None, ints as they are, floats scaled and rounded."""
  if isinstance(value, (bool, int)) and scale == 1 or not isinstance(value, (int, float)):
    return "-" if value is None else str(value)
  return f"{value * scale:,.{digits}f}" if math.isfinite(value) else "-"


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple]) -> str:
  """`rows` as a markdown table after a blank line ("" without rows), one column per
  (heading, key, digits, scale), digits and scale optional (`fmt`'s)."""
  lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|---" * len(columns) + "|"]
  for row in rows:
    lines.append("| " + " | ".join(fmt(row.get(key), *rest) for _, key, *rest in columns) + " |")
  return "\n\n" + "\n".join(lines) if rows else ""


def run_command(
    command: Sequence[str], env: dict[str, str], timeout: float, cwd: str | None = None
) -> tuple[int | None, str, float]:
  """Runs `command` in a process group of its own, stopped with its children (grain's workers)
  after `timeout` seconds or when this process gets SIGTERM: (exit code, None where stopped;
  its output; seconds)."""
  start = time.perf_counter()
  with tempfile.TemporaryFile("w+", errors="replace") as log:
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
    )
    stop = lambda *_: os.killpg(process.pid, signal.SIGKILL)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    try:
      code = process.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
      code = stop()  # None: stopped.
      process.wait()
    finally:
      signal.signal(signal.SIGTERM, previous)
    log.seek(0)
    return code, log.read(), time.perf_counter() - start


def read_json(path: str) -> dict:
  try:
    return json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError):
    return {}


TEST_COUNTS = ("passed", "failed", "error", "skipped")


def pytest_summary(output: str) -> dict:
  """pytest -q's counts and FAILED/ERROR lines; where it was stopped before its last line, how
  many tests had run, and failed, by its progress lines; {} if neither is there."""
  if last := re.findall(r"^=* ?(\d+ \w+.* in [\d.]+s)", output, re.M):
    found = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last[-1])}
    counts = {k.replace("error", "errors"): found.get(k, 0) for k in TEST_COUNTS}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.{0,240}))?", output, re.M)
    failures = [{"test": test, "message": message} for test, message in failures]
    return dict(counts, tests=sum(counts.values()), failures=failures)
  marks = "".join(re.findall(r"^([.sxXFE]+)(?: +\[ *\d+%\])?$", output, re.M))
  failed = marks.count("F") + marks.count("E")
  return {"ran_before_stop": len(marks), "failed_before_stop": failed} if marks else {}
