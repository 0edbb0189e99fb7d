"""The README's and the reference pages' figures that a record holds agree with that record.

Each FIGURES row is (page, a regex whose one group captures the figure in the page's prose, the
figure as the prose rounds it, computed from the record). The check compares the captured number,
not the sentence: a reworded sentence that keeps its figure needs only its regex updated, and a
figure changed by hand fails. A new figure is one row.
"""

import functools
import json
import re
import sys

import pytest

from conftest import REPO_ROOT

ROOT = REPO_ROOT
README, SCALING, BENCH, MOE = "README.md", "docs/scaling.md", "docs/benchmarks.md", "docs/moe.md"
GIB, MIB = 2**30, 2**20
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_utils import pytest_summary  # pylint: disable=g-import-not-at-top


def _record(path: str) -> dict:
  return json.loads((ROOT / path).read_text())


def _r(x: float, digits: int = 0) -> str:
  """A figure as the prose writes it: rounded, with thousands separated."""
  return f"{x:,.{digits}f}"


def _suite_run(stack: str, tier: str = "full") -> dict:
  """The latest measured run of the test suite for a stack and tier (tests/timings.json): the
  latest date, and of one date the run listed last."""
  runs = _record("tests/timings.json")["runs"]
  matching = [r for r in runs if (r["stack"], r["tier"]) == (stack, tier)]
  return sorted(matching, key=lambda r: r["date"])[-1]


def _minutes_seconds(seconds: float) -> str:
  minutes, rest = divmod(round(seconds), 60)
  return f"{minutes}:{rest:02d}"


FAST, SLOW = _suite_run("pinned", "fast"), _suite_run("pinned", "slow")  # The README's.
CI_RUN = _suite_run("both", "ci")  # `.ci/run`: every tier on both stacks, installs included.

# The first H200 lease: the measured step, and the two compiles the README sets against it.
LEASE_1 = "benchmarks/results/h200_2026-11-27/"
STEP_1 = _record(LEASE_1 + "device.json")["parts"]["train_step"]["measured"]
QUICKSTART_1 = _record(LEASE_1 + "device.json")["parts"]["quickstart"]
PINNED = _record(LEASE_1 + "preflight_h200x1.json")  # Compiled with jax 0.10.2.
NEWER = _record(LEASE_1 + "preflight_h200x1_jax0.11.2.json")
STEP_1_MS = STEP_1["step_seconds"] * 1e3
PINNED_MS, NEWER_MS = PINNED["run"]["step_seconds"] * 1e3, NEWER["run"]["step_seconds"] * 1e3
PINNED_LOW = 1 - PINNED["train_step"]["memory"]["program_peak"] / STEP_1["peak_bytes"]
PINNED_ROOFLINE_SHARE = PINNED["train_step"]["roofline"]["bound_s"] * 1e3 / STEP_1_MS
TEMPORARIES = NEWER["train_step"]["memory"]["temporaries"]
DEVICE_TEMPORARIES = STEP_1["compiled_memory"]["temp_size_in_bytes"]
TEMPORARIES_OFF = 100 * abs(1 - TEMPORARIES / DEVICE_TEMPORARIES)
# The second lease: docs/benchmarks.md's "Accelerator check" and the tests on the GPU.
LEASE_2 = "benchmarks/results/h200_2026-11-28/"
PARTS_2 = _record(LEASE_2 + "device.json")["parts"]
STEP_2, PREDICTED_2, RATIOS_2 = map(PARTS_2["train_step"].get, ("measured", "prediction", "ratios"))
IN_PROCESS, WORKERS = PARTS_2["input_pipeline"]["throughput"]["rows"]
WORKERS_SHARE = WORKERS["images_per_s_per_core"] / IN_PROCESS["images_per_s_per_core"]
FEED = PARTS_2["input_pipeline"]["vs_step"]
FASTEST = PARTS_2["moe_layer"]["layer"]["fastest"]
QUICKSTART_2 = PARTS_2["quickstart"]["device"]
GPU_LOG = (ROOT / LEASE_2 / "gpu_tests.txt").read_text()
GPU_TESTS, GPU_SECONDS = pytest_summary(GPU_LOG), float(re.findall(r" in ([\d.]+)s", GPU_LOG)[-1])
GPU_TEST_FILES = re.findall(r"tests/\S+", PARTS_2["tests"]["device"]["command"])
# docs/scaling.md's paper table is generated from this record; its prose quotes cells of it.
PAPER = _record("results/records/preflight_paper.json")["cells"]
DEIT_S_H100X8 = PAPER["fairsmoe/deit_s@h100x8"]
EXPERT_4 = PAPER["fairsmoe/deit_s@h100x8,expert=4"]["collective_bytes"]
ALL_REDUCE = DEIT_S_H100X8["collective_bytes"]["all-reduce"]
PER_H100 = 256 / DEIT_S_H100X8["step_s"] / DEIT_S_H100X8["devices"]  # images/s
FUSED = _record("benchmarks/results/fused_mlp_in_model.json")["rows"]
BYTES = {
    d: min(r["bytes_accessed"] for r in FUSED if r["dispatch"] == d)
    for d in ("einsum", "einsum_fused")
}

