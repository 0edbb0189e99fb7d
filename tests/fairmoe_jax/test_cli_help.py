"""The command line as a user meets it: --help, misspelt keys, JAX flags, exit codes, data.root."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from ml_collections.config_flags import config_path

from conftest import ONE_DEVICE_XLA_FLAGS
from fairmoe_jax.config import base_config
from trainkit import cli
from trainkit.errors import USER_ERROR_EXIT_CODE
from trainkit.preflight.targets import TARGETS

LAUNCH_SCRIPTS = [
    "local.sh",
    "local_multiprocess.sh",
    "slurm.sh",
    "tpu_pod.sh",
    "slurm_gpu.sbatch",
    "slurm_array.sh",
    "slurm_array.sbatch",
    "testing/local_slurm.sh",
]


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = ONE_DEVICE_XLA_FLAGS  # One CPU device, as on a user's laptop.
  return env


def _python(repo_root, *args):
  return subprocess.run(
      [sys.executable, *args],
      cwd=repo_root,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    "package, help_flag, own_configs, other_configs",
    [
        ("fairmoe_jax", "--help", ["configs/celeba.py", "configs/quickstart.py"], ["snli"]),
        ("causal_attn_jax", "-h", ["configs/snli.py", "configs/mnli_hans.py"], ["celeba"]),
    ],
)
def test_help_shows_the_flags_the_config_keys_and_examples(
    repo_root, package, help_flag, own_configs, other_configs
):
  result = _python(repo_root, "-m", f"{package}.main", help_flag)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert out.startswith(f"usage: python -m {package}.main --config=FILE")
  # Training needs a config file; the other modes can read the trained workdir's config.json.
  assert re.search(
      r"^  --config: \(required for --mode=train and --mode=compile\) Config file", out, re.M
  )
  assert re.search(r"^  --workdir: \(required\) Directory for", out, re.M)
  modes = (
      r"train\|eval\|predict\|export\|compile"
      if package == "fairmoe_jax"
      else r"train\|eval\|predict\|compile"
  )
  assert re.search(rf"^  --mode: <{modes}>: train: .*\(default: 'train'\)", out, re.M | re.S)
  assert f"{package}/config.py (base_config) holds every key" in " ".join(out.split())
  for name in own_configs:
    assert re.search(rf"^    {re.escape(name)}: \S", out, re.M)
  assert not any(f"configs/{name}" in out for name in other_configs)
  # The module docstring's example commands.
  assert f"  python -m {package}.main --config=configs/" in out
  assert "--jax_debug_nans" in out and "--helpfull" in out and "--verbosity" in out
  # Not absl's: no library's flags, and not the hint absl prints instead of them.
  assert "--grain_" not in out and "Try --helpfull" not in out
  # Every preflight target by name, the README's h200x1 among them.
  targets = " ".join(out.split()).split("GPU node: ", 1)[1].split(")", 1)[0].split(", ")
  assert targets == list(TARGETS) and "h200x1" in targets


@pytest.mark.slow
def test_helpfull_lists_every_flag_and_exits_0(repo_root):
  result = _python(repo_root, "-m", "fairmoe_jax.main", "--helpfull")
  assert result.returncode == 0, result.stderr
  for flag in ("--config", "--workdir", "--[no]jax_debug_nans", "--verbosity", "--grain_"):
    assert flag in result.stdout


@pytest.mark.slow
def test_misspelt_config_key_is_one_clean_line(repo_root, tmp_path):
  # One process for how the command ends; test_every_kind_of_unknown_key_is_named has the cases.
  result = _python(
      repo_root,
      "-m",
      "fairmoe_jax.main",
      "--config=configs/quickstart.py",
      f"--workdir={tmp_path / 'run'}",
      "--config.batch_sise=3",
  )
  assert result.returncode == USER_ERROR_EXIT_CODE
  message = "unknown config key 'batch_sise' in --config.batch_sise=3. Did you mean \"batch_size\"?"
  assert result.stderr.splitlines() == [f"error: {message}"]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--config.optimizer.learning_rat=1",
            "unknown config key 'optimizer.learning_rat' in --config.optimizer.learning_rat=1. "
            'Did you mean "optimizer.learning_rate"?',
        ),
        (
            "--config.optimizr.learning_rate=1",
            "unknown config key 'optimizr' in --config.optimizr.learning_rate=1. "
            'Did you mean "optimizer"?',
        ),
        ("--config.zzzzz=1", "unknown config key 'zzzzz' in --config.zzzzz=1"),
        (
            "--config.batch_size.foo=1",
            "unknown config key 'batch_size.foo' in --config.batch_size.foo=1: 'batch_size' "
            "holds a value of type int, not a group of keys",
        ),
    ],
)
def test_every_kind_of_unknown_key_is_named(override, message):
  # The error ml_collections raises while parsing the override (config_path.get_type is the
  # lookup the flag parser makes), without a subprocess per case.
  path = override[len("--config.") :].partition("=")[0]
  with pytest.raises((KeyError, AttributeError)) as raised:
    config_path.get_type(path, base_config())
  argv = ["main", "--config=configs/quickstart.py", "--config.batch_size=8", override]
  assert cli._unknown_key_message(raised.value, argv) == message  # pylint: disable=protected-access


# A main through trainkit.cli.run that reports what the command line set.
_REPORTING_MAIN = textwrap.dedent("""
    import logging

    import jax
    from trainkit import cli

    def main(argv):
      cli.quiet_logging()
      print(jax.config.jax_debug_nans, jax.config.jax_log_compiles,
            logging.getLevelName(logging.getLogger().getEffectiveLevel()))

    cli.run(main)
    """)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "False False WARNING"),
        (["--jax_debug_nans", "--jax_log_compiles=true", "-v", "0"], "True True INFO"),
        (["--verbosity=1"], "False False DEBUG"),
    ],
)
def test_jax_flags_set_jax_config_and_verbosity_is_the_users(repo_root, args, expected):
  result = _python(repo_root, "-c", _REPORTING_MAIN, *args)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == expected


@pytest.mark.slow
def test_main_accepts_jax_flags_and_logs_at_the_given_verbosity(repo_root, tmp_path):
  # --mode=eval on an empty workdir stops early, after JAX has initialised its backend.
  args = ["-m", "fairmoe_jax.main", "--config=configs/quickstart.py", f"--workdir={tmp_path}"]
  result = _python(repo_root, *args, "--mode=eval", "--jax_debug_nans", "-v", "1")
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert "error: no checkpoint" in result.stderr
  assert "Unknown command line flag" not in result.stderr
  # JAX's debug lines, hidden by default ("I1122 23:20:32.449732 ... xla_bridge.py:922]
  # Initializing backend 'cpu'").
  assert re.search(r"^I\d{4} .* xla_bridge\.py:\d+\] ", result.stderr, re.M)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config=configs/quickstart.py", "extra"], "error: unexpected arguments: extra"),
        (["--config=configs/quickstart.py", "--bogus"], "error: Unknown command line flag 'bogus'"),
    ],
)
def test_every_user_error_exits_2_with_one_line(repo_root, tmp_path, args, needle):
  result = _python(repo_root, "-m", "fairmoe_jax.main", f"--workdir={tmp_path / 'run'}", *args)
  assert result.returncode == USER_ERROR_EXIT_CODE
  assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(needle)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", LAUNCH_SCRIPTS)
@pytest.mark.parametrize("help_flag", ["--help", "-h"])
def test_launch_scripts_answer_help_with_their_usage(repo_root, script, help_flag):
  result = subprocess.run(
      ["bash", str(repo_root / "launch" / script), help_flag],
      capture_output=True,
      text=True,
      timeout=30,
  )
  assert result.returncode == 0 and result.stderr == ""
  assert "unknown argument" not in result.stdout
  # Their header comment, which names the script in its usage line or example.
  assert f"launch/{script}" in result.stdout and "#" not in result.stdout.split("\n", 1)[0]


@pytest.mark.slow
def test_celeba_without_data_root_says_how_and_what_it_costs(repo_root, tmp_path):
  result = _python(
      repo_root,
      "-m",
      "fairmoe_jax.main",
      "--config=configs/celeba.py",
      f"--workdir={tmp_path / 'run'}",
  )
  assert result.returncode == USER_ERROR_EXIT_CODE
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: config key 'data.root': ")
  for needle in (
      "--config.data.root=DIR",
      "img_align_celeba/, list_attr_celeba.txt and list_eval_partition.txt",
      "--config.data.name=celeba_tfds --config.data.tfds_data_dir=DIR",
      "deit_s at 224 px for 500 epochs, an accelerator job",
      "configs/celeba.py:size=small",
  ):
    assert needle in lines[0]
  assert not (tmp_path / "run").exists()
