"""Grouped GEMMs on a GPU that visit only each expert's rows: tokamax's `ragged_dot_general`.

XLA's GPU compiler lowers `jax.lax.ragged_dot_general` densely over the groups (E times the
FLOPs: `bf16[12608,24576] x [24576,1536]` at E=64). Where tokamax is installed (the `gpu` extra),
`ragged_dot_general` lowered for CUDA runs tokamax's Mosaic GPU kernels (Hopper and Blackwell; the
forward, the transposed-weight and the ragged-contraction forms); on other platforms, and where
tokamax has no kernel for the operands or device (its NotImplementedError), `jax.lax`'s.

tokamax picks its kernel by the default device when traced: a deviceless compile on a CPU host
traces under `jax.default_device(<the target's GPU device>)` (tests/fairmoe_jax/test_grouped_gemm.py).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax
from absl import flags


@functools.cache
def _tokamax() -> Any:
  try:
    tokamax = importlib.import_module("tokamax")
  except ImportError:
    return None
  # tokamax before 0.0.17 (jax < 0.11) parses sys.argv as absl flags on first use, which fails
  # on any other program's arguments (pytest's, argparse's); its flags keep their defaults.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def tokamax_ragged_dot_general(*args: Any, **kwargs: Any) -> jax.Array:
  """`tokamax.ragged_dot_general` by its Mosaic GPU kernel where the default device is a GPU it
  has one for, else by its XLA one."""
  return _tokamax().ragged_dot_general(*args, **kwargs, implementation=("mosaic_gpu", "xla"))


def ragged_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
    preferred_element_type: Any = None,
) -> jax.Array:
  """`jax.lax.ragged_dot_general`, by `tokamax_ragged_dot_general` where lowered for CUDA."""

  def xla(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dimension_numbers, preferred_element_type=preferred_element_type
    )

  def kernel(lhs, rhs, group_sizes):
    return tokamax_ragged_dot_general(
        lhs, rhs, group_sizes, dimension_numbers, preferred_element_type=preferred_element_type
    )

  if _tokamax() is None:
    return xla(lhs, rhs, group_sizes)
  # Both branches are traced; only the lowering platform's is lowered and compiled.
  return jax.lax.platform_dependent(lhs, rhs, group_sizes, cuda=kernel, default=xla)


# `jax.lax.ragged_dot`'s: rows [M, K] in groups, times their group's [K, N] of rhs [G, K, N].
_RAGGED_DOT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` by `ragged_dot_general`."""
  return ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DOT)
