"""Reading an optimised, SPMD-partitioned HLO module's text (`compiled.as_text()`), per device:
matrix products, library calls (GPU `custom-call`s) and collectives with their device groups."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Any

import numpy as np

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_DTYPE_BYTES = {
    **dict.fromkeys(("pred", "s8", "u8", "f8e4m3fn", "f8e5m2"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
# `%name = SHAPE op(` where SHAPE is one array or a tuple of them.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>[\w\-]+)\(")
_GEMM_TARGET = re.compile(
    r'custom_call_target="(__cublas\$[\w$]*gemm[\w$]*|__cublas\$lt\$matmul[\w$]*)"'
)


@dataclasses.dataclass(frozen=True)
class Array:

  dtype: str
  dims: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> int:
    return self.size * _DTYPE_BYTES[self.dtype]


def _arrays(shape_text: str) -> list[Array]:
  return [
      Array(dtype, tuple(int(d) for d in dims.split(",") if d))
      for dtype, dims in _ARRAY.findall(shape_text)
      if dtype in _DTYPE_BYTES
  ]


def matmul_results(hlo_text: str) -> list[Array]:
  """The result of every `dot`, `convolution` (TPU lowers dots to it) and cuBLAS GEMM (its first
  result, not the workspace) of the module, fused computations included."""
  instructions, _ = _module(hlo_text)
  return [
      _arrays(ins.shape)[0]
      for ins in instructions
      if (
          ins.op in ("dot", "convolution")
          or (ins.op == "custom-call" and _GEMM_TARGET.search(ins.line))
      )
      and _arrays(ins.shape)
  ]


def collective_results(hlo_text: str) -> dict[str, list[Array]]:
  """Per collective kind, the arrays its instructions produce on each device."""
  found: dict[str, list[Array]] = {}
  for c in collectives_with_groups(hlo_text):
    found.setdefault(c.kind, []).extend(c.arrays)
  return found


# A computation's header: `%name (params...) -> shape {` (`ENTRY %name ...` for the entry).
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(?P<attr>condition|body|calls|to_apply|true_computation|false_computation)=%(?P<name>[\w.\-]+)"
)
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
# `"known_trip_count":{"n":"3"}` in a while's backend_config (jaxlib 0.10 to 0.12).
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class _Instruction:
  computation: str
  line: str
  op: str
  shape: str
  name: str
  operands_at: int  # Where the operand list starts in `line` (after `op(`).
  frame: int = 0  # Its metadata's `stack_frame_id` (`call_stacks`); 0: none.


def _module(hlo_text: str) -> tuple[list[_Instruction], str | None]:
  """Every instruction of the module with its computation, and the entry computation's name."""
  found, computation, entry = [], "", None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header["name"]
      if header["entry"]:
        entry = computation
      continue
    match = _INSTRUCTION.match(line)
    if match:
      name = line.split("=", 1)[0].split("%", 1)[1].strip()
      at, frame = match.end(), int(m[1]) if (m := _FRAME_ID.search(line)) else 0
      found.append(_Instruction(computation, line, match["op"], match["shape"], name, at, frame))
  return _with_frames(found), entry


_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")


def _with_frames(instructions: list[_Instruction]) -> list[_Instruction]:
  """The instructions, each with a stack frame where XLA left it none (a fusion of ops traced in
  different places, layout copies, some library calls and async ops): a fusion or async op and
  its computation's ops take that computation's root's (printed last), else its last op's, else
  the caller's; any other op the first its operands' makers have."""
  calls = lambda i: next(_CALLED.finditer(i.line[i.operands_at :]), None)  # noqa: E731
  callers = {
      c["name"]: i.name
      for i in instructions
      if i.op in ("fusion", "async-start") and (c := calls(i))
  }
  roots: dict[str, int] = {}
  for ins in reversed(instructions):
    if ins.frame and ins.computation in callers:
      roots.setdefault(ins.computation, ins.frame)
  by_name = {ins.name: ins for ins in instructions}

  @functools.cache
  def frame(name: str, depth: int = 0) -> int:
    ins = by_name[name]
    body = calls(ins) if ins.op in ("fusion", "async-start") else None
    found = ins.frame or roots.get(ins.computation) or (body and roots.get(body["name"]))
    if found or depth > 16:
      return found or 0
    makers = [callers.get(ins.computation, "")]
    makers += _operand_names(ins)
    return next((f for m in makers if m in by_name and (f := frame(m, depth + 1))), 0)

  return [i if i.frame else dataclasses.replace(i, frame=frame(i.name)) for i in instructions]


