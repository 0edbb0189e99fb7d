"""Arguments of `jax.distributed.initialize`, decided from the environment.

`distributed_args(env)` reads `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`,
then SLURM's variables, then a Cloud TPU pod's or `TRAINKIT_DISTRIBUTED=auto` (`{}`: JAX detects
the pod); otherwise None (docs/scaling.md). Gloo gives up on a peer 30 s late, so
`wait_for_all_processes` holds drifting processes on the coordination service's barrier instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from typing import Any, Callable, Iterator, Mapping, TypeVar

from trainkit.errors import USER_ERROR_EXIT_CODE, UserError
from trainkit.preemption import SIGTERM_EXIT_CODE

T = TypeVar("T")

DEFAULT_COORDINATOR_PORT = 12345
# `distributed.startup_timeout_s`'s default: a loaded machine or large data set takes minutes.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_KEY = "distributed.startup_timeout_s"
_startup_timeout_s = DEFAULT_STARTUP_TIMEOUT_S
_barriers_passed = 0

# Variables whose presence means "a Cloud TPU pod: let JAX auto-detect everything".
TPU_VARIABLES = (
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_ID",
    "CLOUD_TPU_TASK_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
)
AUTO_VARIABLE = "TRAINKIT_DISTRIBUTED"
EXPLICIT_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
HEARTBEAT_VARIABLE = "TRAINKIT_HEARTBEAT_TIMEOUT"
# How a lost peer shows in errors that JAX, Orbax or the data path re-raise under other types.
_PEER_FAILURE = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|closed by peer|socket closed|"
    r"coordination service|heartbeat|barrier|DEADLINE_EXCEEDED|UNAVAILABLE",
    re.IGNORECASE,
)

_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")

# What libtpu outside a TPU VM setenv's TPU_WORKER_ID and others to (unseen by os.environ).
_LIBTPU_PLACEHOLDER = re.compile(r"^\s*WARNING: could not determine\b", re.IGNORECASE)


def is_libtpu_placeholder(value: str) -> bool:
  """Whether an environment value is libtpu's "WARNING: could not determine ..." placeholder."""
  return bool(_LIBTPU_PLACEHOLDER.match(value))


def child_environment(
    extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str]:
  """`env` (default os.environ) and `extra` without libtpu's placeholders: pass it as `env=` to
  every subprocess started after JAX loaded, or the child takes itself for a TPU pod worker."""
  merged = {**(os.environ if env is None else env), **(extra or {})}
  return {name: value for name, value in merged.items() if not is_libtpu_placeholder(value)}


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
  """Expands a Slurm host list (`node[08-10,12]`, `rack[1-2]-n[1-2]`), keeping zero padding;
  a malformed list raises UserError naming `variable`."""
  hosts = []
  for item in _split_top_level(nodelist.strip(), variable):
    hosts.extend(_expand_host(item, variable, nodelist))
  return hosts  # Never empty: an empty item raises.


def _bad(variable: str, value: str, why: str) -> UserError:
  return UserError(f"{variable}={value!r} is malformed: {why}")


def _split_top_level(text: str, variable: str) -> list[str]:
  depth = 0
  for ch in text:
    depth += {"[": 1, "]": -1}.get(ch, 0)
    if depth not in (0, 1):
      raise _bad(variable, text, "nested brackets" if depth > 1 else "']' without '['")
  if depth:
    raise _bad(variable, text, "'[' without ']'")
  items = re.split(r",(?![^\[]*\])", text)  # The commas outside brackets.
  if not all(items):
    raise _bad(variable, text, "empty host name")
  return items


def _expand_host(item: str, variable: str, whole: str) -> list[str]:
  prefix, bracket, rest = item.partition("[")
  if prefix and not _HOST_RE.match(prefix):
    raise _bad(variable, whole, f"bad host name{' prefix' if bracket else ''} {prefix!r}")
  if not bracket:
    return [item]
  ranges, _, rest = rest.partition("]")
  values = []
  for part in ranges.split(","):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
    if not m:
      raise _bad(variable, whole, f"bad range {part!r} (expected N or N-M)")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
      raise _bad(variable, whole, f"range {part!r} is decreasing")
    values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
  tails = _expand_host(rest, variable, whole) if rest else [""]
  return [prefix + v + tail for v in values for tail in tails]


