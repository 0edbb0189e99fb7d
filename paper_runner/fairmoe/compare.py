r"""Command line: train several methods over several seeds, then tabulate them as the paper does.

  python -m paper_runner.fairmoe.compare --config=configs/quickstart.py \
      --methods=fairsmoe,vanilla_smoe,muffin,multifair --seeds=0,1,2 --workdir=/tmp/compare

A method may carry config overrides, `METHOD@KEY=VALUE[@KEY=VALUE...]`, so readings of the
same method compare side by side, e.g.
`--methods=fairsmoe@fair.specialization=class_routing,fairsmoe@fair.route_by=label`.
`--config.KEY=VALUE` flags apply to every run.

A front end of `python -m paper_runner.sweep`: the sweep of `fairmoe_jax.main` over methods x
seeds, each run in `<workdir>/runs/method=<method>,seed=<k>/`. Every run's config is validated
before anything trains; a finished run is reused only if trained with the same config, so
rerunning the command resumes the comparison (docs/running.md). The table is
`<workdir>/comparison.md` and `comparison.json` (`paper_runner/fairmoe/paper_table.py`), beside
the runner's `sweep.csv`, `sweep.md`, `sweep.json` and `plots/`.
The exit status is 1 when any run has no result (the tables are still written), 2 for a bad
flag or config, 130 when interrupted.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Mapping, Sequence

import jax
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax.methods import METHODS
from paper_runner.spec import dotted, split_value, validate_sweep
from paper_runner.sweep import execute_sweep
from trainkit import cli
from trainkit import config as cfg
from trainkit.errors import ConfigError, UserError, exit_on_user_error
from trainkit.workdir import prepare_workdir, trained_config_differences

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally `file.py:key=value,...`; shared by every run."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory of the comparison: runs/ (one per method and seed) and tables."
)
_METHODS = flags.DEFINE_list(
    "methods",
    "fairsmoe,vanilla_smoe,muffin,multifair",
    f"Comma-separated methods to compare, from: {', '.join(METHODS)}; each may add config "
    "overrides as METHOD@KEY=VALUE@KEY=VALUE.",
)
_SEEDS = flags.DEFINE_list("seeds", "0,1,2", "Comma-separated seeds (non-negative integers).")
_RETRAIN = flags.DEFINE_bool(
    "retrain",
    False,
    "Move finished runs trained with another config aside (<run>.stale-<n>) and train them "
    "again; without it such runs are an error.",
)
flags.mark_flags_as_required(["config", "workdir"])

MAIN_MODULE = "fairmoe_jax.main"
PAPER_TABLE = "paper_runner.fairmoe.paper_table:write_comparison"
# The runner's generic sweep table beside the paper's: the headline numbers of each run.
METRICS = ("accuracy", "mf.pqd", "mf.dp")
# Set per run from --methods and --seeds; a --config flag for them would be silently replaced.
GRID_KEYS = ("method", "seed")


def parse_methods(names: Sequence[str]) -> list[str]:
  """Validated, de-duplicated `--methods` (order kept, so the table follows the command)."""
  names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
  if not names:
    raise UserError(f"--methods is empty; choose from {', '.join(METHODS)}")
  unknown = [n for n in names if split_method(n)[0] not in METHODS]
  if unknown:
    raise UserError(
        f"--methods: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}"
    )
  return names


def parse_seeds(values: Sequence[str]) -> list[int]:
  """Validated, de-duplicated `--seeds` as integers."""
  seeds = []
  for value in filter(None, (v.strip() for v in values)):
    try:
      seed = int(value)
    except ValueError:
      raise UserError(f"--seeds: {value!r} is not an integer") from None
    if seed < 0:
      raise UserError(f"--seeds: {seed} is negative")
    seeds.append(seed)
  if not seeds:
    raise UserError("--seeds is empty")
  return list(dict.fromkeys(seeds))


def split_method(entry: str) -> tuple[str, dict[str, str]]:
  """`METHOD@KEY=VALUE@...` -> (METHOD, {KEY: VALUE}), the runner's reading of a grid value."""
  try:
    return split_value(entry)
  except ValueError as e:
    raise UserError(f"--methods: {e} in {entry!r}") from None


