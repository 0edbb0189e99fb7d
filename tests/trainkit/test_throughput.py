"""Throughput accounting: FLOPs from the compiled step, peak lookup, MFU arithmetic."""

import jax
import jax.numpy as jnp
import pytest

from trainkit.throughput import compile_ahead, flops_of, peak_flops_per_device, throughput_scalars


class _Device:

  def __init__(self, kind):
    self.device_kind = kind


def test_flops_of_a_compiled_matmul():
  a = jnp.ones((32, 64))
  b = jnp.ones((64, 16))
  flops = flops_of(compile_ahead(jax.jit(lambda x, y: x @ y), a, b))
  assert flops == pytest.approx(2 * 32 * 64 * 16, rel=0.05)


def test_peak_lookup_prefers_the_longest_match_and_the_override():
  assert peak_flops_per_device(_Device("TPU v5 lite")) == 197e12
  assert peak_flops_per_device(_Device("TPU v5")) == 459e12
  assert peak_flops_per_device(_Device("NVIDIA H100 80GB HBM3")) == 989e12
  assert peak_flops_per_device(_Device("cpu")) is None
  assert peak_flops_per_device(_Device("cpu"), override=1e12) == 1e12


def test_throughput_scalars():
  s = throughput_scalars(
      2.0, examples_per_step=128, tokens_per_example=64, flops_per_step=5e12, peak_flops=1e14
  )
  assert s["examples_per_second"] == 256 and s["tokens_per_second"] == 256 * 64
  assert s["model_tflops_per_second_per_device"] == pytest.approx(10.0)
  assert s["mfu"] == pytest.approx(0.1)
  assert "mfu" not in throughput_scalars(2.0, examples_per_step=1, flops_per_step=5e12)