def call_stacks(hlo_text: str) -> dict[int, tuple[str, ...]]:
  """Per `stack_frame_id` of the module's metadata, the Python frames that traced the op as
  `file:function`, innermost first, read from its `FileNames`, `FunctionNames`, `FileLocations`
  and `StackFrames` tables ({} where it prints none)."""
  tables: dict[str, dict[int, str]] = {}
  rows: dict[int, str] = {}
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      rows = tables.setdefault(line, {})
    elif row := re.match(r"(\d+) (.*)$", line):  # Only these tables' rows start with a digit.
      rows[int(row[1])] = row[2].strip('"')
  ids = lambda text: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}  # noqa: E731
  places = {i: ids(text) for i, text in tables.get("FileLocations", {}).items()}
  frames = {i: ids(text) for i, text in tables.get("StackFrames", {}).items()}
  stacks: dict[int, tuple[str, ...]] = {}
  for i in frames:
    stack, at = [], i
    # jaxlib 0.10 to 0.12 print the id of a frame's parent plus one (1: no parent).
    while at in frames and len(stack) < len(frames):
      place = places[frames[at]["file_location_id"]]
      file, function = place["file_name_id"], place["function_name_id"]
      stack.append(f"{tables['FileNames'][file]}:{tables['FunctionNames'][function]}")
      at = frames[at]["parent_frame_id"] - 1
    stacks[i] = tuple(stack)
  return stacks


def _executions(instructions: list[_Instruction], entry: str | None) -> dict[str, tuple[int, bool]]:
  """Per computation: runs per execution of the module (a while body `known_trip_count` times,
  others as often as their caller; both branches of a conditional), and whether a while loop of
  unknown trip count encloses it (then counted once)."""
  callers: dict[str, list[tuple[str, int, bool]]] = {}
  for ins in instructions:
    attributes = ins.line[ins.operands_at :]
    called = [(m["attr"], m["name"]) for m in _CALLED.finditer(attributes)]
    for listed in _CALLED_LIST.finditer(attributes):
      called += [("calls", n.strip().lstrip("%")) for n in listed["names"].split(",") if n.strip()]
    trip = _TRIP_COUNT.search(attributes) if ins.op == "while" else None
    for attribute, name in called:
      loop = ins.op == "while" and attribute in ("body", "condition")
      times = int(trip.group(1)) if loop and trip else 1
      callers.setdefault(name, []).append((ins.computation, times, loop and trip is None))

  @functools.cache
  def count(name: str) -> tuple[int, bool]:
    if name == entry or entry is None or name not in callers:
      return (1, False)  # The entry, or called through an attribute not read here: once.
    total, unknown = 0, False
    for caller, times, unknown_here in callers[name]:
      n, u = count(caller)
      total += n * times
      unknown = unknown or u or (unknown_here and n > 0)
    return total, unknown

  return {ins.computation: count(ins.computation) for ins in instructions}


def _operand_list(line: str, start: int) -> list[str]:
  """The operands of an instruction (`%a, %b` or `f32[4]{0} %a, ...`), top-level commas only."""
  depth, token, tokens = 0, [], []
  for char in line[start:]:
    if char in "([{":
      depth += 1
    elif char in ")]}":
      if depth == 0:
        break
      depth -= 1
    if char == "," and depth == 0:
      tokens.append("".join(token))
      token = []
    else:
      token.append(char)
  tokens.append("".join(token))
  return [t.strip() for t in tokens if t.strip()]


def _operand_names(ins: _Instruction) -> list[str]:
  return [t.split("%")[-1] for t in _operand_list(ins.line, ins.operands_at)]


def _operand_arrays(ins: _Instruction, shapes: dict[str, str]) -> list[Array]:
  arrays = []
  for token in _operand_list(ins.line, ins.operands_at):
    name = re.search(r"%([\w.\-]+)\s*$", token)
    written = token[: name.start()] if name else token
    arrays += _arrays(
        written if _ARRAY.search(written) else shapes.get(name[1] if name else "", "")
    )
  return arrays


def _backend_config(line: str) -> dict[str, Any]:
  """An instruction's backend_config: JSON, printed bare or as a quoted string."""
  at = line.find("backend_config=")
  if at < 0:
    return {}
  text = line[at + len("backend_config=") :]
  try:
    if text.startswith('"'):
      text, _ = json.JSONDecoder().raw_decode(text)
    value, _ = json.JSONDecoder().raw_decode(text)
  except ValueError:
    return {}
  return value if isinstance(value, dict) else {}


