"""No deprecation warning from this project's own code, on whichever stack the tests run.

In-process, conftest.py turns such warnings into errors for the whole suite. The command-line
runs below cover what only runs in a `python -m ...` process: each is started with the same
filter, so a deprecated call anywhere in a training run, its evaluation or its report exits
non-zero with the warning's traceback.
"""

import os
import shutil
import subprocess
import sys

from conftest import CAUSAL_TINY_ARGS, DEPRECATIONS, ONE_DEVICE_XLA_FLAGS, REPO_ROOT, SHARED_DATA
from conftest import STRICT_RUNNER as RUNNER

NLI = SHARED_DATA / "nli"


def _run_strictly(module, *args):
  env = dict(os.environ, XLA_FLAGS=ONE_DEVICE_XLA_FLAGS)  # One device.
  return subprocess.run(
      [sys.executable, "-c", RUNNER, module, *map(str, args)],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _assert_no_deprecation(result):
  assert result.returncode == 0, result.stderr[-3000:]
  own = [
      line
      for line in result.stderr.splitlines()
      if any(category in line for category in DEPRECATIONS)
      and any(
          f"/{package}/" in line
          for package in ("fairmoe_jax", "causal_attn_jax", "trainkit", "paper_runner")
      )
  ]
  assert not own, own


def test_a_fairsmoe_run_trains_evaluates_and_predicts_without_deprecations(
    quickstart_run, tmp_path
):
  # The reduced quickstart, run with RUNNER once for the session (tests/conftest.py).
  _assert_no_deprecation(quickstart_run.result)
  workdir = shutil.copytree(quickstart_run.workdir, tmp_path / "fair")
  # A few of the sample's images (a list file): the whole folder's 3,198 took seconds to decode.
  images = sorted((SHARED_DATA / "celeba" / "img_align_celeba").iterdir())[:4]
  listing = tmp_path / "images.txt"
  listing.write_text("".join(f"{path}\n" for path in images))
  _assert_no_deprecation(
      _run_strictly(
          "fairmoe_jax.main",
          f"--workdir={workdir}",
          "--mode=predict",
          f"--config.predict.input={listing}",
      )
  )


def test_a_causal_run_trains_and_evaluates_without_deprecations(tmp_path):
  _assert_no_deprecation(
      _run_strictly(
          "causal_attn_jax.main",
          f"--config={REPO_ROOT / 'configs/mnli_hans.py'}:size=small,steps=4",
          f"--workdir={tmp_path / 'causal'}",
          *CAUSAL_TINY_ARGS,
          f"--config.data.train_file={NLI / 'mnli_dev_matched.tsv'}",
          f"--config.data.challenge_file={NLI / 'hans_format_sample.txt'}",
      )
  )


def test_the_filter_catches_a_deprecation_in_our_code(tmp_path):
  # The check itself can fail: a deprecated call made from one of our modules stops the run.
  probe = tmp_path / "probe.py"
  probe.write_text(
      "import warnings\n"
      "import trainkit\n"
      "exec(compile('warnings.warn(\"old\", DeprecationWarning)', "
      "trainkit.__file__, 'exec'), {'warnings': warnings, '__name__': 'trainkit'})\n"
  )
  result = subprocess.run(
      [
          sys.executable,
          "-c",
          RUNNER.replace(
              'runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)',
              "runpy.run_path(sys.argv[0], run_name='__main__')",
          ),
          str(probe),
      ],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode != 0 and "DeprecationWarning: old" in result.stderr, result.stderr
