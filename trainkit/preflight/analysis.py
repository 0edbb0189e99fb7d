"""What a compiled program needs, read without running it: memory per device, XLA's cost
analysis (TPU), the optimised HLO's collectives and library calls (GPU), the jaxpr's FLOPs."""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator, Sequence
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
    total += math.prod(shape) * leaf.dtype.itemsize  # A PRNG key's dtype has one too.
  return total


# --- Memory of a compiled program -----------------------------------------------------------


def memory(compiled: Any) -> dict[str, int]:
  """Per-device bytes of a compiled program: arguments, outputs, the donated part both share,
  temporaries, generated code, and the peak (arguments + outputs - aliased + temporaries)."""
  stats = compiled.memory_analysis()
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
  return compiled.cost_analysis() or None


# Ops XLA's HLO cost analysis counts one FLOP per element of their result (its transcendental
# ones, exp, tanh, ..., are counted apart and are not FLOPs), and ops that move no data.
_ELEMENTWISE = frozenset((
    "abs", "add", "and", "clamp", "compare", "convert", "divide", "floor", "ceil", "maximum",
    "minimum", "multiply", "negate", "not", "or", "remainder", "round-nearest-afz",
    "round-nearest-even", "select", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "sign", "subtract", "xor", "is-finite",
))  # fmt: skip
_NO_TRAFFIC = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "custom-call", "async-start",
    "async-update", "async-done",
))  # fmt: skip
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def optimized_hlo_cost(hlo_text: str) -> dict[str, float] | None:
  """XLA's HLO cost analysis of an optimised module (a GPU compiler gives none), counted from its
  text: the bytes each kernel (a fusion, an unfused op) reads and writes, its operands and
  results, and the FLOPs of its ops, 2 per multiply-add of a dot or convolution, one per result
  element of an elementwise op and per element a reduction folds. Library calls are
  `library_call_cost`'s. Loops count their known trip count. None for a module without
  instructions."""
  costs = list(_instruction_costs(hlo_text))
  flops, traffic = (sum(c[k] for c in costs) for k in (1, 2))
  return {"flops": flops, "bytes accessed": traffic} if costs else None


def _instruction_costs(hlo_text: str) -> Iterator[tuple[Any, float, float]]:
  """(instruction, FLOPs, bytes) of every instruction, as `optimized_hlo_cost` counts them."""
  instructions, entry = hlo._module(hlo_text)
  shapes = {ins.name: ins.shape for ins in instructions}
  runs = hlo._executions(instructions, entry)

  def called(attribute: str, op: str | None = None) -> set[str]:
    return {
        m["name"]
        for ins in instructions
        if op in (None, ins.op)
        for m in hlo._CALLED.finditer(ins.line[ins.operands_at :])
        if m["attr"] == attribute
    }

  fused, reducers = called("calls", "fusion"), called("to_apply")
  reducer_flops = collections.Counter(i.computation for i in instructions if i.op in _ELEMENTWISE)
  users: dict[str, list[tuple[Any, int]]] = collections.defaultdict(list)
  parameters, roots = {}, {}
  for ins in instructions:
    if ins.computation in fused:
      for index, name in enumerate(hlo._operand_names(ins)):
        users[name].append((ins, index))
      if ins.op == "parameter":
        parameters[ins.computation, int(ins.line[ins.operands_at :].split(")")[0])] = ins.name
      if ins.line.lstrip().startswith("ROOT"):
        roots[ins.computation] = ins
  for ins in instructions:
    if ins.computation in reducers:
      continue  # Counted by the op that applies it.
    callee = next(hlo._CALLED.finditer(ins.line[ins.operands_at :]), None)
    results, operands = hlo._arrays(ins.shape), hlo._operand_arrays(ins, shapes)
    executions = runs.get(ins.computation, (1, False))[0]
    flops = traffic = 0.0
    if ins.op == "fusion" and ins.computation not in fused:
      body = callee["name"]
      root = roots.get(body)
      if root is not None and root.op == "dynamic-update-slice":  # In place: the update written.
        results = hlo._arrays(shapes[hlo._operand_names(root)[1]])
      operands = [
          _read_bytes(parameters.get((body, i)), users, shapes) for i in range(len(operands))
      ]
      traffic = executions * (sum(operands) + sum(a.bytes for a in results))
    elif ins.op in ("copy-start", "copy-done", "slice-start", "slice-done"):
      # A TPU's asynchronous copy or slice: its result read and written once (at its -done).
      traffic = executions * 2 * sum(a.bytes for a in results) * ins.op.endswith("-done")
    elif ins.computation not in fused and ins.op not in _NO_TRAFFIC:
      traffic = executions * sum(a.bytes for a in operands + results)
    if ins.op in _ELEMENTWISE and results:
      flops = executions * results[0].size
    elif ins.op == "dot" and operands and results:
      contracting = _CONTRACTING.search(ins.line)
      dims = [int(d) for d in contracting[1].split(",") if d] if contracting else []
      flops = executions * 2.0 * results[0].size * math.prod(operands[0].dims[d] for d in dims)
    elif ins.op == "convolution" and len(operands) > 1 and results:  # Also a TPU's dots.
      flops = executions * _convolution_flops(ins.line, *operands[:2], results[0])
    elif ins.op == "reduce" and operands and results:
      per_element = reducer_flops[callee["name"]] if callee else 1
      flops = executions * (operands[0].size - results[0].size) * max(1, per_element)
    yield ins, flops, traffic