# docs/benchmarks.md's "Fused attention": the h200x1 step compiled before and after.
ATTENTION = "benchmarks/results/fused_attention_2026-12-06/preflight_h200x1_"
STEP_BYTES, STEP_BOUND = {}, {}
for _name in ("before", "no_cudnn", "cudnn_cublas"):
  _step = _record(ATTENTION + _name + ".json")["train_step"]
  STEP_BYTES[_name] = _r(_step["bytes_accessed_per_device"] / 1e9, 2)
  STEP_BOUND[_name] = _r(_step["roofline"]["bound_s"] * 1e3, 2)


def _hours(cell: str) -> str:
  return _r(PAPER[cell]["device_hours"], 1)


def _peak(cell: str) -> str:
  return _r(PAPER[cell]["peak"] / GIB, 1)


def _estimate(name: str, rows: str, line: int) -> str:
  """`tables --estimate=NAME --scale=paper --target=h100x1`'s device-hours on `line` (1: the
  table's runs, 3: with the equal tuning budgets), as docs/reproducing.md pastes it."""
  from paper_runner.paper_scale import paper_estimate  # pylint: disable=g-import-not-at-top

  found = paper_estimate(f"results/{name}.py", rows, "paper", "h100x1")[line]
  return re.search(r"runs, ([\d,]+) device-hours", found).group(1)


