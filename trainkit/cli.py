"""Command-line plumbing shared by the packages' `main` modules."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import re
import sys
import textwrap
from typing import Any, Callable, Sequence

import jax
import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from trainkit import saved_config, storage
from trainkit.config import settle_run_length, startup_timeout_s
from trainkit.config_files import config_roots, resolve_config_args
from trainkit.distributed import exit_together, initialize_from_env
from trainkit.errors import UserError, exit_on_user_error, fail
from trainkit.preemption import sigterm_ends_cleanly
from trainkit.preflight import compilers as preflight_compilers
from trainkit.preflight import targets as preflight_targets
from trainkit.preflight.compile import compile_run, validate_preflight
from trainkit.preflight.targets import devices as preflight_devices
from trainkit.workdir import (
    CONFIG_FILE,
    prepare_workdir,
    release_lock,
    remove_if_empty,
    require_checkpoint,
    stopped_by_workdir,
    workdir_exists,
    workdir_lock,
)

# absl's --help lists only the `__main__` file's flags (none) and exits 1: ours replaces it.
_HELP_ARGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
_HELPFULL_ARGS = ("--helpfull", "-helpfull")
_WIDTH = 100


@dataclasses.dataclass(frozen=True)
class CommandHelp:
  """What `--help` prints besides the `__main__` docstring (flag_names None: `__main__`'s)."""

  usage: str = "[flags]"
  flag_names: Sequence[str] | None = None
  config_module: str | None = None


def _wrap(text: str, indent: str = "", firstline_indent: str | None = None) -> str:
  # Never inside a word: names such as PAWS-QQP or --config.data.root stay whole.
  return textwrap.fill(
      text,
      width=_WIDTH,
      initial_indent=indent if firstline_indent is None else firstline_indent,
      subsequent_indent=indent,
      break_on_hyphens=False,
      break_long_words=False,
  )


def _program() -> str:
  """`python -m package.module` as the user typed it, or the script's name."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  if spec is not None and spec.name not in ("__main__", None):
    return f"python -m {spec.name}"
  return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def _describe_flag(flag: flags.Flag) -> str:
  text = flag.help or ""
  if flag.default is not None:
    text += f" (default: {flag.default_as_str})"
  return _wrap(f"--{flag.name}: {text}", indent="      ", firstline_indent="  ")


def help_text(command: CommandHelp) -> str:
  """The text of `--help`: usage, the `__main__` docstring, its flags and where to read more."""
  parts = [_wrap(f"usage: {_program()} {command.usage}", indent="         ", firstline_indent="")]
  doc = (sys.modules["__main__"].__doc__ or "").strip("\n")
  if doc:
    parts.append(textwrap.dedent(doc).rstrip())
  names = command.flag_names
  if names is None:
    names = [f.name for f in flags.FLAGS.flags_by_module_dict().get(sys.argv[0], [])]
  described = [_describe_flag(flags.FLAGS[name]) for name in names if name in flags.FLAGS]
  if described:
    parts.append("flags:\n" + "\n".join(described))
  if command.config_module:
    parts.append(config_help(command.config_module))
  parts.append(
      "other flags:\n"
      + "\n".join(
          _wrap(line, indent="      ", firstline_indent="  ")
          for line in (
              "--helpfull: every flag, absl's, JAX's, Grain's and Orbax's included.",
              "--jax_debug_nans, --jax_log_compiles, ...: JAX's configuration flags (the "
              "`jax_*` names of jax.config; --helpfull lists them).",
              "--verbosity=N, -v N: log level; without it only warnings and errors are logged "
              "(0 = info, 1 = debug).",
          )
      )
  )
  parts.append(
      _wrap(
          "exit status: 0 on success, 2 for a usage or config error (one line on stderr naming "
          "the flag, key or file)."
      )
  )
  return "\n\n".join(parts) + "\n"


def _requested_help(argv: Sequence[str]) -> str | None:
  """`short` or `full` when argv asks for help before any `--`."""
  for arg in argv[1:]:
    if arg == "--":
      break
    if arg in _HELP_ARGS:
      return "short"
    if arg in _HELPFULL_ARGS:
      return "full"
  return None


def _unknown_key_message(error: Exception, argv: Sequence[str]) -> str | None:
  """One line for an override naming a key the config lacks (ml_collections' KeyError), or None."""
  inner = error.args[0] if error.args and isinstance(error.args[0], KeyError) else error
  text = str(inner.args[0]) if inner.args else ""
  below_leaf = re.search(r"Attribute <class '(\w+)'>.*Attempting to lookup: (\S+)", text, re.S)
  if below_leaf:
    full_key = below_leaf.group(2)
    parent = full_key.rpartition(".")[0]
    for arg in argv[1:]:
      if arg.startswith(f"--config.{full_key}=") or arg == f"--config.{full_key}":
        return (
            f"unknown config key '{full_key}' in {arg}: '{parent}' holds a value of type "
            f"{below_leaf.group(1)}, not a group of keys"
        )
    return None
  missing = re.match(r"'([^'\n]+)'", text)
  if not missing:
    return None
  key = missing.group(1)
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config.") :].partition("=")[0].split(".")
    if key not in path:
      continue
    prefix = path[: path.index(key)]
    message = f"unknown config key '{'.'.join([*prefix, key])}' in {arg}"
    if suggestion:
      message += f'. Did you mean "{".".join([*prefix, suggestion.group(1)])}"?'
    return message
  return None


def flag_value(argv: Sequence[str], name: str) -> str | None:
  """The value argv gives flag `name` before any `--` (the last one wins, as in absl), or None."""
  value = None
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    flag, equals, given = arg.partition("=")
    if flag in (f"--{name}", f"-{name}"):
      value = given if equals else argv[i + 1] if i + 1 < len(argv) else value
  return value


def parse_flags(
    argv: list[str],
    command: CommandHelp | None = None,
    prepare_argv: Callable[[list[str]], list[str]] | None = None,
) -> list[str]:
  """absl flag parsing where a bad `--config...` flag is one line, not a traceback; `--help`
  exits 0 before any config loads."""
  requested = _requested_help(argv)
  if requested == "short":
    sys.stdout.write(help_text(command or CommandHelp()))
    sys.exit(0)
  if requested == "full":
    app.usage(shorthelp=False, writeto_stdout=True, exitcode=0)
  if prepare_argv is not None:
    argv = prepare_argv(list(argv))
  try:
    return flags.FLAGS(resolve_config_args(argv))
  except flags.UnrecognizedFlagError as e:
    fail(f"{e} (--help lists the flags)")
  except (flags.Error, UserError) as e:  # A UserError: raised by a config file's get_config(arg).
    fail(str(e))
  except (KeyError, AttributeError) as e:  # An override names a key the config lacks.
    message = _unknown_key_message(e, argv)
    if message is None:  # Raised inside the config file, not by an override.
      text = str(e.args[0]) if e.args else str(e)
      fail(f"cannot load the config: {type(e).__name__}: {' '.join(text.strip().splitlines()[:1])}")
    fail(message)
  except Exception as e:  # A config file that fails to load.
    fail(f"cannot load the config: {type(e).__name__}: {e}")


def loaded_config(flag: flags.FlagHolder) -> ml_collections.ConfigDict:
  """The config flag's value, touched now: ml_collections defers a load failure until then."""
  config = flag.value
  if not isinstance(config, ml_collections.ConfigDict):
    try:
      config.to_dict()
    except Exception as e:
      fail(
          f"cannot load --config={flags.FLAGS[flag.name].config_filename}: {type(e).__name__}: {e}"
      )
  return config


def quiet_logging() -> None:
  """Warnings and errors only (JAX and Orbax log much at INFO), unless `--verbosity` is given."""
  if "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger().setLevel(logging.WARNING)


def run(
    main: Callable[[list[str]], Any],
    command: CommandHelp | None = None,
    prepare_argv: Callable[[list[str]], list[str]] | None = None,
) -> None:
  """app.run with one-line user errors (exit status 2), JAX's flags and the package's --help."""

  def guarded_main(argv: list[str]) -> Any:
    try:
      return main(argv)
    except app.UsageError as e:  # absl would print the docstring and exit 1.
      fail(f"{e} (--help shows the usage)")

  if "jax_debug_nans" not in flags.FLAGS:  # JAX's options as absl flags, as big_vision does.
    jax.config.config_with_absl()
  # Tracing a step makes many short-lived objects, and each of Python's full collections would
  # walk every object the imports made (jax, flax, grain, orbax): frozen, they are skipped. A
  # warm-cache tiny run spends about a tenth less CPU.
  gc.freeze()
  app.run(guarded_main, flags_parser=lambda argv: parse_flags(argv, command, prepare_argv))


def _config_files(package: str) -> list[tuple[str, str]]:
  """(configs/NAME.py, first paragraph of its docstring) for each shipped config of `package`."""
  found: dict[str, str] = {}
  imports = re.compile(rf"^\s*(from|import)\s+{re.escape(package)}\b", re.M)
  for root in config_roots():
    for path in sorted(root.glob("*.py")):
      name = f"configs/{path.name}"
      if name in found or path.name.startswith("_"):
        continue
      try:
        source = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source)) or ""
      except (OSError, SyntaxError, ValueError):
        continue  # Help must not fail because of one unreadable config.
      if imports.search(source):
        found[name] = " ".join(doc.split("\n\n")[0].split())
  return sorted(found.items())


