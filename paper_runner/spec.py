"""The sweep spec: what a sweep file may say, and what each of its runs is.

A sweep file's `get_config(arg)` returns the keys of SWEEP_KEYS; `validate_sweep` turns that into
a normalised ConfigDict (or a SweepError naming the key), and the functions below derive each
run from it: its grid point, its name and directory, its command line and the record
(`sweep_run.json`) that a rerun compares to decide whether a finished run can be reused.
The command-line contract is in `paper_runner/sweep.py`'s docstring.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from trainkit import storage
from trainkit.config import settle_run_length
from trainkit.config_files import resolve_config_path
from trainkit.errors import UserError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_THROUGHPUT_KEYS = ("examples_per_second", "tokens_per_second", "mfu")
SWEEP_KEYS = tuple(
    "module config grid overrides row_settings metrics throughput_keys timeout_s tables".split()
)
# The repo's launchers take `--module M` before their `--`; without it they run fairmoe_jax.main.
MODULE_LAUNCHERS = ("slurm.sh", "tpu_pod.sh", "local_multiprocess.sh")
# The files of a run directory that the runner reads or writes (the main writes REPORT).
REPORT, ERROR, LOG = "report.json", "error.txt", "log.txt"
RUN = "sweep_run.json"  # What a run was started with: module, config and every setting.
# The commit and host a run was started on (paper_runner.provenance), for its table's record.
RUN_PROVENANCE = "provenance.json"
# A grid value `VALUE@KEY=X@KEY2=Y` also sets config keys for the runs that take it.
VALUE_SETTINGS_SEPARATOR = "@"
_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME_LIMIT = 200  # Below the usual 255-byte file-name limit.

TableCollector = Callable[[str, list], list]  # (workdir, [RunResult]) -> [path written]


class SweepError(UserError):
  """A sweep key is missing, has a wrong type or an impossible value."""

  def __init__(self, key: str, message: str):
    self.key = key
    super().__init__(f"sweep key '{key}': {message}")


def dotted(mapping: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A ConfigDict that accepts dotted keys and keeps their order (for `grid` and `overrides`)."""
  return ml_collections.ConfigDict(dict(mapping), allow_dotted_keys=True, sort_keys=False)


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{dotted key: value} of the leaves of a nested mapping or ConfigDict."""
  flat = {}
  for key, value in mapping.items():
    key = f"{prefix}{key}"
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      flat.update(flatten(value, f"{key}."))
    else:
      flat[key] = value
  return flat


def _is_scalar(value: Any) -> bool:
  return value is None or isinstance(value, (bool, int, float, str))


def _check_value(key: str, value: Any) -> Any:
  """A value a `--config.key=value` flag can carry: a scalar or a tuple of scalars."""
  if isinstance(value, (list, tuple)) and all(_is_scalar(v) for v in value):
    return tuple(value)
  if not _is_scalar(value):
    raise SweepError(key, f"value {value!r} is not a number, string, bool, None or tuple of them")
  return value


def split_value(text: str) -> tuple[str, dict[str, str]]:
  """`VALUE@KEY=X@KEY2=Y` -> ("VALUE", {"KEY": "X", "KEY2": "Y"}); text without '@' is itself.

  The settings stay strings: the main parses them to its config's types, as it does any
  `--config.KEY=X` flag. Raises ValueError saying which part is wrong.
  """
  value, *parts = text.split(VALUE_SETTINGS_SEPARATOR)
  settings: dict[str, str] = {}
  for part in parts:
    key, sep, setting = part.partition("=")
    key = key.strip()
    if not sep or not _DOTTED_NAME.fullmatch(key):
      raise ValueError(f"{part!r} is not KEY=VALUE with KEY a dotted config key")
    if key in settings:
      raise ValueError(f"{key!r} is set twice")
    settings[key] = setting.strip()
  if parts and not value.strip():
    raise ValueError("nothing before the first '@'")
  return value.strip() if parts else value, settings


def _check_grid(raw_grid: Mapping[str, Any]) -> dict[str, list[Any]]:
  grid = {}
  for key, values in flatten(raw_grid).items():
    if not isinstance(values, (list, tuple)) or not values:
      raise SweepError(f"grid.{key}", "must be a non-empty list")
    values = [_check_value(f"grid.{key}", v) for v in values]
    duplicates = [v for i, v in enumerate(values) if v in values[:i]]
    if duplicates:
      raise SweepError(f"grid.{key}", f"value {duplicates[0]!r} is listed twice")
    grid[key] = values
  if not grid:
    raise SweepError("grid", "must name at least one config key")
  # Checked once every grid key is known: an `@` setting must not fight a grid key.
  for key, values in grid.items():
    for value in values:
      if not isinstance(value, str):
        continue
      try:
        _, settings = split_value(value)
      except ValueError as e:
        raise SweepError(
            f"grid.{key}", f"value {value!r}: {e} (VALUE@KEY=X@... also sets config key KEY to X)"
        ) from None
      clash = [k for k in settings if k in grid]
      if clash:
        raise SweepError(
            f"grid.{key}", f"value {value!r} sets {clash[0]!r}, a grid key; keep it in one place"
        )
  return grid


def _check_row_settings(entries: Any, grid: Mapping[str, list[Any]]) -> tuple:
  """`row_settings`: (grid key, one of its values, "KEY=X@KEY2=Y"[, settings searched, source]),
  each setting config keys for the runs of that value without renaming them: a search's choice
  (`paper_scale.at_scale`), which a table's tuning line reports from the last two."""
  checked = []
  for i, entry in enumerate(entries):
    fits = isinstance(entry, (list, tuple)) and len(entry) in (3, 5)
    key, value, text, searched, source = (*entry, 0, "")[:5] if fits else [None] * 5
    if key not in grid or value not in grid[key] or not isinstance(text, str):
      raise SweepError(f"row_settings[{i}]", f"{entry!r} is not (grid key, its value, 'KEY=X@...')")
    try:
      settings = split_value(f"row{VALUE_SETTINGS_SEPARATOR}{text}")[1]
    except ValueError as e:
      raise SweepError(f"row_settings[{i}]", f"{text!r}: {e}") from None
    if any(k in grid for k in settings):
      raise SweepError(f"row_settings[{i}]", f"{text!r} sets a grid key; keep it in one place")
    checked.append((key, value, text, int(searched or 0), str(source or "")))
  return tuple(checked)