def run_config(
    config: ml_collections.ConfigDict, method: str, seed: int
) -> ml_collections.ConfigDict:
  """A copy of the shared config for one run, validated (its error names the method and seed):
  what the run's flags must give `fairmoe_jax.main`, checked before anything trains."""
  config = copy.deepcopy(config)
  name, overrides = split_method(method)
  config.method = name
  config.seed = seed
  for key, text in overrides.items():  # Each parsed to the type the key already has.
    try:
      current = cfg.get(config, key)
    except ConfigError:
      raise UserError(f"--methods: unknown config key {key!r} in {method!r}") from None
    try:
      cfg.apply_overrides(config, {key: cfg.convert(key, text, current)})
    except ConfigError as e:
      raise UserError(f"--methods: {e} (in {method!r})") from None
  try:
    fairmoe_config.validate(
        config, num_devices=jax.device_count(), num_processes=jax.process_count()
    )
  except UserError as e:
    raise UserError(f"{e} (in the run of method {method}, seed {seed})") from None
  return config


def comparison_sweep(
    config_file: str, overrides: Mapping[str, Any], methods: Sequence[str], seeds: Sequence[int]
) -> ml_collections.ConfigDict:
  """The runner's spec of the comparison: `fairmoe_jax.main` over methods x seeds, `--config`'s
  file made absolute and the `--config.KEY` `overrides` forwarded to every run."""
  path, sep, args = config_file.partition(":")
  clash = [k for k in GRID_KEYS if k in overrides]
  if clash:
    raise UserError(
        f"--config.{clash[0]} is set per run by --{clash[0]}s; leave it out of the --config flags"
    )
  return validate_sweep(
      dict(
          module=MAIN_MODULE,
          config=os.path.abspath(os.path.expanduser(path)) + sep + args,
          grid=dotted({"method": tuple(methods), "seed": tuple(seeds)}),
          overrides=dotted(overrides),
          metrics=METRICS,
          tables=(PAPER_TABLE,),
      )
  )


@exit_on_user_error
def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    methods: Sequence[str],
    seeds: Sequence[str],
    retrain: bool = False,
    *,
    config_file: str,
    overrides: Mapping[str, Any] | None = None,
) -> int:
  """Trains what is missing, then writes the tables; returns the exit status (1: runs missing).
  `config_file` and `overrides` are what every run's own `--config` flags repeat."""
  methods, seeds = parse_methods(methods), parse_seeds(seeds)
  sweep = comparison_sweep(config_file, overrides or {}, methods, seeds)
  # Every config is checked before the first run trains, so a mistake costs seconds, not a run.
  configs = {(m, s): run_config(config, m, s) for m in methods for s in seeds}
  workdir = prepare_workdir(workdir)

  def differences(point: Mapping[str, Any], directory: str) -> list[str]:
    # The whole trained config, not only the flags: an edited config file makes runs stale too.
    return trained_config_differences(directory, configs[(point["method"], point["seed"])])

  status = execute_sweep(
      sweep,
      workdir,
      mode="run",
      retrain=retrain,
      sweep_path=f"paper_runner.fairmoe.compare --config={config_file}",
      differences=differences,
      # Here, not the repository root: a relative path in a flag (--config.data.root=../data)
      # means what it meant when this command was typed.
      cwd=os.getcwd(),
  )
  with open(os.path.join(workdir, "comparison.md")) as f:
    print(f"\n{f.read()}", flush=True)
  if status:
    # The table is written, but a script driving the comparison must notice the gaps.
    print("Run(s) without a result are listed above; rerun the same command to retry them.")
  return status


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.quiet_logging()
  config = cli.loaded_config(_CONFIG)
  try:
    status = run(
        config,
        _WORKDIR.value,
        _METHODS.value,
        _SEEDS.value,
        _RETRAIN.value,
        config_file=config_flags.get_config_filename(flags.FLAGS["config"]),
        overrides=config_flags.get_override_values(flags.FLAGS["config"]),
    )
  except KeyboardInterrupt:  # The running run got SIGTERM and checkpointed; rerun resumes.
    sys.exit(130)
  sys.exit(status)


if __name__ == "__main__":
  cli.run(main)
