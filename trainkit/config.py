"""Config helpers: big_vision-style `file.py:key=value` arguments and checks before compilation."""

from __future__ import annotations

import ast
import math
import os
from typing import Any, Iterable, Mapping

from ml_collections import ConfigDict

from trainkit.distributed import DEFAULT_STARTUP_TIMEOUT_S
from trainkit.errors import ConfigError, UserError
from trainkit.mesh import mesh_shape

COMPUTE_DTYPES = ("float32", "bfloat16")


def parse_arg(arg: str | None, **defaults: Any) -> ConfigDict:
  """Parses the `key=value,...` of `--config=file.py:key=value,...`: keys of `defaults`, values
  of their default's type (bools take true/false/1/0; a bare `key` is `key=True`)."""
  parsed = dict(defaults)
  for item in filter(None, _split_top_level(arg or "")):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ConfigError(key, f"unknown config argument; known: {', '.join(sorted(defaults))}")
    parsed[key] = convert(key, raw.strip() if sep else "true", defaults[key])
  return ConfigDict(parsed)


def _split_top_level(arg: str) -> list[str]:
  """Splits on commas outside brackets, so `blocks=(1, 2),steps=3` has two items."""
  items, depth, current = [], 0, []
  for char in arg:
    depth += char in "([{"
    depth -= char in ")]}"
    if char == "," and depth == 0:
      items.append("".join(current))
      current = []
    else:
      current.append(char)
  items.append("".join(current))
  return [item.strip() for item in items]


def convert(key: str, raw: str, default: Any) -> Any:
  """`raw` as the type of `default` (the rules of `parse_arg`); ConfigError naming `key` if not."""
  if isinstance(default, bool):
    if raw.lower() in ("1", "true", "yes"):
      return True
    if raw.lower() in ("0", "false", "no"):
      return False
    raise ConfigError(key, f"expected a boolean, got {raw!r}")
  if isinstance(default, (int, float)):
    try:
      return type(default)(raw)
    except ValueError:
      raise ConfigError(key, f"expected {type(default).__name__}, got {raw!r}") from None
  if isinstance(default, (tuple, list)):
    try:
      return type(default)(ast.literal_eval(raw))
    except (ValueError, SyntaxError):
      raise ConfigError(key, f"expected a sequence literal, got {raw!r}") from None
  return raw


def get(config: ConfigDict, key: str) -> Any:
  """Reads a dotted key, raising ConfigError naming it when it is absent."""
  node = config
  for part in key.split("."):
    if not isinstance(node, ConfigDict) or part not in node:
      raise ConfigError(key, "missing from the config")
    node = node[part]
  return node


