"""`dropless` on a GPU: tokamax's grouped GEMMs (`grouped_gemm.py`) in place of XLA's dense
ragged_dot, compiled for an H100 without one, and their values in Mosaic GPU's interpret mode.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fairmoe_jax.moe.dispatch import ExpertWeights, grouped_gemm, moe_dropless
from trainkit.errors import UserError
from trainkit.preflight.compile import persistent_cache_off
from trainkit.preflight.targets import devices, get_target

# Widths the Hopper kernels tile (multiples of 128); 8 experts, so a dense lowering is 8x.
G, S, K, D, H, E = 4, 32, 2, 128, 256, 8
_DOT = re.compile(r"=\s*\w+\[([\d,]*)\]\S*\s+dot\(%([\w.\-]+),.*?lhs_contracting_dims=\{([\d,]*)\}")
_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]", re.M)


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _xla_matmul_flops(hlo: str) -> float:
  """2 x result elements x contracted elements of every `dot` of an optimised module."""
  shapes = {name: _dims(dims) for name, dims in _SHAPE.findall(hlo)}
  return sum(
      2.0 * math.prod(_dims(out)) * math.prod(shapes[lhs][int(c)] for c in _dims(contracting))
      for out, lhs, contracting in _DOT.findall(hlo)
  )


def _loss(x, index, gates, experts):
  y, _ = moe_dropless(x, index, gates, experts, matmul="ragged_dot")
  return jnp.sum(y.astype(jnp.float32) ** 2)


@pytest.mark.compile_gpu
@pytest.mark.slow  # About 40 s on one core, most of it compiling tokamax's six kernels.
def test_dropless_step_on_an_h100_runs_grouped_gemms_not_a_dense_matmul():
  pytest.importorskip("tokamax")
  try:
    (device,) = devices(get_target("h100x1"))
  except UserError as e:
    pytest.skip(str(e))
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  experts = ExpertWeights(spec(E, D, H), spec(E, H), spec(E, H, D), spec(E, D))
  args = (spec(G, S, D), spec(G, S, K, dtype=jnp.int32), spec(G, S, K, dtype=jnp.float32), experts)
  sharding = jax.sharding.SingleDeviceSharding(device)
  # tokamax picks its kernel by the default device when traced.
  with jax.default_device(device), persistent_cache_off():  # Not readable back here.
    step = jax.jit(jax.grad(_loss, argnums=(0, 3)), in_shardings=sharding)
    hlo = step.lower(*args).compile().as_text()
  # Forward, input and weight gradients of both layers: six kernels.
  assert len(re.findall(r'custom_call_target="mosaic_gpu', hlo)) == 6
  # Each kernel does the 2 N D H FLOPs of its rows (N = G S K choices); XLA's own matmuls (the
  # bias gradients) stay under a fifth of that, where the dense lowering does E times.
  kernels = 6 * 2.0 * G * S * K * D * H
  assert _xla_matmul_flops(hlo) <= 0.2 * kernels


@pytest.mark.slow  # Mosaic GPU's interpreter: about 10 s a kernel call on one core.
def test_tokamax_kernels_in_interpret_mode_match_the_dense_oracle():
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  pytest.importorskip("tokamax")
  if not hasattr(plgpu, "force_gpu_interpret_mode"):
    pytest.skip(f"jax {jax.__version__} has no public Mosaic GPU interpret mode")
  try:
    (device,) = devices(get_target("h100x1"))
  except UserError as e:
    pytest.skip(str(e))
  keys = jax.random.split(jax.random.key(0), 3)
  rows = jax.random.normal(keys[0], (200, D), jnp.bfloat16)
  w = jax.random.normal(keys[1], (E, D, H), jnp.bfloat16)
  d_out = jax.random.normal(keys[2], (200, H), jnp.bfloat16)
  group_sizes = jnp.array([37, 0, 60, 3, 0, 50, 50, 0], jnp.int32)  # Empty and partial tiles.
  # Committed to the CPU: the default device below is the H100, which has no memory here.
  rows, w, d_out, group_sizes = jax.device_put((rows, w, d_out, group_sizes), jax.devices("cpu")[0])
  # The oracle: each row times its own expert's matrix, in float32.
  row_w = jnp.repeat(w.astype(jnp.float32), group_sizes, axis=0, total_repeat_length=200)
  cases = (  # `dropless.ragged_matmul`'s forward and input gradient.
      (rows, w, jnp.einsum("nd,ndh->nh", rows.astype(jnp.float32), row_w)),
      (d_out, w.swapaxes(1, 2), jnp.einsum("nh,ndh->nd", d_out.astype(jnp.float32), row_w)),
  )
  # The weight gradient's kernel is left out: jax 0.12's interpreter fails on its wgmma
  # ("Expected shape (6,) but got (64, 128)"); the H100 compile above covers it.
  for lhs, rhs, want in cases:

    def kernel(lhs, rhs, group_sizes):
      return grouped_gemm.tokamax_ragged_dot_general(
          lhs, rhs, group_sizes, grouped_gemm._RAGGED_DOT
      )

    # Traced with the H100 as default device (tokamax's choice of kernel), run by the
    # interpreter on the CPU.
    with plgpu.force_gpu_interpret_mode(), jax.default_device(device):
      got = jax.jit(kernel)(lhs, rhs, group_sizes)
      assert "wgmma" in str(jax.make_jaxpr(kernel)(lhs, rhs, group_sizes))  # Hopper's MMA.
    # Both round their float32 sums to bfloat16 once: half an ulp, and a floor for cancellation.
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=2**-8, atol=1e-2)