FIGURES = [
    # README: the fast tier's time, from tests/timings.json.
    (README, r"fast tier took (\d+:\d\d) on", _minutes_seconds(FAST["wall_seconds"])),
    (README, r"fast tier took \d+:\d\d on (\d+) CPU cores", str(FAST["host_cores"])),
    (README, r"fast tier took [^(]*\(pinned stack, (\d{4}-\d\d-\d\d)", FAST["date"]),
    (README, r"fast tier took [^)]*\): (\d+) passed", str(FAST["passed"])),
    (README, r"slow tier then took (\d+:\d\d)", _minutes_seconds(SLOW["wall_seconds"])),
    (README, r"slow tier then took \d+:\d\d, [^:]*: (\d+) passed", str(SLOW["passed"])),
    (README, r"slow tier then took [^)]*, (\d+) failed", str(SLOW["failed"])),
    (
        README,
        r"`\.ci/run` \(every tier on both stacks[^)]*\) took (\d+:\d\d)",
        _minutes_seconds(CI_RUN["wall_seconds"]),
    ),
    # README: the tests on a lent GPU.
    (README, r"the (\d+) device test files", str(len(GPU_TEST_FILES))),
    (README, r"files gave (\d+) passed", str(GPU_TESTS["passed"])),
    (README, r"gave \d+ passed, (\d+) skipped", str(GPU_TESTS["skipped"])),
    (README, r"skipped, (\d+) failed \(`docs/benchmarks", str(GPU_TESTS["failed"])),
    # README: the papers' tables at their scale (docs/reproducing.md).
    (README, r"35 such runs, about (\d+) H100-hours", _estimate("fair_cv_celeba", "method", 1)),
    (README, r"about (\d+) with equal tuning budgets", _estimate("fair_cv_celeba", "method", 3)),
    (README, r"5 seeds, about (\d+), and", _estimate("mnli_hans", "model.attention", 1)),
    (README, r"and (\d+) with the schedule search", _estimate("mnli_hans", "model.attention", 3)),
    (
        README,
        r"En-De\stranslation, about (\d+), and",
        _estimate("ende_small", "model.attention", 1),
    ),
    (
        README,
        r"En-De\stranslation, about \d+, and (\d+) with",
        _estimate("ende_small", "model.attention", 3),
    ),
    # README: the preflight against a measured H200 step.
    (README, r"against one H200's ([\d.]+) ms step", _r(STEP_1_MS, 2)),
    (README, r"jax 0\.10\.2 was ([\d.]+) ms", _r(PINNED_MS, 2)),
    (README, r"jax 0\.10\.2 was [\d.]+ ms \(([\d.]+)x\)", _r(PINNED_MS / STEP_1_MS, 2)),
    (README, r"program's memory ([\d.]+)% low", _r(100 * PINNED_LOW, 1)),
    (README, r"run's jax 0\.11\.2, ([\d.]+) ms", _r(NEWER_MS, 2)),
    (README, r"jax 0\.11\.2, [\d.]+ ms \(([\d.]+)x\)", _r(NEWER_MS / STEP_1_MS, 2)),
    (README, r"temporaries within ([\d.]+)%", _r(TEMPORARIES_OFF, 1)),
    # docs/scaling.md: the measured step, the jax 0.11.2 compile and the paper table's cells.
    (SCALING, r"on 0\.10\.2, gives ([\d.]+) for FairSMoE DeiT-S", _hours("fairsmoe/deit_s@h100x8")),
    (SCALING, r"estimated at ([\d.]+) chip-hours on `v5e-16`", _hours("fairsmoe/deit_s@v5e-16")),
    (SCALING, r"and ([\d.]+) on `v4-32`, against", _hours("fairsmoe/deit_s@v4-32")),
    (SCALING, r"against ([\d.]+) GPU-hours on `h100x8`", _hours("fairsmoe/deit_s@h100x8")),
    (SCALING, r"bfloat16 took ([\d.]+) ms", _r(STEP_1_MS, 2)),
    (SCALING, r"ms, ([\d.]+)% of its `h200x1` roofline", _r(100 * PINNED_ROOFLINE_SHARE, 1)),
    (SCALING, r"The preflight's time was ([\d.]+)x too long", _r(PINNED_MS / STEP_1_MS, 2)),
    (SCALING, r"gave ([\d.]+) GB, within [\d.]+% of the device's", _r(TEMPORARIES / 1e9, 2)),
    (SCALING, r"GB, within ([\d.]+)% of the device's", _r(TEMPORARIES_OFF, 1)),
    (SCALING, r"compile of the DeiT-S step to ([\d.]+)%", _r(TEMPORARIES_OFF, 1)),
    (SCALING, r"Swin-B on `h100x8` \(([\d.]+) and", _peak("muffin/swin_b@h100x8")),
    (SCALING, r"\([\d.]+ and ([\d.]+) GiB of 59\.3\)", _peak("multifair/swin_b@h100x8")),
    (SCALING, r"GiB of ([\d.]+)\) and Muffin", _r(DEIT_S_H100X8["usable"] / GIB, 1)),
    (SCALING, r"Muffin Swin-B on `v5e-16` \(([\d.]+) of 16 GiB\)", _peak("muffin/swin_b@v5e-16")),
    (SCALING, r"([\d.]+) and [\d.]+ GiB for FairSMoE Swin-S", _peak("fairsmoe/swin_s@h100x1")),
    (SCALING, r"[\d.]+ and ([\d.]+) GiB for FairSMoE Swin-S", _peak("fairsmoe/swin_b@h100x1")),
    (SCALING, r"DeiT-S's peak is ([\d.]+) GiB", _peak("fairsmoe/deit_s@h100x8")),
    (SCALING, r"roofline step ([\d.]+) ms either way", _r(DEIT_S_H100X8["roofline_s"] * 1e3, 1)),
    (SCALING, r"parameter \(([\d.]+) MiB for FairSMoE DeiT-S\)", _r(ALL_REDUCE / MIB, 1)),
    (SCALING, r"capacity buffers \(([\d.]+) MiB", _r(EXPERT_4["all-to-all"] / MIB, 1)),
    (SCALING, r"\(([\d.]+) MiB all-gather", _r(EXPERT_4["all-gather"] / MIB, 1)),
    (SCALING, r"([\d.]+) MiB float32 reduce-scatter", _r(EXPERT_4["reduce-scatter"] / MIB, 1)),
    # docs/benchmarks.md: the second lease's accelerator check and the tests on its GPU.
    (BENCH, r"\| peak memory \(GiB\) \| ([\d.]+) \|", _r(STEP_2["peak_bytes"] / GIB, 2)),
    (BENCH, r"([\d.]+) \(program\)", _r(PREDICTED_2["program_peak_bytes"] / GIB, 2)),
    (BENCH, r"([\d.]+) \(with 2 batches ahead\)", _r(PREDICTED_2["peak_bytes"] / GIB, 2)),
    (BENCH, r"batches ahead\) \| ([\d.]+), ", _r(RATIOS_2["peak_over_program_peak"], 2)),
    (BENCH, r"batches ahead\) \| [\d.]+, ([\d.]+) \|", _r(RATIOS_2["peak_over_fit_peak"], 2)),
    (BENCH, r"\| step time \(ms\) \| ([\d.]+) \(median", _r(STEP_2["step_seconds"] * 1e3, 2)),
    (BENCH, r"\(median of 30\) \| ([\d.]+) at", _r(PREDICTED_2["step_seconds"] * 1e3, 2)),
    (BENCH, r"at (\d+)% of the bound \|", _r(100 * PREDICTED_2["utilization"])),
    (BENCH, r"% of the bound \| ([\d.]+) \|", _r(RATIOS_2["step_over_predicted_step"], 2)),
    (BENCH, r"\| ([\d.]+) \(memory-bound\)", _r(PREDICTED_2["roofline_seconds"] * 1e3, 2)),
    (BENCH, r"\(memory-bound\) \| ([\d.]+) \|", _r(RATIOS_2["step_over_roofline"], 2)),
    (BENCH, r"\| images/s \| ([\d,]+) \|", _r(STEP_2["images_per_s"])),
    (BENCH, r"the step reached ([\d.]+)% of its", _r(100 * RATIOS_2["implied_utilization"], 1)),
    (BENCH, r"Peak memory\*\*: ([\d.]+)x the preflight's", _r(RATIOS_2["peak_over_fit_peak"], 2)),
    (BENCH, r"temporaries are ([\d.]+) GB", _r(TEMPORARIES / 1e9, 2)),
    (BENCH, r"GB, within ([\d.]+)% of the device's own", _r(TEMPORARIES_OFF, 1)),
    (BENCH, r"device's own compile \(([\d.]+) GB\)", _r(DEVICE_TEMPORARIES / 1e9, 2)),
    (BENCH, r"\| 4 \| [\d.]+ ms \| \*\*([\d.]+)\*\*", _r(FASTEST["4"]["ours_ms"], 2)),
    (BENCH, r"\| 64 \| [\d.]+ ms \| \*\*([\d.]+)\*\*", _r(FASTEST["64"]["ours_ms"], 2)),
    (BENCH, r"Input pipeline\*\*: ([\d,]+) images/s", _r(WORKERS["images_per_s"])),
    (BENCH, r"images/s with (\d+) grain workers", str(WORKERS["workers"])),
    (BENCH, r"grain workers \((\d+) per core\)", _r(WORKERS["images_per_s_per_core"])),
    (BENCH, r"against the ([\d,]+) the step consumes", _r(FEED["step_images_per_s"])),
    (BENCH, r"step consumes: ([\d.]+)x", _r(FEED["pipeline_over_step"], 2)),
    (BENCH, r"so about (\d+) of the 16 cores", _r(FEED["cores_to_feed_step"])),
    (BENCH, r"Quickstart\*\* \(float32\): ([\d.]+) s", _r(QUICKSTART_2["wall_seconds"], 1)),
    (BENCH, r"on the GPU, test accuracy ([\d.]+)", _r(QUICKSTART_2["test_accuracy"], 4)),
    (BENCH, r"\(([\d.]+) on the host's CPU", _r(QUICKSTART_1["cpu"]["test_accuracy"], 3)),
    (BENCH, r"\*\*(\d+) passed, \d+ skipped", str(GPU_TESTS["passed"])),
    (BENCH, r"passed, (\d+) skipped, \d+ failed in", str(GPU_TESTS["skipped"])),
    (BENCH, r"skipped, (\d+) failed in \d+ s\*\*", str(GPU_TESTS["failed"])),
    (BENCH, r"failed in (\d+) s\*\*", _r(GPU_SECONDS)),
    (BENCH, r"15 workers: (\d+) images/s per core", _r(WORKERS["images_per_s_per_core"])),
    (BENCH, r"per core against (\d+) in process", _r(IN_PROCESS["images_per_s_per_core"])),
    (BENCH, r"\*\*([\d.]+) of linear\*\*", _r(WORKERS_SHARE, 2)),
    (BENCH, r"deit_s@h100x8`: ([\d.]+) ms per step", _r(DEIT_S_H100X8["step_s"] * 1e3, 1)),
    (BENCH, r"ms per step of 256, ([\d,]+) images/s per H100", _r(PER_H100)),
    (BENCH, r"of the bytes \(([\d.]+)x `einsum`", _r(BYTES["einsum_fused"] / BYTES["einsum"], 3)),
    (BENCH, r"accesses ([\d.]+) GB per step against", STEP_BYTES["cudnn_cublas"]),
    (BENCH, r"GB per step against ([\d.]+) GB before", STEP_BYTES["before"]),
    (BENCH, r"\(roofline ([\d.]+) ms against", STEP_BOUND["cudnn_cublas"]),
    (BENCH, r"\(roofline [\d.]+ ms against ([\d.]+)\)", STEP_BOUND["before"]),
    (BENCH, r"keeps XLA's attention, ([\d.]+) GB", STEP_BYTES["no_cudnn"]),
    # docs/moe.md: the float32 quickstart on the first lease's GPU and its host's CPU.
    (MOE, r"test accuracy was ([\d.]+) on the GPU", _r(QUICKSTART_1["device"]["test_accuracy"], 3)),
    (MOE, r"and ([\d.]+) on its host's CPU", _r(QUICKSTART_1["cpu"]["test_accuracy"], 3)),
]