def _int(env: Mapping[str, str], variable: str, minimum: int, maximum: int | None = None) -> int:
  value = env[variable]
  try:
    n = int(value.strip())
  except ValueError:
    raise _bad(variable, value, "expected an integer") from None
  if n < minimum:
    raise _bad(variable, value, f"expected an integer >= {minimum}")
  if maximum is not None and n > maximum:
    raise _bad(variable, value, f"expected a port <= {maximum}")
  return n


def _coordinator(env: Mapping[str, str]) -> str:
  value = env["JAX_COORDINATOR_ADDRESS"]
  host, sep, port = value.strip().rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise _bad("JAX_COORDINATOR_ADDRESS", value, "expected host:port")
  return value.strip()


def _slurm_args(env: Mapping[str, str]) -> dict[str, Any] | None:
  if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env:
    return None
  num_processes = _int(env, "SLURM_NTASKS", 1)
  process_id = _int(env, "SLURM_PROCID", 0)
  if process_id >= num_processes:
    raise _bad("SLURM_PROCID", env["SLURM_PROCID"], f"not below SLURM_NTASKS={num_processes}")
  if num_processes == 1:
    return None
  args: dict[str, Any] = {"num_processes": num_processes, "process_id": process_id}
  if "JAX_COORDINATOR_ADDRESS" not in env:
    variable = next(
        (v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v, "").strip()), None
    )
    if variable is None:
      raise UserError(
          "SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset: cannot choose the coordinator "
          "(set JAX_COORDINATOR_ADDRESS=host:port)"
      )
    first_host = expand_nodelist(env[variable], variable)[0]
    port = (
        _int(env, "JAX_COORDINATOR_PORT", 1, 65535)
        if "JAX_COORDINATOR_PORT" in env
        else DEFAULT_COORDINATOR_PORT
    )
    args["coordinator_address"] = f"{first_host}:{port}"
  if env.get("SLURM_GPUS_PER_TASK", "").strip() == "1":
    local_id = _int(env, "SLURM_LOCALID", 0) if "SLURM_LOCALID" in env else None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == 1:
      args["local_device_ids"] = [0]  # Slurm bound this task to one GPU, JAX's device 0.
    elif local_id is not None:
      args["local_device_ids"] = [local_id]
  return args


def distributed_args(env: Mapping[str, str]) -> dict[str, Any] | None:
  """`jax.distributed.initialize`'s arguments (module docstring), or None for one process."""
  explicit: dict[str, Any] = {}
  if "JAX_COORDINATOR_ADDRESS" in env:
    explicit["coordinator_address"] = _coordinator(env)
  if "JAX_NUM_PROCESSES" in env:
    explicit["num_processes"] = _int(env, "JAX_NUM_PROCESSES", 1)
  if "JAX_PROCESS_ID" in env:
    explicit["process_id"] = _int(env, "JAX_PROCESS_ID", 0)

  auto = env.get(AUTO_VARIABLE, "").strip().lower()
  if auto not in ("", "auto", "0", "off"):
    raise _bad(AUTO_VARIABLE, env[AUTO_VARIABLE], "expected 'auto' or 'off'")

  base = _slurm_args(env)
  # libtpu's own "could not determine" placeholder says the opposite of a pod: ignored.
  tpu_signs = [
      v for v in TPU_VARIABLES if env.get(v, "").strip() and not is_libtpu_placeholder(env[v])
  ]
  if base is None and (auto == "auto" or tpu_signs):
    base = {}
  if base is None and not explicit:
    return None
  if base is None:
    missing = [v for v in EXPLICIT_VARIABLES if v not in env]
    if missing:
      raise UserError(
          f"{missing[0]} is not set: outside SLURM and Cloud TPU, "
          f"{', '.join(EXPLICIT_VARIABLES)} must be set together"
      )
    base = {}
  args = {**base, **explicit}
  if "num_processes" in args and "process_id" in args:
    if args["process_id"] >= args["num_processes"]:
      variable = "JAX_PROCESS_ID" if "JAX_PROCESS_ID" in env else "SLURM_PROCID"
      raise _bad(variable, str(args["process_id"]), f"not below {args['num_processes']} processes")
  if all(k in args for k in ("coordinator_address", "num_processes", "process_id")):
    args["cluster_detection_method"] = "deactivate"
  if HEARTBEAT_VARIABLE in env:
    args["heartbeat_timeout_seconds"] = _int(env, HEARTBEAT_VARIABLE, 1)
  return args