_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")


@dataclasses.dataclass(frozen=True)
class LibraryCall:
  """One `custom-call` (cuBLAS GEMM, cuDNN convolution, other), which XLA's cost analysis does
  not count; `workspace` (a tuple's last 1-D `u8`/`s8` result) is not traffic."""

  target: str
  kind: str
  operands: tuple[Array, ...]
  results: tuple[Array, ...]
  workspace: int
  flops: float | None
  executions: int = 1
  in_unknown_loop: bool = False
  frame: int = 0  # `call_stacks`' id of the frames that traced it.

  @property
  def bytes(self) -> int:
    """Bytes read and written by one execution: operands and results, workspace left out."""
    return sum(a.bytes for a in self.operands) + sum(a.bytes for a in self.results)


def _gemm_flops(line: str, operands: list[Array], results: list[Array]) -> float | None:
  """2 x (result elements) x (lhs contracting elements), from the GEMM's backend_config."""
  config = _backend_config(line).get("gemm_backend_config", {})
  contracting = config.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions")
  if contracting is None or not operands or not results:
    return None
  lhs = operands[0]
  return 2.0 * results[0].size * math.prod(lhs.dims[int(d)] for d in contracting)


def _convolution_flops(
    line: str, target: str, operands: list[Array], results: list[Array]
) -> float | None:
  """2 x (forward output elements) x (kernel elements per output feature), grouped ones too;
  cuDNN's calls carry the forward dimension labels whatever their direction."""
  labels = _DIM_LABELS.search(line)
  if labels is None or len(operands) < 2 or not results:
    return None
  if "BackwardInput" in target:
    kernel, output = operands[1], operands[0]
  elif "BackwardFilter" in target:
    kernel, output = results[0], operands[1]
  else:
    kernel, output = operands[1], results[0]
  rhs = labels["rhs"]
  if "o" not in rhs or len(rhs) != len(kernel.dims):
    return None
  return 2.0 * output.size * kernel.size / kernel.dims[rhs.index("o")]


def library_calls(hlo_text: str) -> list[LibraryCall]:
  """Every `custom-call` of an optimised module: operands (looked up by their unique names),
  results (workspace apart), FLOPs (GEMMs and convolutions) and runs (`_executions`)."""
  instructions, entry = _module(hlo_text)
  shapes = {ins.name: ins.shape for ins in instructions}
  runs = _executions(instructions, entry)
  found = []
  for ins in instructions:
    if ins.op != "custom-call":
      continue
    target_match = _TARGET.search(ins.line)
    target = target_match["target"] if target_match else ""
    results = _arrays(ins.shape)
    workspace = 0
    if ins.shape.lstrip().startswith("(") and len(results) > 1:
      last = results[-1]
      if last.dtype in ("u8", "s8") and len(last.dims) == 1:
        workspace = last.bytes
        results = results[:-1]
    operands = _operand_arrays(ins, shapes)
    if target.startswith("__cublas$"):
      kind, flops = "gemm", _gemm_flops(ins.line, operands, results)
    elif target.startswith("__cudnn$conv"):
      kind, flops = "convolution", _convolution_flops(ins.line, target, operands, results)
    else:
      kind, flops = "other", None
    executions, unknown = runs.get(ins.computation, (1, False))
    call = (target, kind, tuple(operands), tuple(results), workspace, flops, executions, unknown)
    found.append(LibraryCall(*call, ins.frame))
  return found


_REPLICA_GROUPS = re.compile(
    r"replica_groups=(?P<groups>\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?[^()]*)\))?"
    r"\s*\{(?P<group>[^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[{}\d,\s]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective (an async op by its `-start`): its results per device, groups of HLO device
  ids (None: all devices), a collective-permute's pairs, and runs per module execution."""

  kind: str
  arrays: tuple[Array, ...]
  groups: tuple[tuple[int, ...], ...] | None
  pairs: tuple[tuple[int, int], ...] = ()
  executions: int = 1


def _iota(text: str) -> np.ndarray:
  """XLA's iota tile form `[shape]<=[dims]T(perm)`: iota over dims, transposed, reshaped."""
  shape_text, rest = text.split("<=")
  dims_text, _, perm_text = rest.partition("T")
  shape = [int(d) for d in shape_text.strip("[] ").split(",")]
  dims = [int(d) for d in dims_text.strip("[] ").split(",")]
  perm = (
      [int(p) for p in perm_text.strip("() ").split(",")] if perm_text else list(range(len(dims)))
  )
  return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape)