def config_help(config_module: str) -> str:
  """The `--help` paragraph on config keys: the overrides, the defaults' module, the configs."""
  package = config_module.split(".")[0]
  lines = [
      "config keys:",
      _wrap(
          "--config=FILE[:ARGS] loads FILE's get_config(ARGS); then --config.KEY=VALUE sets any "
          "key, nested ones by dots (--config.batch_size=64 "
          "--config.optimizer.learning_rate=1e-3). "
          f"{config_module.replace('.', '/')}.py (base_config) holds every key with its default "
          "and what it means. An unknown key, a wrong type or an impossible value stops the run "
          "before anything is compiled.",
          indent="  ",
      ),
  ]
  configs = _config_files(package)
  if configs:
    lines.append("  config files (each docstring gives ARGS, a command and the expected result):")
    for name, summary in configs:
      lines.append(_wrap(f"{name}: {summary}", indent="        ", firstline_indent="    "))
  return "\n".join(lines)


def train_eval_command(
    *,
    validate: Callable[..., None],
    train_and_evaluate: Callable[[ml_collections.ConfigDict, str], Any],
    evaluate_checkpoint: Callable[[ml_collections.ConfigDict, str], Any],
    workdir_help: str = "Directory for checkpoints, metrics and report.json.",
    checkpoint_modes: (
        dict[str, tuple[Callable[[ml_collections.ConfigDict, str], Any], str]] | None
    ) = None,
    preflight_program: Callable[..., Any] | None = None,
) -> Callable[[], None]:
  """Defines the --config / --workdir / --mode flags and returns the `main` of a package.

  `checkpoint_modes` (`{name: (function, help)}`) work on a trained workdir without the data;
  `preflight_program(config, mesh)` adds `--mode=compile`.
  """
  modes = {
      "train": (train_and_evaluate, "train (resuming if possible) then evaluate"),
      "eval": (evaluate_checkpoint, "evaluate the latest checkpoint"),
      **(checkpoint_modes or {}),
  }
  if preflight_program is not None:
    modes["compile"] = (
        functools.partial(compile_run, build_program=preflight_program),
        "compile the train and eval steps for --config.preflight.target (a TPU slice or GPU "
        f"node: {', '.join(preflight_targets.TARGETS)}) without its hardware or data; print and "
        "write "
        "<workdir>/preflight.json (memory per device and the fit, FLOPs, collectives, step "
        "time, device-hours)",
    )
  config_modes = ("train", "compile")  # They describe a run, not a trained workdir.
  config_module = validate.__module__
  config_flag = config_flags.DEFINE_config_file(
      "config",
      None,
      "(required for --mode=train and --mode=compile) Config file, optionally "
      "`file.py:key=value,...`. Without it, the other modes read the trained run's "
      "<workdir>/config.json; --config.KEY=VALUE overrides apply to either.",
  )
  workdir_flag = flags.DEFINE_string("workdir", None, f"(required) {workdir_help}")
  mode_flag = flags.DEFINE_enum(
      "mode",
      "train",
      list(modes),
      "; ".join(f"{name}: {text}" for name, (_, text) in modes.items()) + ".",
  )
  flags.mark_flags_as_required(["workdir"])
  command = CommandHelp(
      usage=f"--config=FILE[:ARGS] --workdir=DIR [--mode={'|'.join(modes)}] "
      "[--config.KEY=VALUE ...]",
      flag_names=("config", "workdir", "mode"),
      config_module=config_module,
  )
  without_config = "|".join(name for name in modes if name not in config_modes)
  config_required = (
      "--config is required with --mode=train (a new run, or the same --config to resume "
      f"one) and --mode=compile; --mode={without_config} can read a trained run's "
      f"<workdir>/{CONFIG_FILE} instead"
  )

  def use_saved_config(argv: list[str]) -> list[str]:
    """argv with `--config` set to the workdir's config.json where none is given."""
    if flag_value(argv, "config") is not None or flag_value(argv, "flagfile") is not None:
      return argv  # A flag file may set --config and --mode: main checks the parsed flags.
    mode = flag_value(argv, "mode") or "train"
    if mode in config_modes:
      fail(config_required)
    workdir = flag_value(argv, "workdir")
    if mode not in modes or not workdir:
      return argv  # absl names the unknown --mode or the missing --workdir.
    try:
      workdir = storage.resolve(workdir)
    except UserError as e:
      fail(str(e))
    path = storage.join(workdir, CONFIG_FILE)
    if not storage.path(path).is_file():
      fail(
          f"--mode={mode} without --config reads the trained run's config, {path}, which does "
          "not exist: give the --workdir of a trained run, or --config=FILE"
      )
    return [argv[0], f"--config={saved_config.config_argument(config_module, workdir)}", *argv[1:]]

  def run_in_workdir(config: ml_collections.ConfigDict, workdir: str, mode: str) -> None:
    created = not workdir_exists(storage.resolve(workdir))
    workdir = prepare_workdir(workdir)

    def abandon() -> None:  # Nothing of a compilation is worth keeping, nor a stale lock.
      release_lock(workdir)
      if created:
        remove_if_empty(workdir)

    # Outside the training steps (set-up, the first compile, evaluation, plots) SIGTERM ends the
    # run at once, without its lock; within them the loop's PreemptionGuard checkpoints first.
    # A multi-process run's SIGTERM is JAX's preemption service's.
    what = (
        "during --mode=compile; nothing was written"
        if mode == "compile"
        else "outside the training steps; its checkpoints are kept: rerun the same command"
    )
    guard = (
        sigterm_ends_cleanly(abandon, what)
        if mode == "compile" or jax.process_count() == 1
        else contextlib.nullcontext()
    )
    try:
      with guard, workdir_lock(workdir):
        modes[mode][0](config, workdir)
    except BaseException as e:
      stopped = stopped_by_workdir(workdir, e) if isinstance(e, Exception) else None
      if stopped is not None:
        raise stopped from e
      if created and jax.process_index() == 0:
        remove_if_empty(workdir)  # An early error leaves no empty workdir behind.
      raise

  @exit_on_user_error
  def execute(
      config: ml_collections.ConfigDict,
      workdir: str,
      mode: str,
      overrides: dict[str, Any] | None = None,
  ) -> None:
    if workdir:
      storage.check_filesystem(workdir)  # Before anything is loaded, built or written.
    if mode == "compile":
      # The target's devices are described; this host's own backend stays the CPU.
      preflight_compilers.add_to_path()  # Before JAX starts a backend (it finds plugins once).
      with contextlib.suppress(RuntimeError):
        jax.config.update("jax_platforms", "cpu")
      target = validate_preflight(config)
      if target is not None and target.platform == "tpu":
        # libtpu installs its own SIGTERM handler: loaded before `sigterm_ends_cleanly`.
        preflight_devices(target)
      devices = (target.num_devices, target.num_hosts) if target else (jax.device_count(), 1)
    else:
      initialize_from_env(startup_timeout_s=startup_timeout_s(config))
      devices = (jax.device_count(), jax.process_count())
      if jax.process_index() != 0:
        # Reports, progress and summaries come from process 0; the others keep stderr only.
        sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
      elif jax.process_count() > 1:
        # tests/e2e/test_slurm.py checks for this line (unconnected processes print none).
        print(
            f"Process 0 of {devices[1]} (jax.distributed), {devices[0]} devices in all", flush=True
        )
    with contextlib.nullcontext() if mode == "compile" else exit_together(workdir):
      line = settle_run_length(config, overrides or {})  # --config.num_train_steps wins.
      if line:
        print(line, flush=True)
      num_devices, num_processes = devices
      validate(
          config,
          num_devices=num_devices,
          num_processes=num_processes,
          check_data=mode in ("train", "eval"),
      )
      if mode not in ("train", "compile"):
        require_checkpoint(workdir)  # Before seconds of data loading and model building.
      run_in_workdir(config, workdir, mode)

  def main(argv: list[str]) -> None:
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])} (--help shows the usage)")
    quiet_logging()
    if config_flag.value is None:
      fail(config_required)
    config = loaded_config(config_flag)
    overrides = config_flags.get_override_values(flags.FLAGS[config_flag.name])
    execute(config, workdir_flag.value, mode_flag.value, overrides)

  return lambda: run(main, command, use_saved_config)