def initialize_from_env(
    env: Mapping[str, str] = os.environ, *, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> dict[str, Any] | None:
  """`jax.distributed.initialize(**distributed_args(env))` unless single-process, before any
  other JAX call; returns the arguments. `startup_timeout_s` bounds `wait_for_all_processes`."""
  global _startup_timeout_s
  _startup_timeout_s = float(startup_timeout_s)
  args = distributed_args(env)
  if args is not None:
    import jax  # pylint: disable=import-outside-toplevel

    jax.distributed.initialize(**args)
  return args


def wait_for_all_processes(name: str) -> None:
  """Holds this process on the coordination service's barrier until every process got here; a
  UserError naming `distributed.startup_timeout_s` when one does not arrive in time."""
  global _barriers_passed
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

  client = jax_distributed.global_state.client
  if client is None:
    return
  _barriers_passed += 1  # A barrier's id is used once.
  try:
    client.wait_at_barrier(f"trainkit:{name}:{_barriers_passed}", int(_startup_timeout_s * 1000))
  except Exception as e:  # pylint: disable=broad-except  # jaxlib's own error type.
    if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
      raise
    raise UserError(
        f"not every process reached {name} within {_startup_timeout_s:g} s "
        f"({STARTUP_TIMEOUT_KEY}): one is much slower (a loaded machine, a large data set: "
        f"raise --config.{STARTUP_TIMEOUT_KEY}) or has died or hangs (see its log)"
    ) from None


# What Gloo says when a peer did not join the first collective within its fixed 30 s.
_GLOO_LATE_PEER = "Gloo context initialization failed"


def describe_failure(error: BaseException, where: str, resume: str) -> tuple[str, int, bool]:
  """(message, exit status, whether to print the traceback) for `exit_together`."""
  first_line = (str(error).strip().splitlines() or [""])[0][:300]
  if isinstance(error, UserError):
    return f"error: {where}: {error}", USER_ERROR_EXIT_CODE, False
  if isinstance(error, SystemExit):
    code = error.code if isinstance(error.code, int) else 1
    return f"error: {where} exited with status {error.code}", code, False
  if _GLOO_LATE_PEER in str(error):
    return (
        f"error: {where}: the processes' CPU collectives could not connect ({first_line}): "
        "another process reached its first collective more than 30 s (Gloo's limit) after this "
        "one, because the machine is heavily loaded or that process died or hangs: see its "
        f"log. {STARTUP_TIMEOUT_KEY} bounds the wait that keeps them together. {resume}",
        1,
        False,
    )
  import jax  # pylint: disable=import-outside-toplevel

  if isinstance(error, jax.errors.JaxRuntimeError) or _PEER_FAILURE.search(str(error)):
    return (
        f"error: {where}: a collective or device operation failed ({first_line}). Another "
        f"process has most likely died or been preempted: see its log. {resume}",
        1,
        True,
    )
  return (
      f"error: {where}: {type(error).__name__}: {first_line}. If another process failed first, "
      f"its log has the cause. {resume}",
      1,
      True,
  )


@contextlib.contextmanager
def exit_together(workdir_hint: str = "") -> Iterator[None]:
  """In a multi-process run, an error ends this process at once (`os._exit`) with one message:
  a normal exit would wait for peers blocked in a collective on it, which now fail too."""
  try:
    yield
  except BaseException as e:  # pylint: disable=broad-except
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_count() == 1 or (
        isinstance(e, SystemExit) and e.code in (0, None, SIGTERM_EXIT_CODE)  # A pre-emption.
    ):
      raise
    where = f"process {jax.process_index()} of {jax.process_count()}"
    resume = (
        "Restart all processes with the same command to resume from the latest checkpoint"
        + (f" in {workdir_hint}" if workdir_hint else "")
        + "."
    )
    message, code, with_traceback = describe_failure(e, where, resume)
    if with_traceback:
      traceback.print_exc()
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # pylint: disable=protected-access


def main_process_first(name: str, fn: Callable[[], T]) -> T:
  """`fn()` on process 0, then on the others (e.g. a tokenizer process 0 trains and saves);
  `name` labels the barrier every process must reach."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return fn()
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  result = fn() if jax.process_index() == 0 else None
  # On the barrier, not in a collective, which Gloo abandons after 30 s.
  wait_for_all_processes(name)
  multihost_utils.sync_global_devices(name)
  return result if jax.process_index() == 0 else fn()
