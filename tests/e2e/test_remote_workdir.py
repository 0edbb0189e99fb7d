"""A run whose workdir is on an object store (gs://) writes nothing to the local disk.

The runs are started through tests/fake_gcs.py, which serves gs://bucket from a directory of the
test's (the "bucket") for the path library and for Orbax's arrays; each run's working directory
and $TMPDIR are empty directories of their own. A run that used `open`, `os.path.abspath` or
`os.walk` on its workdir would write `<cwd>/gs:/bucket/...` or fail; one that goes through the
path library leaves its files in the bucket, and only there.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import CAUSAL_TINY_ARGS, FAIR_TINY_ARGS, ONE_DEVICE_XLA_FLAGS, REPO_ROOT, SHARED_DATA
from trainkit import storage
from trainkit.errors import USER_ERROR_EXIT_CODE, UserError

CELEBA = SHARED_DATA / "celeba"
NLI = SHARED_DATA / "nli"
FAKE_GCS = REPO_ROOT / "tests" / "fake_gcs.py"
WORKDIR = "gs://bucket/run"

FAIR_ARGS = [f"--config.data.root={CELEBA}", *FAIR_TINY_ARGS, "--config.plots=true"]
CAUSAL_ARGS = CAUSAL_TINY_ARGS


class Places:
  """The bucket's directory, and the run's own (empty) working directory and $TMPDIR."""

  def __init__(self, root):
    self.bucket = root / "bucket_store"
    self.cwd = root / "cwd"
    self.tmp = root / "tmp"
    for directory in (self.bucket, self.cwd, self.tmp):
      directory.mkdir()

  def run(self, module, *args, fake=True, hide_gcsfs=False):
    env = dict(os.environ, XLA_FLAGS=ONE_DEVICE_XLA_FLAGS)  # One device.
    env.update(PYTHONPATH=str(REPO_ROOT), TMPDIR=str(self.tmp), FAKE_GCS_ROOT=str(self.bucket))
    if hide_gcsfs:
      # gcsfs is installed with the test extra: a package of the same name that cannot be
      # imported, first on the path, is what a user without gcsfs has.
      hidden = self.cwd.parent / "without_gcsfs"
      (hidden / "gcsfs").mkdir(parents=True, exist_ok=True)
      (hidden / "gcsfs" / "__init__.py").write_text(
          "raise ImportError(\"No module named 'gcsfs'\", name='gcsfs')\n"
      )
      env["PYTHONPATH"] = os.pathsep.join([str(hidden), str(REPO_ROOT)])
    command = [sys.executable, str(FAKE_GCS), module] if fake else [sys.executable, "-m", module]
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=self.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )

  def stored(self, name):
    """A file of the run, as the bucket holds it."""
    return self.bucket / "bucket" / "run" / name

  def assert_nothing_local(self):
    assert sorted(self.cwd.rglob("*")) == [], "the run wrote into its working directory"
    assert sorted(self.tmp.rglob("*")) == [], "the run wrote into $TMPDIR"
    assert not (REPO_ROOT / "gs:").exists()


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _manifest_matches_bucket(step_dir):
  """Every file of a checkpoint step is in its manifest with the bucket's bytes, and vice versa."""
  entries = json.loads((step_dir / "trainkit_manifest.json").read_text())["files"]
  files = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {
      "trainkit_manifest.json"
  }
  assert set(entries) == files
  for name, entry in entries.items():
    data = (step_dir / name).read_bytes()
    assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, name


@pytest.fixture
def places(tmp_path):
  return Places(tmp_path)


