"""Reading an optimised HLO module's text: its matrix products and its collectives, per device.

What a compiled program does on each device is decided by the SPMD partitioner and is only
visible in the optimised HLO (`compiled.as_text()`): how many rows an expert matmul really
has, which collectives move which arrays, in which dtype. These readers let tests and the
preflight assert on that program, for any target XLA compiles for here (TPU: dots are often
`convolution`s; GPU: library GEMMs are `custom-call`s to cuBLAS).
"""

from __future__ import annotations

import dataclasses
import math
import re

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
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
# `%name = SHAPE op(` where SHAPE is one array or a tuple of them.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>[\w\-]+)\(")
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas\$[\w$]*gemm[\w$]*|__cublas\$lt\$matmul[\w$]*)"')


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's result: its element type and dimensions."""

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


def _instructions(hlo_text: str):
  """(line, op, result shape text) of every instruction of the module."""
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      yield line, match.group("op"), match.group("shape")


def matmul_results(hlo_text: str) -> list[Array]:
  """The result of every matrix product of the module (in fused computations too): `dot`,
  `convolution` (TPU lowers dots to it) and cuBLAS GEMM custom calls (GPU; their first result,
  the workspace left out)."""
  results = []
  for line, op, shape in _instructions(hlo_text):
    if op in ("dot", "convolution") or (op == "custom-call" and _GEMM_TARGET.search(line)):
      arrays = _arrays(shape)
      if arrays:
        results.append(arrays[0])
  return results


def _without_operands(shape_text: str) -> str:
  """An async `-start` whose shape is `((operands...), results...)` (GPU's all-to-all,
  reduce-scatter): the results alone."""
  text = shape_text.strip()
  if not text.startswith("(("):
    return text
  depth = 0
  for i, char in enumerate(text[1:], start=1):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[i + 1 :]
  return text


def collective_instructions(hlo_text: str) -> list[tuple[str, list[Array]]]:
  """Every collective instruction of the module: its kind and the arrays it produces on each
  device.

  A synchronous op, or the `-start` half of an asynchronous one, counts (`-done` never). An
  async start's operands are left out: where its shape is `((operands), results)` (GPU's
  all-to-all) the first group, and where it is `(operand, result)` (all-gather,
  collective-permute) all but the largest array. An all-reduce or all-to-all over several
  arrays returns all of them.
  """
  found = []
  for _, op, shape in _instructions(hlo_text):
    start = op.endswith("-start")
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVES:
      continue
    if start:
      shape = _without_operands(shape)
    arrays = _arrays(shape)
    if start and kind in ("all-gather", "collective-permute") and len(arrays) > 1:
      arrays = [max(arrays, key=lambda a: a.bytes)]
    found.append((kind, arrays))
  return found


def collective_results(hlo_text: str) -> dict[str, list[Array]]:
  """Per collective kind, the arrays its instructions produce on each device
  (`collective_instructions`)."""
  found: dict[str, list[Array]] = {}
  for kind, arrays in collective_instructions(hlo_text):
    found.setdefault(kind, []).extend(arrays)
  return found