def _convolution_flops(line: str, lhs: hlo.Array, kernel: hlo.Array, result: hlo.Array) -> float:
  """2 x result elements x input features x the window's taps that meet an input element, on
  average over the output (padding and the holes of `lhs_dilate` meet none: a TPU's batched dot
  is such a convolution)."""
  labels, window = hlo._DIM_LABELS.search(line), re.search(r"window=\{([^}]*)\}", line)
  if labels is None or len(labels["rhs"]) != len(kernel.dims) or "i" not in labels["rhs"]:
    return 0.0
  fields = dict(f.split("=", 1) for f in window[1].split()) if window else {}
  get = lambda key, axis, default: (  # noqa: E731
      int(fields[key].split("x")[axis].split("_")[0]) if key in fields else default
  )
  taps = 1.0
  for axis in range(len(fields["size"].split("x")) if "size" in fields else 0):
    n, m = lhs.dims[labels["lhs"].index(str(axis))], result.dims[labels["out"].index(str(axis))]
    w, s, d, r = (get(k, axis, 1) for k in ("size", "stride", "lhs_dilate", "rhs_dilate"))
    at = np.arange(m)[:, None] * s + np.arange(w)[None, :] * r - get("pad", axis, 0)
    taps *= int(np.count_nonzero((at >= 0) & (at <= (n - 1) * d) & (at % d == 0))) / max(m, 1)
  return 2.0 * result.size * kernel.dims[labels["rhs"].index("i")] * taps


def _read_bytes(name: str | None, users: dict[str, list], shapes: dict[str, str]) -> int:
  """Bytes a fusion reads of its parameter `name`: what a (dynamic) slice takes of it, nothing
  where a dynamic-update-slice updates it in place, else the whole of it (once)."""
  size, whole = 0, False
  for user, index in users.get(name, []):
    if user.op == "slice" or (user.op == "dynamic-slice" and index == 0):
      size += sum(a.bytes for a in hlo._arrays(user.shape))
    elif not (user.op == "dynamic-update-slice" and index == 0) and not whole:
      whole = True
      size += sum(a.bytes for a in hlo._arrays(shapes.get(name, "")))
  return size


# The step's parts: an op belongs to the first part one of the frames that traced it names
# (`file:function`, innermost first); collectives by their op, the rest is "other".
PARTS = (
    ("attention", re.compile(r"[Aa]ttention")),
    ("MoE block", re.compile(r"/moe/|MoE\b")),
    ("MLPs", re.compile(r":(Mlp|MLP)\.")),
    ("norms", re.compile(r":\w*Norm\.|/normalization\.py:")),
    ("optimizer update", re.compile(r"/optax/(?!losses/)|/trainkit/optim\.py:")),
)