def apply_overrides(config: ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Sets each dotted key of `overrides` (`{"mesh.data": 1}`) in `config`, as `--config.KEY=VALUE`
  does; a ConfigError for a key the config lacks or a value of another type."""
  for key, value in overrides.items():
    parent, _, name = key.rpartition(".")
    try:
      node = get(config, parent) if parent else config
    except ConfigError:
      node = None
    if not isinstance(node, ConfigDict) or name not in node:
      raise ConfigError(key, "unknown config key")
    try:
      node[name] = value
    except TypeError as e:  # ConfigDict keeps each key's type.
      raise ConfigError(key, str(e).splitlines()[0]) from None


def require_int(
    config: ConfigDict, key: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
  value = get(config, key)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(key, f"expected an integer, got {value!r}")
  return _in_range(key, value, minimum, maximum)


def _in_range(key: str, value: Any, minimum: Any, maximum: Any) -> Any:
  if minimum is not None and value < minimum:
    raise ConfigError(key, f"must be >= {minimum}, got {value}")
  if maximum is not None and value > maximum:
    raise ConfigError(key, f"must be <= {maximum}, got {value}")
  return value


def host_memory_bytes() -> int | None:
  """This host's physical memory, or None where the OS does not say."""
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def require_fits_in_host_memory(key: str, nbytes: int, what: str) -> None:
  """Refuses generated data that would take more than half this host's memory, naming `key`
  (it would otherwise be generated for minutes, then fail or swap)."""
  memory = host_memory_bytes()
  if memory is not None and nbytes > memory // 2:
    raise ConfigError(
        key,
        f"{what} would take {nbytes / 2**30:.1f} GiB, more than half of this host's "
        f"{memory / 2**30:.1f} GiB of memory; lower it",
    )


def require_float(
    config: ConfigDict, key: str, *, minimum: float | None = None, maximum: float | None = None
) -> float:
  value = get(config, key)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(key, f"expected a number, got {value!r}")
  if not math.isfinite(value):  # Every comparison with NaN is false: check it first.
    raise ConfigError(key, f"expected a finite number, got {value}")
  return float(_in_range(key, value, minimum, maximum))


def require_choice(config: ConfigDict, key: str, choices: Iterable[Any]) -> Any:
  value = get(config, key)
  choices = tuple(choices)
  if value not in choices:
    raise ConfigError(key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
  return value


def parse_profile_steps(config: ConfigDict) -> tuple[int, int] | None:
  """`profile_steps` = "START:END" as (START, END): trace steps START+1 .. END; "" = None."""
  value = get(config, "profile_steps") if "profile_steps" in config else ""
  if value in ("", None):
    return None
  start, sep, end = str(value).partition(":")
  try:
    bounds = (int(start), int(end))
  except ValueError:
    bounds = None
  if not sep or bounds is None or not 0 <= bounds[0] < bounds[1]:
    raise ConfigError(
        "profile_steps",
        f"must be 'START:END' with 0 <= START < END (trace the steps after START up to END), "
        f"got {value!r}",
    )
  return bounds


def require_finite_numbers(config: ConfigDict, prefix: str = "") -> None:
  """No NaN or infinity anywhere in the config: no key gives either a meaning, and NaN passes
  every range check (each comparison with it is false)."""
  for name, value in config.items():
    key = f"{prefix}{name}"
    if isinstance(value, ConfigDict):
      require_finite_numbers(value, f"{key}.")
      continue
    values = value if isinstance(value, (list, tuple)) else [value]
    for item in values:
      if isinstance(item, float) and not math.isfinite(item):
        raise ConfigError(key, f"expected a finite number, got {value}")


def add_run_keys(
    config: ConfigDict, *, batch_size: int, eval_batch_size: int, num_epochs: float
) -> None:
  """Adds the keys every package's run has (`validate_run` checks them), with their defaults,
  but for `preflight` (`trainkit.preflight.compile.preflight_config`)."""
  config.seed = 0
  config.batch_size = batch_size  # Global, over all devices and processes.
  config.eval_batch_size = eval_batch_size
  config.num_train_steps = 1000
  # > 0: epochs over the train split instead of num_train_steps (a command-line one wins).
  config.num_epochs = num_epochs
  config.log_every_steps = 50
  config.eval_every_steps = 500  # On the validation split; 0 disables.
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 3
  config.compute_dtype = "float32"
  config.peak_flops_per_device = 0.0  # For MFU; 0 = look the device up (trainkit/throughput.py).
  # "START:END": a jax.profiler trace of steps START+1..END in <workdir>/profile; "" = none.
  config.profile_steps = ""
  config.mesh = ConfigDict(dict(data=-1, expert=1))
  # --mode=predict: the inputs to predict (images, or sentence pairs or sources: docs/running.md).
  config.predict = ConfigDict(dict(input=""))
  # Multi-process runs: how long a process waits for the slowest one (trainkit.distributed).
  config.distributed = ConfigDict(dict(startup_timeout_s=DEFAULT_STARTUP_TIMEOUT_S))


def startup_timeout_s(config: ConfigDict) -> float:
  """`distributed.startup_timeout_s` (a saved config without it is migrated: trainkit.workdir)."""
  return require_float(config, "distributed.startup_timeout_s", minimum=1.0)


def validate_run(
    config: ConfigDict, *, num_devices: int, num_processes: int = 1
) -> tuple[int, int]:
  """Checks the keys every run has; returns the (data, expert) mesh shape, or a ConfigError."""
  require_finite_numbers(config)
  for key in ("num_train_steps", "batch_size", "eval_batch_size", "log_every_steps"):
    require_int(config, key, minimum=1)
  for key in ("seed", "eval_every_steps", "checkpoint_every_steps"):
    require_int(config, key, minimum=0)
  require_int(config, "keep_checkpoints", minimum=1)
  require_float(config, "num_epochs", minimum=0.0)
  require_choice(config, "compute_dtype", COMPUTE_DTYPES)
  startup_timeout_s(config)
  parse_profile_steps(config)
  data_size, expert_size = mesh_shape(get(config, "mesh"), num_devices)
  shards = data_size * expert_size
  for key in ("batch_size", "eval_batch_size"):
    if config[key] % shards or config[key] % num_processes:
      raise ConfigError(
          key,
          f"{config[key]} is not divisible by the {shards} devices of the mesh "
          f"(data={data_size} x expert={expert_size}) and {num_processes} process(es)",
      )
  return data_size, expert_size


def settle_run_length(config: ConfigDict, overrides: Mapping[str, Any]) -> str | None:
  """A `num_train_steps` override (`--config.KEY=VALUE`) sets the file's `num_epochs` to 0 and
  returns a line saying so; both overridden, with `num_epochs` > 0, is a UserError."""
  if "num_train_steps" not in overrides or "num_epochs" not in config:
    return None
  steps = overrides["num_train_steps"]
  if "num_epochs" in overrides:
    epochs = overrides["num_epochs"]
    if isinstance(epochs, (int, float)) and epochs > 0:
      raise UserError(
          f"--config.num_train_steps={steps} and --config.num_epochs={epochs:g} both set the "
          "length of the run; give one of them (num_epochs > 0 sets num_train_steps from the "
          "training set's size)"
      )
    return None
  epochs = config.num_epochs
  if not isinstance(epochs, (int, float)) or not epochs > 0:
    return None
  config.num_epochs = type(epochs)(0)
  return (
      f"--config.num_train_steps={steps} was given: the run trains {steps} steps, and "
      f"num_epochs={epochs:g} from the config file is ignored"
  )


def resolve_train_steps(config: ConfigDict, train_examples: int, *, training: bool) -> None:
  """Checks one batch fits the loaded training data; `num_epochs` > 0 sets `num_train_steps`
  (rounded up to whole updates)."""
  if training and train_examples < config.batch_size:
    raise UserError(
        f"the training data has {train_examples} examples, fewer than one batch "
        f"(batch_size={config.batch_size}); lower batch_size or add data"
    )
  if config.num_epochs > 0 and train_examples:
    # Whole updates of optimizer.accumulation_steps steps each (trainkit.optim).
    k = config.optimizer.get("accumulation_steps", 1) if "optimizer" in config else 1
    config.num_train_steps = k * max(
        1, math.ceil(config.num_epochs * train_examples / (config.batch_size * k))
    )
