"""Whether a compiled step fits its devices' memory, checked before it runs: one line naming the
key to change, not RESOURCE_EXHAUSTED inside XLA (the step is compiled ahead for its FLOPs)."""

from __future__ import annotations

from typing import Any

import jax

from trainkit.config import host_memory_bytes
from trainkit.errors import UserError
from trainkit.prefetch import DEFAULT_PREFETCH, resident_batches
from trainkit.preflight.analysis import bytes_per_device, memory
from trainkit.throughput import compile_ahead


def device_memory_bytes(device: Any) -> int | None:
  """Memory one `device` may use: an accelerator's own limit, or on a CPU its share of the
  host's memory (the local CPU devices share it); None where neither is known."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Not every backend reports.
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if device.platform == "cpu":
    host = host_memory_bytes()
    return host // max(1, len(jax.local_devices(backend="cpu"))) if host else None
  return None


def _gib(n: float) -> str:
  return f"{n / 2**30:.1f} GiB"


def require_fits(
    compiled: Any,
    *,
    what: str,
    batch_key: str,
    batch_size: int,
    batch: Any = None,
    prefetch: int = DEFAULT_PREFETCH,
) -> None:
  """Raises UserError if the compiled step's peak per device, plus the `prefetch` batches like
  `batch` placed ahead of it, exceeds a device's memory. The message names `batch_key` when what
  grows with the batch outweighs the parameters and optimiser state, else the model's keys.
  """
  if compiled is None:
    return
  try:
    needed = memory(compiled)
  except Exception:  # pylint: disable=broad-except  # Memory analysis is best effort.
    return
  batch_bytes = min(bytes_per_device(batch), needed["arguments"]) if batch is not None else 0
  ahead = resident_batches(prefetch) - 1
  prefetched = ahead * batch_bytes
  peak = needed["peak"] + prefetched
  capacity = device_memory_bytes(jax.local_devices()[0])
  if capacity is None or peak <= capacity:
    return
  working = needed["peak"] - needed["arguments"]
  if working + batch_bytes + prefetched >= needed["arguments"] - batch_bytes:
    change = f"lower {batch_key} (now {batch_size})"
  else:
    change = "make the model smaller (its model.* keys, moe.num_experts)"
  beside = (
      f"{_gib(prefetched)} of the {ahead} batches prefetched ahead of it; " if prefetched else ""
  )
  raise UserError(
      f"the {what} needs {_gib(peak)} per device ({_gib(needed['arguments'])} of "
      f"parameters, optimiser state and batch; {beside}{_gib(working)} of temporaries and "
      f"outputs) but a device here has {_gib(capacity)}: {change}; --mode=compile estimates a "
      "run's memory without running it"
  )


def check_eval_step(eval_step: Any, state: Any, batch: Any, eval_batch_size: int) -> None:
  """`require_fits` for an evaluation's first batch (not prefetched)."""
  if hasattr(eval_step, "lower"):
    require_fits(
        compile_ahead(eval_step, state, batch),
        what="evaluation step",
        batch_key="eval_batch_size",
        batch_size=eval_batch_size,
        batch=batch,
        prefetch=0,
    )