def cost_by_part(hlo_text: str, library_calls: bool = True) -> dict[str, dict[str, float]]:
  """An optimised module's FLOPs and bytes (`optimized_hlo_cost`, and `library_call_cost` where
  `library_calls`: a GPU's) split by the part of the step each op belongs to (`PARTS`,
  "collectives", "other"), read from the Python call stacks XLA keeps in their metadata. A fusion
  counts whole in its root op's part."""
  stacks = hlo.call_stacks(hlo_text)
  names = [name for name, _ in PARTS] + ["collectives", "other"]
  parts = {name: {"flops": 0.0, "bytes accessed": 0.0} for name in names}

  def part(op: str, frame: int) -> str:
    if op.removesuffix("-start").removesuffix("-done") in hlo.COLLECTIVES:
      return "collectives"
    places = stacks.get(frame, ())
    return next((n for place in places for n, pattern in PARTS if pattern.search(place)), "other")

  costs = [(part(i.op, i.frame), f, b) for i, f, b in _instruction_costs(hlo_text)]
  costs += [
      (part("custom-call", c.frame), (c.flops or 0.0) * c.executions, c.bytes * c.executions)
      for c in (hlo.library_calls(hlo_text) if library_calls else ())
  ]
  for name, flops, traffic in costs:
    parts[name]["flops"] += flops
    parts[name]["bytes accessed"] += traffic
  return parts


# --- Library calls of a GPU program ----------------------------------------------------------


def library_call_cost(hlo_text: str) -> dict[str, Any]:
  """What the library calls of an optimised GPU module (`hlo.library_calls`) read, write and
  compute, per device and per execution of the module: bytes without the scratch workspace
  (`workspace_bytes` apart), FLOPs of GEMMs and convolutions (`without_flops`: the others)."""
  calls = hlo.library_calls(hlo_text)
  return {
      "count": len(calls),
      "executions": sum(c.executions for c in calls),
      "bytes": sum(c.bytes * c.executions for c in calls),
      "flops": sum((c.flops or 0.0) * c.executions for c in calls),
      "workspace_bytes": sum(c.workspace * c.executions for c in calls),
      "without_flops": sum(c.flops is None for c in calls),
      "in_loops_of_unknown_trip_count": sum(c.in_unknown_loop for c in calls),
  }