def test_fairmoe_trains_resumes_evaluates_and_predicts_on_gs_with_nothing_local(places):
  if not CELEBA.is_dir():
    pytest.skip("../shared/data/celeba absent")
  config = f"--config={REPO_ROOT / 'configs/celeba.py'}:size=small,epochs=1"
  _ok(places.run("fairmoe_jax.main", config, f"--workdir={WORKDIR}", *FAIR_ARGS))
  places.assert_nothing_local()
  assert (places.stored("checkpoints") / "3" / "commit_success.txt").is_file()
  assert json.loads(places.stored("report.json").read_text())["step"] == 3

  # A second epoch resumes from the bucket's checkpoint (the config change is kept aside).
  config = config.replace("epochs=1", "epochs=2")
  resumed = _ok(places.run("fairmoe_jax.main", config, f"--workdir={WORKDIR}", *FAIR_ARGS))
  assert f"Resumed from the checkpoint at step 3 in {WORKDIR}/checkpoints" in resumed.stdout
  places.assert_nothing_local()
  assert places.stored("config_history/config.1.json").is_file()
  steps = [
      json.loads(line)["step"] for line in places.stored("metrics.jsonl").read_text().splitlines()
  ]
  assert steps == sorted(set(steps)) and steps[-1] == 6, steps
  assert len(list(places.stored("tensorboard").glob("events.out.tfevents.*"))) == 2
  assert all(p.stat().st_size > 0 for p in places.stored("tensorboard").iterdir())
  for step in ("3", "6"):
    _manifest_matches_bucket(places.stored("checkpoints") / step)

  # Eval and predict from the workdir alone (its config.json), on the bucket.
  evaluated = _ok(places.run("fairmoe_jax.main", f"--workdir={WORKDIR}", "--mode=eval"))
  assert f"in {WORKDIR}" in evaluated.stdout
  assert json.loads(places.stored("report.json").read_text())["step"] == 6
  assert json.loads(places.stored("report.step-3.json").read_text())["step"] == 3
  images = sorted((CELEBA / "img_align_celeba").iterdir())[:3]
  listing = places.tmp.parent / "images.txt"  # The inputs are local files, outside the run.
  listing.write_text("".join(f"{p}\n" for p in images))
  predicted = _ok(
      places.run(
          "fairmoe_jax.main",
          f"--workdir={WORKDIR}",
          "--mode=predict",
          f"--config.predict.input={listing}",
      )
  )
  assert f"{WORKDIR}/predict/predictions.csv" in predicted.stdout
  rows = places.stored("predict/predictions.csv").read_text().splitlines()
  assert len(rows) == 1 + len(images)
  places.assert_nothing_local()
  assert not places.stored(".run.lock").exists()
  assert sorted(p.name for p in places.stored("plots").iterdir()) == [
      "expert_activation_moe_block0.png",
      "group_accuracy.png",
      "validation_curves.png",
  ]


def test_causal_tokenizer_and_heatmaps_on_gs_with_nothing_local(places):
  if not NLI.is_dir():
    pytest.skip("../shared/data/nli absent")
  config = f"--config={REPO_ROOT / 'configs/mnli_hans.py'}:size=small,steps=8"
  data = [
      f"--config.data.train_file={NLI / 'mnli_dev_matched.tsv'}",
      f"--config.data.challenge_file={NLI / 'hans_format_sample.txt'}",
  ]
  _ok(places.run("causal_attn_jax.main", config, f"--workdir={WORKDIR}", *CAUSAL_ARGS, *data))
  places.assert_nothing_local()
  # The tokenizer was trained in memory and uploaded: the model and its vocabulary.
  vocabulary = places.stored("spm.vocab").read_text().splitlines()
  assert len(vocabulary) == 200 and vocabulary[0].split("\t")[0] == "<pad>"
  report = json.loads(places.stored("report.json").read_text())
  assert report["plots"] and all(places.stored(p).is_file() for p in report["plots"])
  pairs = places.tmp.parent / "pairs.tsv"
  pairs.write_text("A man is sleeping.\tNobody sleeps.\nTwo dogs run.\tAnimals are outside.\n")
  _ok(
      places.run(
          "causal_attn_jax.main",
          f"--workdir={WORKDIR}",
          "--mode=predict",
          f"--config.predict.input={pairs}",
      )
  )
  assert len(places.stored("predict/predictions.tsv").read_text().splitlines()) == 3
  places.assert_nothing_local()


@pytest.mark.parametrize(
    "workdir, needle",
    [("gs://bucket/run", "pip install gcsfs"), ("s3://bucket/run", "s3:// is not supported")],
)
def test_a_file_system_that_is_not_installed_is_one_error_before_any_write(places, workdir, needle):
  result = places.run(
      "fairmoe_jax.main",
      f"--config={REPO_ROOT / 'configs/quickstart.py'}",
      f"--workdir={workdir}",
      fake=False,
      hide_gcsfs=True,
  )
  assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
  assert workdir in lines[0]
  places.assert_nothing_local()
  assert sorted(places.bucket.rglob("*")) == []


def test_uris_keep_their_scheme_and_local_paths_become_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert storage.scheme("gs://bucket/run") == "gs" and storage.scheme("run/gs://x") is None
  assert storage.resolve("run") == str(tmp_path / "run")
  assert storage.join("gs://bucket/run", "checkpoints", "3") == "gs://bucket/run/checkpoints/3"
  assert storage.relpath("gs://bucket/run/plots/a.png", "gs://bucket/run") == "plots/a.png"
  (tmp_path / "run" / "a" / "b").mkdir(parents=True)
  (tmp_path / "run" / "a" / "b" / "f").write_text("x")
  (tmp_path / "run" / "g").write_text("y")
  assert sorted(storage.walk_files(str(tmp_path / "run"))) == ["a/b/f", "g"]
  assert list(storage.walk_files(str(tmp_path / "absent"))) == []


def test_a_sweep_run_on_gs_is_one_error_pointing_to_commands():
  from paper_runner import sweep

  # --mode=commands and --mode=collect take a gs:// workdir (tests/e2e/test_gcs_server.py).
  with pytest.raises(UserError, match="--mode=run runs the sweep on this machine.*--mode=commands"):
    sweep.execute("configs/sweeps/batch_experts.py", "gs://bucket/sweep")
