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


def test_ci_runs_the_readme_test_command():
  ci_lines = (REPO_ROOT / ".ci/run").read_text().splitlines()
  assert _quickstart_commands()[1] in ci_lines