def import_collector(name: str) -> TableCollector:
  """The function a `tables` entry `module:function` names; UserError if there is none."""
  module_name, sep, attribute = name.partition(":")
  if not sep or not _DOTTED_NAME.fullmatch(module_name) or not _DOTTED_NAME.fullmatch(attribute):
    raise SweepError("tables", f"{name!r} is not 'module:function'")
  try:
    target: Any = importlib.import_module(module_name)
  except Exception as e:  # Any failure to import is the sweep author's to fix; say which.
    raise SweepError("tables", f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
  for part in attribute.split("."):
    if not hasattr(target, part):
      raise SweepError("tables", f"{module_name!r} has no {attribute!r}")
    target = getattr(target, part)
  if not callable(target):
    raise SweepError("tables", f"{name!r} is not callable")
  # A collector is called as collector(workdir, results): check that it can be, before any run
  # trains (os:system, say, takes one argument).
  try:
    inspect.signature(target).bind("workdir", [])
  except TypeError as e:
    raise SweepError(
        "tables", f"{name!r} cannot be called as {attribute}(workdir, results): {e}"
    ) from None
  except ValueError:  # A builtin without a signature: it cannot be checked here.
    pass
  return target


def _check_names(key: str, value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
  """A list of non-empty strings (metrics, throughput keys, table collectors)."""
  value = default if value is None else value
  if isinstance(value, str) or not isinstance(value, (list, tuple)):
    raise SweepError(key, f"must be a list of strings, got {value!r}")
  if not all(isinstance(v, str) and v for v in value):
    raise SweepError(key, f"must be a list of non-empty strings, got {value!r}")
  return tuple(value)


def validate_sweep(raw: Any) -> ml_collections.ConfigDict:
  """Checks a sweep definition and returns it normalised (grid and overrides as `dotted`).

  The table collectors are imported here, so a misspelt one stops the sweep before it runs
  anything rather than after hours of training.
  """
  if not isinstance(raw, (Mapping, ml_collections.ConfigDict)):
    raise UserError(f"get_config() must return a ConfigDict or dict, got {type(raw).__name__}")
  raw = dict(raw.items())
  unknown = [k for k in raw if k not in SWEEP_KEYS]
  if unknown:
    raise SweepError(unknown[0], f"unknown key; known: {', '.join(SWEEP_KEYS)}")
  for key in ("module", "config"):
    if not isinstance(raw.get(key), str) or not raw[key].strip():
      raise SweepError(key, "required, a non-empty string")
  if not _DOTTED_NAME.fullmatch(raw["module"].strip()):
    raise SweepError("module", f"{raw['module']!r} is not a dotted module name")

  if not isinstance(raw.get("grid"), (Mapping, ml_collections.ConfigDict)):
    raise SweepError("grid", "required, a mapping from dotted config keys to lists of values")
  grid = _check_grid(raw["grid"])

  overrides_raw = raw.get("overrides") or {}
  if not isinstance(overrides_raw, (Mapping, ml_collections.ConfigDict)):
    raise SweepError("overrides", "must be a mapping from dotted config keys to values")
  overrides = {}
  for key, value in flatten(overrides_raw).items():
    if key in grid:
      raise SweepError(f"overrides.{key}", "is also a grid key; keep it in one place")
    overrides[key] = _check_value(f"overrides.{key}", value)

  sweep = ml_collections.ConfigDict()
  sweep.module, sweep.config = raw["module"].strip(), raw["config"].strip()
  sweep.grid, sweep.overrides = dotted(grid), dotted(overrides)
  sweep.row_settings = _check_row_settings(raw.get("row_settings") or (), grid)
  sweep.metrics = _check_names("metrics", raw.get("metrics"), ())
  sweep.throughput_keys = _check_names(
      "throughput_keys", raw.get("throughput_keys"), DEFAULT_THROUGHPUT_KEYS
  )
  sweep.tables = _check_names("tables", raw.get("tables"), ())
  for name in sweep.tables:
    import_collector(name)
  timeout = raw.get("timeout_s") or 0
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
    raise SweepError("timeout_s", f"must be a non-negative number of seconds, got {timeout!r}")
  sweep.timeout_s = float(timeout)
  return sweep


def _resolve(path: str) -> str:
  """A path as given (absolute or from the current directory), else relative to the repo root."""
  if os.path.isabs(path) or os.path.exists(path):
    return os.path.abspath(path)
  return os.path.join(REPO_ROOT, path)


def load_sweep(path_with_args: str) -> ml_collections.ConfigDict:
  """Loads `file.py[:arg]`, calls its `get_config(arg)` and validates the result."""
  return load_sweep_file(path_with_args)[0]


def load_sweep_file(path_with_args: str) -> tuple[ml_collections.ConfigDict, Any]:
  """(the validated sweep, the loaded module) of `file.py[:arg]`: a module may define more than
  its sweep (a results spec's `TABLE`, paper_runner/tables.py)."""
  path, sep, arg = path_with_args.partition(":")
  resolved = _resolve(path)
  if not path or not os.path.isfile(resolved):
    raise UserError(f"--sweep: no such file {path!r}")
  spec = importlib.util.spec_from_file_location(f"_sweep_{abs(hash(resolved))}", resolved)
  try:
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if sep and not inspect.signature(module.get_config).parameters:  # No scale, no options.
      raise UserError(f"{path} takes no argument: ':{arg}' cannot be applied to it")
    raw = module.get_config(arg) if sep else module.get_config()
  except UserError:
    raise
  except Exception as e:  # Any mistake inside the sweep file is the user's; say where.
    raise UserError(f"cannot load sweep {path_with_args}: {type(e).__name__}: {e}") from None
  return validate_sweep(raw), module


def grid_points(sweep: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """The runs: the Cartesian product of the grid, the first key varying slowest."""
  keys = list(sweep.grid.keys())
  return [dict(zip(keys, values)) for values in itertools.product(*sweep.grid.values())]


def format_value(value: Any) -> str:
  """A value as a `--config.key=` flag writes it, so ml_collections parses it back."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    value = tuple(value)
  return repr(value)  # bool -> True/False, None -> None, numbers and tuples round-trip.


def safe_name(text: str) -> str:
  """`text` with the characters that are awkward in a file name replaced by '_', and cut to
  _NAME_LIMIT characters when longer (still readable at the front, unique by a hash)."""
  name = re.sub(r"[^A-Za-z0-9._=,@-]", "_", text)
  if len(name) > _NAME_LIMIT:
    name = f"{name[:_NAME_LIMIT - 11]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
  return name


def run_name(point: Mapping[str, Any]) -> str:
  """`key=value,...` in grid order, as a file name (`safe_name`)."""
  return safe_name(",".join(f"{k}={format_value(v)}" for k, v in point.items()))


def run_dir(workdir: str, point: Mapping[str, Any]) -> str:
  """Where the run of `point` trains: `<workdir>/runs/<run_name>` (under a gs:// workdir too)."""
  return storage.join(storage.resolve(workdir), "runs", run_name(point))


def check_run_names(points: Sequence[Mapping[str, Any]]) -> None:
  """SweepError when two runs would share a directory (values that differ only in odd chars)."""
  seen: dict[str, Mapping[str, Any]] = {}
  for point in points:
    name = run_name(point)
    if name in seen:
      raise SweepError("grid", f"runs {seen[name]} and {point} get the same directory {name!r}")
    seen[name] = point


def run_settings(sweep: ml_collections.ConfigDict, point: Mapping[str, Any]) -> dict[str, Any]:
  """Every config key the run sets: the overrides, then its grid values and their `@` settings.

  An `@` setting replaces an override of the same key: it is the more specific of the two; the
  `row_settings` of the point's values come last.
  """
  settings = dict(sweep.overrides)
  for key, value in point.items():
    extra: dict[str, str] = {}
    if isinstance(value, str):
      value, extra = split_value(value)
    settings[key] = value
    settings.update(extra)
  for key, value, text, *_ in sweep.get("row_settings") or ():
    if point.get(key) == value:
      settings.update(split_value(f"row{VALUE_SETTINGS_SEPARATOR}{text}")[1])
  return settings


def run_command(
    sweep: ml_collections.ConfigDict,
    point: Mapping[str, Any],
    run_dir: str,
    launcher: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
  """The argv of one run: `python -m module` (or the launcher), then the main's flags."""
  args = [f"--config={sweep.config}", f"--workdir={run_dir}"]
  args += [f"--config.{k}={format_value(v)}" for k, v in run_settings(sweep, point).items()]
  if not launcher:
    return [python, "-m", sweep.module, *args]
  launcher = list(launcher)
  if (
      os.path.basename(launcher[0]) in MODULE_LAUNCHERS
      and "--module" not in launcher
      and "--" in launcher
  ):
    at = len(launcher) - 1 - launcher[::-1].index("--")
    launcher[at:at] = ["--module", sweep.module]
  return [*launcher, *args]


def run_record(sweep: ml_collections.ConfigDict, point: Mapping[str, Any]) -> dict[str, Any]:
  """What decides a run's result, as written to its RUN file and compared on a rerun."""
  return {
      "module": sweep.module,
      "config": sweep.config,
      "settings": {k: format_value(v) for k, v in run_settings(sweep, point).items()},
  }


def resolved_config(
    sweep: ml_collections.ConfigDict, point: Mapping[str, Any], cwd: str = REPO_ROOT
) -> ml_collections.ConfigDict:
  """The config the run of `point` trains with (its `config.json` once trained), parsed from the
  run's own flags as its main parses them; `cwd` is where the runs start.

  Raises:
    SweepError: the config file cannot be loaded or a setting names a key it lacks.
  """
  path, sep, args = sweep.config.partition(":")
  path = os.path.expanduser(path)
  if os.path.isfile(os.path.join(cwd, path)):
    path = os.path.join(cwd, path)
  else:  # As the mains find it: a `configs/` path in the installed package's configs.
    path = resolve_config_path(path)
  argv = ["sweep", f"--config={path}{sep}{args}"]
  argv += [f"--config.{k}={format_value(v)}" for k, v in run_settings(sweep, point).items()]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  try:
    with warnings.catch_warnings():  # ml_collections loads the file with the deprecated
      warnings.simplefilter("ignore", DeprecationWarning)  # load_module(); not the user's.
      values(argv)
    config = holder.value
    config.to_dict()  # ml_collections defers some load failures until the config is touched.
  except Exception as e:  # Whatever the config file or a setting got wrong: name the run.
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
      reason = lines[-1]  # ml_collections wraps get_config's exception in its traceback.
    else:
      reason = f"{type(e).__name__}: {lines[0] if lines else ''}"
    raise SweepError(
        "config", f"cannot build the config of run {run_name(point)} from {sweep.config}: {reason}"
    ) from None
  try:  # As the mains do: a num_train_steps given wins over the file's num_epochs.
    settle_run_length(config, config_flags.get_override_values(values["config"]))
  except UserError as e:
    raise SweepError("config", f"run {run_name(point)}: {e}") from None
  return config