@functools.cache
def _prose(page: str) -> str:
  return " ".join((ROOT / page).read_text().split())  # A figure may sit across a line break.


@pytest.mark.parametrize(
    "page, pattern, expected", FIGURES, ids=[f"{p}:{e}" for p, _, e in FIGURES]
)
def test_a_quoted_figure_is_its_records(page, pattern, expected):
  found = re.search(pattern, _prose(page))
  assert found, f"{page} no longer matches {pattern!r}: update this row beside the prose"
  assert found.group(1) == expected, f"{page} says {found.group(1)}, its record {expected}"


def test_the_input_pipelines_cores_per_h100_follow_the_paper_tables_step():
  row = r"^\| [^|]*pass[^|]* \| \d+ \| \d+ \| (\d+) \| [\d.]+ MB \| ([\d.]+) \|$"
  rows = re.findall(row, (ROOT / BENCH).read_text(), re.MULTILINE)
  assert len(rows) == 6
  assert [cores for _, cores in rows] == [_r(PER_H100 / int(core), 1) for core, _ in rows]


def test_each_suite_run_records_what_its_figures_need():
  fields = {"date", "stack", "python", "jax", "command", "tier", "wall_seconds", "passed"}
  fields |= {"skipped", "failed", "host_cores"}
  for run in _record("tests/timings.json")["runs"]:
    assert fields <= set(run) <= fields | {"note"}, run
    assert run["tier"] in ("fast", "slow", "full", "ci"), run


@pytest.mark.parametrize("page", ["docs/design.md", BENCH])
def test_the_reference_pages_stay_within_600_lines(page):
  """design.md (the papers' readings, the architecture) and benchmarks.md (the current figures)
  are a reference; dated investigations go to docs/notebook/ (docs/notebook/README.md)."""
  assert len((ROOT / page).read_text().splitlines()) <= 600
