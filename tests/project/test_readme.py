"""The README's two set-up commands are the ones the project actually runs, and its journeys work."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


def _quickstart_commands() -> list[str]:
  readme = (REPO_ROOT / "README.md").read_text()
  section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
  return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_commands():
  commands = _quickstart_commands()
  assert len(commands) == 2
  assert "python -m fairmoe_jax.main --config=configs/quickstart.py --workdir=" in commands[0]
  assert 'pip install -e ".[test]" && python -m trainkit.preflight.compilers && ' in commands[1]
  assert "pytest" in commands[1]
  # The quickstart trains where the tests' extras and the preflight's compilers are not.
  venvs = [re.search(r"python3 -m venv (\S+) && \. \1/bin/activate && ", c) for c in commands]
  assert all(venvs) and venvs[0][1] != venvs[1][1], commands
  assert "preflight" not in commands[0]


def test_ci_runs_the_readme_test_command_on_both_stacks():
  """.ci/run runs the README's command in two parts per stack, its install (both at once) and
  then its tiers: the pinned stack's first, every package pinned by constraints.txt (the compilers
  follow the pinned jax); then the newest stack's, as written, in a venv of its own."""
  ci_lines = [line.strip() for line in (REPO_ROOT / ".ci/run").read_text().splitlines()]
  command = _quickstart_commands()[1]
  install, tiers = command.split(" && pytest ", 1)
  tiers = f"pytest {tiers}"
  venv = re.match(r"python3 -m venv (\S+) && ", install)[1]
  pip = 'pip install -e ".[test]"'
  pinned = [install.replace(pip, f"{pip} -c constraints.txt"), f". {venv}/bin/activate && {tiers}"]
  newest = [install.replace(venv, ".venv-newest"), f". .venv-newest/bin/activate && {tiers}"]
  for line in pinned + newest:
    assert line in ci_lines, line
  assert ci_lines.index(pinned[1]) < ci_lines.index(newest[1])


def test_the_readme_runs_the_fast_tier_first_then_the_slow_one():
  """A newcomer's first answer comes from the fast tier (README: its time); every test runs."""
  runs = _quickstart_commands()[1].split(" && pytest ")[1:]
  assert runs == ['-q -n 2 -m "not slow" tests', "-q -n 2 -m slow tests"]


def test_readme_names_the_tested_versions():
  readme = (REPO_ROOT / "README.md").read_text()
  section = readme.split("### Tested versions", 1)[1].split("\n#", 1)[0]
  pins = dict(
      line.split("==")
      for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
      if "==" in line and not line.startswith("#")
  )
  for package in ("jax", "jaxlib", "flax", "orbax-checkpoint", "grain", "optax", "numpy"):
    assert f"{package} {pins[package]}" in section, package
  assert "Python 3.11" in section and "Python 3.13" in section


def _journey_blocks(language: str) -> list[str]:
  readme = (REPO_ROOT / "README.md").read_text()
  section = readme.split("\n## Three journeys\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env, **kwargs)


def test_readme_is_a_front_door_with_three_journeys():
  readme = (REPO_ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 200
  assert len(_journey_blocks("bash")) == 4 and len(_journey_blocks("python")) == 1
  # Every page the README sends a reader to exists.
  for page in set(re.findall(r"`(docs/[\w./]+\.md)`", readme)):
    assert (REPO_ROOT / page).is_file(), page


@pytest.mark.slow
def test_first_journey_commands_parse_up_to_the_missing_data(tmp_path):
  # The CelebA command and the TPU slice's: every flag and config key is accepted; on this
  # machine the run stops at the data directory the reader must provide (one line, exit 2).
  main, launchers, short = _journey_blocks("bash")[:3]
  main, short = shlex.split(main), shlex.split(short)
  slurm, pod = (shlex.split(line) for line in launchers.strip().splitlines())
  assert main[:3] == ["python", "-m", "fairmoe_jax.main"]
  main = [sys.executable, *main[1:-1], f"--workdir={tmp_path / 'run'}"]
  result = _run(main)
  assert result.returncode == 2, result.stderr
  error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(error) == 1 and "'data.root'" in error[0] and "/data/celeba" in error[0]
  assert not (tmp_path / "run").exists()
  # The pod launcher as a dry run: the main's flags reach every worker unchanged.
  assert pod[0] == "launch/tpu_pod.sh"
  result = _run(["bash", pod[0], "--dry-run", *pod[1:]])
  assert result.returncode == 0, result.stderr
  flags = " ".join(pod[pod.index("--") + 1 :])
  assert f"python3 -m fairmoe_jax.main {flags}" in result.stdout + result.stderr
  # The SLURM launcher as a dry run: one task per GPU, each running the same flags.
  assert slurm[0] == "launch/slurm.sh"
  result = _run(["bash", slurm[0], "--dry-run", *slurm[1:]])
  assert result.returncode == 0, result.stderr
  assert "--nodes=2" in result.stdout and "--ntasks-per-node=8" in result.stdout
  assert " ".join(slurm[slurm.index("--") + 1 :]) in result.stdout
  # The short run is the CelebA config at the size the CPU tests train (tests/fairmoe_jax/test_celeba.py).
  assert short[:3] == ["python", "-m", "fairmoe_jax.main"]
  assert "--config=configs/celeba.py:size=small,epochs=1" in short
  assert "--config.data.root=../shared/data/celeba" in short


@pytest.mark.slow
def test_second_journey_writes_the_sweep_and_submits_it_as_one_array(tmp_path):
  sweep, submit = (shlex.split(c) for c in _journey_blocks("bash")[3].strip().split(" && "))
  workdir = tmp_path / "sweep"
  sweep = [sys.executable, *sweep[1:]]
  sweep = [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in sweep]
  result = _run(sweep)
  assert result.returncode == 0, result.stderr
  commands = (workdir / "commands.sh").read_text().splitlines()
  runs = [c for c in commands if c.startswith("python -m fairmoe_jax.main")]
  assert len(runs) == 12  # 2 methods x 3 batch sizes x 2 expert counts
  assert submit[0] == "launch/slurm_array.sh" and submit[-1] == "/shared/sweep/commands.sh"
  result = _run(["bash", submit[0], "--dry-run", *submit[1:-1], str(workdir / "commands.sh")])
  assert result.returncode == 0, result.stderr
  assert "--array=0-11%8" in result.stdout or "--array=0,1,2,3,4,5,6,7,8,9,10,11%8" in result.stdout


def test_third_journey_runs_the_moe_layer_as_written(capsys):
  (block,) = _journey_blocks("python")
  exec(compile(block, "README.md, the MoE layer in your own Flax model", "exec"), {})
  out = capsys.readouterr().out
  assert out.startswith("(2, 5, 16) aux loss ") and "fraction_dropped" in out