def _mesh_axes_groups(match: re.Match) -> tuple[tuple[int, ...], ...] | None:
  """XLA's mesh-axes form (jaxlib 0.12, `mesh['a'=2,'b'=8] {'b'}`, optional `device_ids=` and
  sub-axes): a group is the devices that differ only along the group's axes."""
  axes = [
      (name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", match["axes"])
  ]
  if not axes:
    return None
  sizes = [size for _, size in axes]
  ids_text = (match["ids"] or "").strip()
  if "<=" in ids_text:
    ids = _iota(ids_text)
  elif re.fullmatch(r"\[[\d,\s]+\](?:T\([\d,\s]+\))?", ids_text):
    # An iota's reshape dims and transpose without the shape (libtpu): `[4,2]T(1,0)`.
    ids = _iota(f"[{math.prod(sizes)}]<={ids_text}")
  elif ids_text:
    ids = np.array([int(i) for i in re.findall(r"\d+", ids_text)])
  else:
    ids = np.arange(math.prod(sizes))
  if ids.size != math.prod(sizes):
    return None
  ids = ids.reshape(sizes)
  names = [name for name, _ in axes]
  refs: dict[int, list[tuple[int, int]]] = {}
  for name, pre, size in re.findall(r"'?([^',:\s(){}]+)'?(?::\((\d+)\)(\d+))?", match["group"]):
    if name not in names:
      return None
    axis = names.index(name)
    refs.setdefault(axis, []).append((int(pre), int(size)) if pre else (1, sizes[axis]))
  # Each axis as factors, major to minor; a sub-axis (pre)size is the factor after `pre`.
  factors, grouped = [], []
  for axis, size in enumerate(sizes):
    done = 1
    for pre, part in sorted(refs.get(axis, [])):
      if pre > done:
        factors.append(pre // done)
        grouped.append(False)
      factors.append(part)
      grouped.append(True)
      done = pre * part
    if size // done > 1 or not refs.get(axis):
      factors.append(size // done)
      grouped.append(False)
  if math.prod(factors) != ids.size:
    return None
  order = [i for i, g in enumerate(grouped) if not g] + [i for i, g in enumerate(grouped) if g]
  group_size = math.prod(f for f, g in zip(factors, grouped) if g)
  rows = ids.reshape(factors).transpose(order).reshape(-1, group_size)
  return tuple(tuple(int(i) for i in row) for row in rows)


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
  """An instruction's `replica_groups` (explicit `{{0,1},{2,3}}`, iota `[G,S]<=[dims]T(perm)` or
  mesh-axes form); None where absent, empty (all devices) or not understood."""
  mesh = _MESH_GROUPS.search(line)
  if mesh is not None:
    return _mesh_axes_groups(mesh)
  match = _REPLICA_GROUPS.search(line)
  if match is None:
    return None
  text = match["groups"]
  if text.startswith("["):
    return tuple(tuple(int(i) for i in row) for row in _iota(text))
  groups = tuple(
      tuple(int(i) for i in g.split(",") if i.strip())
      for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])
  )
  groups = tuple(g for g in groups if g)
  return groups or None


def collectives_with_groups(hlo_text: str) -> list[Collective]:
  """Every collective of the module, with its device groups and runs; an async `-start`'s
  operands are left out."""
  instructions, entry = _module(hlo_text)
  runs = _executions(instructions, entry)
  found = []
  for ins in instructions:
    start = ins.op.endswith("-start")
    kind = ins.op.removesuffix("-start")
    if kind not in COLLECTIVES:
      continue
    shape = ins.shape.strip()
    if start and shape.startswith("(("):  # An async start's ((operands...), results...).
      shape = ",".join(_operand_list(shape, 1)[1:])
    arrays = _arrays(shape)
    if start and kind in ("all-gather", "collective-permute") and len(arrays) > 1:
      arrays = [max(arrays, key=lambda a: a.bytes)]
    pairs = ()
    pair_match = _PAIRS.search(ins.line)
    if pair_match:
      pairs = tuple(
          (int(a), int(b))
          for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", pair_match["pairs"])
      )
    executions, _ = runs.get(ins.computation, (1, False))
    found.append(Collective(kind, tuple(arrays), replica_groups(ins.line), pairs, executions))
  return found
