"""The README's two set-up commands are the ones the project actually runs."""

import re

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
  assert 'pip install -e ".[test,preflight]"' in commands[1] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_on_both_stacks():
  ci_lines = (REPO_ROOT / ".ci/run").read_text().splitlines()
  command = _quickstart_commands()[1]
  # The newest stack: the README's command verbatim (with python3 being Python 3.13).
  assert command in ci_lines
  # The pinned stack: the same command with every package pinned by constraints.txt.
  install, tests = command.split(" && pytest ")
  assert f"{install} -c constraints.txt && pytest {tests}" in ci_lines
  assert ci_lines.index(f"{install} -c constraints.txt && pytest {tests}") < ci_lines.index(command)


def test_readme_names_the_tested_versions():
  readme = (REPO_ROOT / "README.md").read_text()
  section = readme.split("### Tested versions", 1)[1].split("\n#", 1)[0]
  pins = dict(
      line.split("==") for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
      if "==" in line and not line.startswith("#")
  )
  for package in ("jax", "jaxlib", "flax", "orbax-checkpoint", "grain", "optax", "numpy"):
    assert f"{package} {pins[package]}" in section, package
  assert "Python 3.11" in section and "Python 3.13" in section