def with_library_calls(hlo_cost: dict[str, float], library: dict[str, Any]) -> dict[str, Any]:
  """A GPU program's FLOPs and bytes: the fusions' (`optimized_hlo_cost`) plus the library
  calls' (`library_call_cost`), and the two parts."""
  fusions = {k: hlo_cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  calls = {"flops": float(library["flops"]), "bytes accessed": float(library["bytes"])}
  return {
      "flops": fusions["flops"] + calls["flops"],
      "bytes accessed": fusions["bytes accessed"] + calls["bytes accessed"],
      "fusions": fusions,
      "library_calls": calls,
  }


# --- Collectives in the optimised HLO --------------------------------------------------------


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Per collective kind of an optimised HLO module: how many instructions and the bytes of
  their results, per device (an async op counts once, by its results)."""
  found: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for op in hlo.collectives_with_groups(hlo_text):
    found[op.kind]["count"] += 1
    found[op.kind]["bytes"] += sum(a.bytes for a in op.arrays)
  return dict(sorted(found.items()))


def ring_factor(kind: str, n: int) -> float:
  """Bytes one device sends in a ring algorithm over n devices, per byte of the collective's
  result on that device: all-reduce 2(n-1)/n (reduce-scatter then all-gather of the result);
  all-gather (n-1)/n of the gathered result; reduce-scatter (n-1)/n of its input, which is n
  results, so n-1; all-to-all (n-1)/n (each device keeps 1/n of its data); collective-permute
  and collective-broadcast the result once."""
  if n <= 1:
    return 0.0
  return {
      "all-reduce": 2 * (n - 1) / n,
      "all-gather": (n - 1) / n,
      "reduce-scatter": float(n - 1),
      "all-to-all": (n - 1) / n,
      "ragged-all-to-all": (n - 1) / n,  # Priced on its output buffer, an upper bound.
      "collective-permute": 1.0,
      "collective-broadcast": 1.0,
  }[kind]


def collective_seconds(
    hlo_text: str, hosts: Sequence[int], bandwidth: float, inter_host_bandwidth: float
) -> dict[str, Any] | None:
  """The collectives of an optimised module priced with a ring model: the bytes each device
  sends (`ring_factor` over its group's size x result bytes x executions) at the interconnect's
  rate, the inter-host one where a group spans hosts (`hosts[i]`: the host of HLO device i).
  A lower bound (no latency, no algorithm choice); None without an interconnect figure."""
  if bandwidth <= 0:
    return None
  one_host = len(set(hosts)) <= 1

  def spans(ids: Sequence[int]) -> bool:
    if one_host:
      return False
    if any(not 0 <= i < len(hosts) for i in ids):
      return True  # An id outside the assignment: assume the slower network.
    return len({hosts[i] for i in ids}) > 1

  by_kind: dict[str, dict[str, Any]] = {}
  total = 0.0
  for op in hlo.collectives_with_groups(hlo_text):
    if op.kind == "collective-permute":
      moving = [p for p in op.pairs if p[0] != p[1]]
      n, across = (2 if moving else 1), any(spans(p) for p in moving)
    else:
      groups = op.groups or (tuple(range(len(hosts))),)
      n, across = max(len(g) for g in groups), any(spans(g) for g in groups)
    sent = ring_factor(op.kind, n) * sum(a.bytes for a in op.arrays) * op.executions
    seconds = sent / (inter_host_bandwidth if across else bandwidth)
    total += seconds
    entry = by_kind.setdefault(
        op.kind, {"seconds": 0.0, "bytes_sent": 0.0, "group_sizes": [], "across_hosts": 0}
    )
    entry["seconds"] += seconds
    entry["bytes_sent"] += sent
    entry["across_hosts"] += int(across)
    if n not in entry["group_sizes"]:
      entry["group_sizes"] = sorted(entry["group_sizes"] + [n])
  return {
      "seconds": total,
      "bandwidth": bandwidth,
      "inter_host_bandwidth": inter_host_bandwidth,
      "model": "ring: all-reduce 2(n-1)/n, all-gather and all-to-all (n-1)/n of the result, "
      "reduce-scatter (n-1) x the result, permute 1x; n from the HLO's replica_groups",
      "by_kind": dict(sorted(by_kind.items())),
  }


# --- The project's own FLOP count ---------------------------------------------------------


def matmul_flops(closed_jaxpr: Any) -> dict[str, Any]:
  """FLOPs (2 x multiply-adds) of every dot_general, convolution and ragged_dot of a traced
  program, over all devices: a shard_map body on each device of its manual axes, a scan body
  `length` times, a cond's costliest branch, a while body once (`uncounted_loops`)."""
  loops = 0

  def count(jaxpr: Any) -> float:
    return sum((eqn_flops(eqn) for eqn in jaxpr.eqns), 0.0)

  def eqn_flops(eqn: Any) -> float:
    nonlocal loops
    name, params = eqn.primitive.name, eqn.params
    if name in ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"):
      lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
      out = math.prod(eqn.outvars[0].aval.shape)
      if name == "dot_general":
        (contracting, _), _ = params["dimension_numbers"]
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
      if name == "conv_general_dilated":
        spec = params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        return 2.0 * out * math.prod(rhs[d] for d in spec[1:])
      return 2.0 * out * lhs[-1]
    subs = list(jax.extend.core.jaxprs_in_params(params))
    if not subs:
      return 0.0
    if name == "cond":
      return max(count(j) for j in subs)
    inner = sum(count(j) for j in subs)
    if name == "scan":
      return inner * params["length"]
    if name == "while":
      loops += 1
      return inner
    if name == "shard_map":
      mesh = params["mesh"]
      axes = params.get("manual_axes") or params.get("axis_names") or mesh.axis_names
      return inner * math.prod(mesh.shape[a] for a in axes)
    return inner

  flops = count(closed_jaxpr.jaxpr)
  return {"flops": flops, "uncounted_loops": loops}


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
