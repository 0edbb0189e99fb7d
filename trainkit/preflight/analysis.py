"""What a compiled program needs: memory per device, FLOPs, collectives, a step-time bound.

Everything here reads a program, never runs it: `compiled.memory_analysis()` and
`cost_analysis()` (XLA's, where the backend gives one: TPU yes, GPU no), the optimised HLO text
for the collectives, and the jaxpr for the project's own FLOP count (`matmul_flops`), which
needs no backend at all and so is the same for every target.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any

import jax
import jax.extend
import numpy as np

from trainkit.preflight import hlo

# --- Bytes of abstract values --------------------------------------------------------------


def bytes_per_device(tree: Any) -> int:
  """Bytes of one device's shard of every leaf of `tree` (ShapeDtypeStructs or arrays with a
  sharding; a leaf without one counts whole)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    total += math.prod(shape) * _itemsize(leaf.dtype)
  return total


def _itemsize(dtype: Any) -> int:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return 8  # A threefry key: two uint32.
  return np.dtype(dtype).itemsize


# --- Memory of a compiled program -----------------------------------------------------------


def memory(compiled: Any) -> dict[str, int]:
  """Per-device bytes of a compiled program: arguments, outputs, the donated part both share,
  temporaries, generated code, and the peak (arguments + outputs - aliased + temporaries)."""
  stats = compiled.memory_analysis()
  if isinstance(stats, (list, tuple)):
    stats = stats[0]
  argument = int(stats.argument_size_in_bytes)
  output = int(stats.output_size_in_bytes)
  alias = int(stats.alias_size_in_bytes)
  temp = int(stats.temp_size_in_bytes)
  peak = getattr(stats, "peak_memory_in_bytes", None)
  return {
      "arguments": argument,
      "outputs": output,
      "aliased": alias,
      "temporaries": temp,
      "generated_code": int(stats.generated_code_size_in_bytes),
      "peak": int(peak) if peak else argument + output - alias + temp,
  }


def cost(compiled: Any) -> dict[str, float] | None:
  """XLA's cost analysis of a compiled program (per device), or None where the backend has
  none (GPU)."""
  try:
    result = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # Unsupported on some backends.
    return None
  if isinstance(result, (list, tuple)):
    result = result[0] if result else None
  return dict(result) if result else None


def optimized_hlo_cost(compiled: Any) -> dict[str, float] | None:
  """XLA's HLO cost analysis of the program as the target's compiler optimised it (its
  fusions, its GEMM calls), evaluated with this host's CPU client; None where that fails.

  For a GPU, whose compiled program has no cost analysis of its own: the bytes it counts are
  each fusion's and kernel's operands and results, i.e. the traffic of the optimised program,
  where `memory` alone gives only a lower bound. It uses jaxlib's HLO bindings, which are not
  a public API, hence the fallback.
  """
  try:
    from jax._src.lib import hlo, xla_client  # pylint: disable=import-outside-toplevel

    module = _parse_hlo(hlo, compiled.as_text())
    client = jax.devices("cpu")[0].client
    result = xla_client._xla.hlo_module_cost_analysis(client, module)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except  # Private bindings: best effort.
    return None
  return {k: float(v) for k, v in result.items() if k in ("flops", "bytes accessed")} or None


_UNEXPECTED_ATTRIBUTE = re.compile(r'unexpected attribute "(?P<name>[a-z_]+)"')


def _parse_hlo(hlo: Any, text: str, attempts: int = 4) -> Any:
  """The HloModule of `text`. Where XLA's parser rejects an attribute its own printer wrote
  (jaxlib 0.12 prints `output_to_operand_aliasing` on a GPU's async all-reduce and cannot read
  it back), that attribute is dropped and the text parsed again: aliasing changes neither the
  FLOPs nor the bytes the cost analysis counts."""
  for _ in range(attempts):
    try:
      return hlo.hlo_module_from_text(text)
    except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError and kin.
      unexpected = _UNEXPECTED_ATTRIBUTE.search(str(e))
      if unexpected is None:
        raise
      text = _without_attribute(text, unexpected["name"])
  return hlo.hlo_module_from_text(text)


def _without_attribute(text: str, name: str) -> str:
  """`text` with every `, name={...}` (balanced braces) removed."""
  marker = f", {name}={{"
  pieces, position = [], 0
  while (start := text.find(marker, position)) >= 0:
    pieces.append(text[position:start])
    depth, i = 0, start + len(marker) - 1
    while i < len(text):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
      if depth == 0:
        break
    position = i
  return "".join(pieces) + text[position:]


# --- Collectives in the optimised HLO --------------------------------------------------------

def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """The collectives of an optimised HLO module: per kind, how many instructions and the bytes
  of their results, per device (`hlo.collective_instructions`: an async op counts once, by its
  results only)."""
  found: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for kind, arrays in hlo.collective_instructions(hlo_text):
    found[kind]["count"] += 1
    found[kind]["bytes"] += sum(a.bytes for a in arrays)
  return dict(sorted(found.items()))


# --- The project's own FLOP count ---------------------------------------------------------


def matmul_flops(closed_jaxpr: Any) -> dict[str, Any]:
  """FLOPs of the matrix products of a traced program, over all devices: 2 x multiply-adds of
  every dot_general, convolution and ragged_dot.

  Elementwise work is not counted (it is memory-bound; the byte count covers it). A shard_map
  body runs on every device of its manual axes, a scan body `length` times, a cond the branch
  with the most FLOPs. A while loop's trip count is not known before it runs: its body counts
  once, and `uncounted_loops` says how many such loops there were.
  """
  loops = [0]

  def count(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
      total += _eqn_flops(eqn, count, loops)
    return total

  flops = count(closed_jaxpr.jaxpr)
  return {"flops": flops, "uncounted_loops": loops[0]}


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
  found = []
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, jax.extend.core.Jaxpr):
        found.append(item)
  return found


def _eqn_flops(eqn: Any, count: Any, loops: list[int]) -> float:
  name = eqn.primitive.name
  params = eqn.params
  if name == "dot_general":
    (contracting, _), _ = params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    spec = params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    kernel = math.prod(rhs[d] for d in spec[1:])
    return 2.0 * math.prod(out) * kernel
  if name == "ragged_dot" or name == "ragged_dot_general":
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2.0 * math.prod(out) * lhs[-1]
  subs = _sub_jaxprs(params)
  if not subs:
    return 0.0
  if name == "cond":
    return max(count(j) for j in subs)
  inner = sum(count(j) for j in subs)
  if name == "scan":
    return inner * params["length"]
  if name == "while":
    loops[0] += 1
    return inner
  if name == "shard_map":
    mesh = params["mesh"]
    axes = params.get("manual_axes") or params.get("axis_names") or mesh.axis_names
    return inner * math.prod(mesh.shape[a] for a in axes)
  return inner


# --- Step time ------------------------------------------------------------------------------


def roofline_seconds(flops: float, bytes_accessed: float, peak_flops: float, bandwidth: float):
  """The step's lower bound on one device: compute time or memory time, whichever is longer."""
  compute = flops / peak_flops
  memory_time = bytes_accessed / bandwidth
  return {
      "compute_s": compute,
      "memory_s": memory_time,
      "bound_s": max(compute, memory_time),
      "bound_by": "compute" if compute >= memory_time else "memory",
  }
