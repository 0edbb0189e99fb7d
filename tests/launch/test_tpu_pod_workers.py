"""launch/tpu_pod.sh against a pod this machine plays: a fake `gcloud` copies and runs what the
script sends to the workers, in a home folder of their own, with the TPU image's tools."""

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT

GCLOUD = """#!/bin/bash
echo "gcloud $*" >>"$POD/gcloud.log"
case "$1 $4" in
  "compute scp") cp "$5" "$POD/home/${6#*:}" ;;
  "compute ssh")
    for arg; do [[ $arg != --command=* ]] || command=${arg#--command=}; done
    cd "$POD/home" && HOME="$POD/home" PATH="$POD/image:$POD/system" bash -c "$command" ;;
  "storage "*) exit 1 ;;
esac
"""
# The image's own Python, tpu-ubuntu2204-base's: too old for the package.
IMAGE_PYTHON3 = """#!/bin/bash
if [[ $1 == --version ]]; then echo "Python 3.10.12" && exit 0; fi
exit 1
"""
SUDO = '#!/bin/bash\nexec env "$@"\n'
APT_GET = """#!/bin/bash
echo "apt-get $*" >>"$POD/apt.log"
if [[ $1 == install ]]; then cp "$POD/packages/python3.11" "$POD/image/"; fi
"""
# Ubuntu's python3.11: it passes the version check and makes a venv of VENV_PYTHON3 and a pip.
PYTHON311 = """#!/bin/bash
if [[ $1 == -c ]]; then exit 0; fi
[[ "$*" == "-m venv --clear .venv" ]] || exit 3
mkdir -p .venv/bin
cp "$POD/packages/python3.11" .venv/bin/python3.11
cp "$POD/packages/venv_python3" .venv/bin/python3
printf '#!/bin/bash\\necho "pip $*" >>"$POD/pip.log"\\n' >.venv/bin/pip
chmod +x .venv/bin/*
echo "export PATH=\\"$PWD/.venv/bin:\\$PATH\\"" >.venv/bin/activate
"""
# The venv's python3: a main that resumes its --workdir when a checkpoint is there.
VENV_PYTHON3 = """#!/bin/bash
if [[ $1 == -c ]]; then exit 0; fi
for arg; do [[ $arg != --workdir=* ]] || workdir=${arg#--workdir=}; done
if [[ -f $workdir/checkpoint ]]; then echo "resumed from $workdir/checkpoint"; exit 0; fi
mkdir -p "$workdir" && touch "$workdir/checkpoint" && echo "started afresh in $workdir"
"""


@pytest.fixture
def workstation(tmp_path: Path) -> Path:
  """The pod's folder, with bin/gcloud (which logs its commands to gcloud.log) only."""
  (tmp_path / "pod/bin").mkdir(parents=True)
  (tmp_path / "pod/bin/gcloud").write_text(GCLOUD)
  (tmp_path / "pod/bin/gcloud").chmod(0o755)
  return tmp_path / "pod"


@pytest.fixture
def pod(workstation: Path) -> Path:
  """The pod's folder: bin/gcloud for the workstation; home/, the worker's; image/ and system/,
  its PATH: /usr/bin's and /bin's tools but no Python other than the image's python3, and sudo
  and an apt-get that installs packages/python3.11."""
  pod = workstation
  stubs = {
      "image/python3": IMAGE_PYTHON3,
      "image/sudo": SUDO,
      "image/apt-get": APT_GET,
      "packages/python3.11": PYTHON311,
      "packages/venv_python3": VENV_PYTHON3,
  }
  for name, text in stubs.items():
    (pod / name).parent.mkdir(parents=True, exist_ok=True)
    (pod / name).write_text(text)
    (pod / name).chmod(0o755)
  (pod / "home").mkdir()
  (pod / "system").mkdir()
  for folder in ("/bin", "/usr/bin"):
    for tool in os.listdir(folder):
      link = pod / "system" / tool
      if not tool.startswith(("python", "pip")) and not link.exists():
        link.symlink_to(os.path.join(folder, tool))
  return pod


def _tpu_pod(pod: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
  name = f"pod-{os.getpid()}-{pod.parent.name}"
  env = {"PATH": f"{pod}/bin:/usr/bin:/bin", "POD": str(pod), "HOME": str(pod.parent)}
  try:
    return subprocess.run(
        ["bash", str(REPO_ROOT / "launch" / "tpu_pod.sh"), "--name", name, *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
  finally:
    Path(f"/tmp/{name}-repo.tar.gz").unlink(missing_ok=True)


def test_a_rerun_on_the_same_slice_resumes_a_relative_workdir_with_python_3_11(pod):
  # Before: each launch began with `rm -rf fairmoe`, the folder that holds a relative workdir,
  # so the rerun after a preemption started afresh; and it ran the image's Python 3.10.
  args = ("--zone", "z", "--accelerator", "v4-8", "--no-create", "--")
  args += ("--config=configs/quickstart.py", "--workdir=runs/a")
  first = _tpu_pod(pod, *args)
  assert first.returncode == 0, first.stderr
  assert "started afresh in runs/a" in first.stdout
  assert ": python3 is Python 3.10.12, the package needs 3.11 or newer: installing " in first.stderr
  assert (pod / "home/fairmoe/runs/a/checkpoint").is_file()
  rerun = _tpu_pod(pod, *args)
  assert rerun.returncode == 0, rerun.stderr
  assert "resumed from runs/a/checkpoint" in rerun.stdout
  # python3.11 was installed once, from Ubuntu's packages; the venv is kept for the rerun.
  assert (pod / "apt.log").read_text().splitlines() == [
      "apt-get update -qq",
      "apt-get install -y -qq -o DPkg::Lock::Timeout=600 python3.11 python3.11-venv",
  ]
  assert (pod / "pip.log").read_text().splitlines() == ["pip install -q -e . jax[tpu] gcsfs"] * 2
  assert (pod / "home/fairmoe/launch/tpu_pod.sh").is_file()  # The copy of this repository.


@pytest.mark.parametrize(
    "args, commands",
    [
        (["--", "--config=configs/quickstart.py", "--workdir=/tmp/run"], ""),
        (["--", "--workdir", "runs/a"], ""),
        (["--", "--config=configs/quickstart.py"], ""),
        (
            ["--commands", "-"],
            "python -m fairmoe_jax.main '--workdir=gs://b/runs/0'\n"
            "python -m fairmoe_jax.main '--workdir=/shared/runs/1'\n",
        ),
    ],
)
def test_delete_after_refuses_a_workdir_the_slice_takes_with_it(workstation, args, commands):
  # Before: accepted; each host wrote its part of the checkpoint to its own disk, then the slice
  # was deleted with everything on it.
  base = ["--zone", "z", "--accelerator", "v5litepod-16", "--delete-after"]
  result = _tpu_pod(workstation, *base, *args, stdin=commands)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.startswith("--delete-after deletes the slice with its disks, so the ")
  assert not (workstation / "gcloud.log").exists()  # Nothing was created, copied or deleted.
