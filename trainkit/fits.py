"""Whether a compiled step fits the memory of the devices it will run on, checked before it runs.

The training loop and the evaluations compile their step ahead of time anyway (for its FLOPs,
`trainkit.throughput`), and the call that follows reuses that executable; its memory analysis is
therefore free. A step that cannot fit is refused with one line naming the key that makes it too
large, instead of an allocation failing inside XLA (RESOURCE_EXHAUSTED) or the host swapping.
"""

from __future__ import annotations

from typing import Any

import jax

from trainkit.config import host_memory_bytes
from trainkit.errors import UserError
from trainkit.preflight.analysis import memory
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


def _bytes_per_device(tree: Any) -> int:
  """Bytes of one device's share of the arrays of `tree` (their first addressable shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shards = getattr(leaf, "addressable_shards", None)
    total += int(shards[0].data.nbytes) if shards else int(getattr(leaf, "nbytes", 0))
  return total


def require_fits(
    compiled: Any, *, what: str, batch_key: str, batch_size: int, batch: Any = None
) -> None:
  """Raises UserError if the compiled step's peak memory per device exceeds a device's.

  The message names `batch_key` when what grows with the batch (the batch itself, the
  temporaries and outputs) outweighs the rest of the arguments (parameters, optimiser state),
  else the model's size keys.
  """
  if compiled is None:
    return
  try:
    needed = memory(compiled)
  except Exception:  # pylint: disable=broad-except  # Memory analysis is best effort.
    return
  capacity = device_memory_bytes(jax.local_devices()[0])
  if capacity is None or needed["peak"] <= capacity:
    return
  working = needed["peak"] - needed["arguments"]
  batch_bytes = min(_bytes_per_device(batch), needed["arguments"]) if batch is not None else 0
  if working + batch_bytes >= needed["arguments"] - batch_bytes:
    change = f"lower {batch_key} (now {batch_size})"
  else:
    change = "make the model smaller (its model.* keys, moe.num_experts)"
  raise UserError(
      f"the {what} needs {_gib(needed['peak'])} per device ({_gib(needed['arguments'])} of "
      f"parameters, optimiser state and batch; {_gib(working)} of temporaries and outputs) but a "
      f"device here has {_gib(capacity)}: {change}; --mode=compile estimates a run's memory "
      "without running it"
  )


def check_eval_step(eval_step: Any, state: Any, batch: Any, eval_batch_size: int) -> None:
  """`require_fits` for an evaluation's first batch (the step compiled here is the one its
  call then runs)."""
  if hasattr(eval_step, "lower"):
    require_fits(
        compile_ahead(eval_step, state, batch),
        what="evaluation step",
        batch_key="eval_batch_size",
        batch_size=eval_batch_size,
        batch=batch,
    )
