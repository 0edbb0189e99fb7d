"""The preflight's cost of a program: what a GPU's library calls (cuBLAS GEMMs, cuDNN
convolutions) read, write and compute, which XLA's HLO cost analysis leaves out, and what the
collectives cost on the target's interconnect.

Small programs are compiled for the targets without them, as the preflight compiles (the CUDA
plugin's and libtpu's device descriptions); every expectation is computed here from the shapes
and the targets' stated bandwidths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainkit.errors import UserError
from trainkit.preflight import analysis, hlo
from trainkit.preflight.compile import compile_step, persistent_cache_off, step_estimate
from trainkit.preflight.hlo import Array
from trainkit.preflight.targets import TARGETS, devices, get_target

# Every case compiles for (or describes) a GPU target (tests/conftest.py skips where the CUDA
# plugin is not installed).
pytestmark = pytest.mark.compile_gpu

# A GEMM whose three sizes differ, so that a swapped dimension shows.
M, K, N = 512, 1024, 768
# What compile_step falls back to when the deviceless Triton GEMM tiling fails, and what a real
# run may choose after autotuning: the GEMMs as cuBLAS calls.
CUBLAS = {"xla_gpu_enable_triton_gemm": False}


def _mesh(target_name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  try:
    found = devices(get_target(target_name))
  except UserError as e:  # The CUDA plugin or libtpu cannot describe the target here.
    pytest.skip(str(e))
  return Mesh(np.array(found).reshape(shape), names)


def _spec(
    mesh: Mesh, shape: tuple[int, ...], spec: P = P(), dtype=jnp.bfloat16
) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(fn, args, options=None):
  """The compiled program and its optimised HLO text (deviceless: no persistent cache)."""
  mesh = args[0].sharding.mesh
  with jax.set_mesh(mesh), persistent_cache_off():
    compiled = jax.jit(fn).lower(*args).compile(options)
  return compiled, compiled.as_text()


# --- Library calls ------------------------------------------------------------------------------


def test_a_cublas_gemm_is_counted_from_its_shapes():
  mesh = _mesh("h100x1", (1,), ("data",))
  x, w = _spec(mesh, (M, K)), _spec(mesh, (K, N))
  step = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
  compiled, text = _compile(step, (x, w), CUBLAS)
  (gemm,) = hlo.library_calls(text)
  assert gemm.kind == "gemm" and gemm.target.startswith("__cublas$")
  assert gemm.operands == (Array("bf16", (M, K)), Array("bf16", (K, N)))
  # Its tuple result is the product and cuBLAS's scratch workspace, which is not data.
  assert gemm.results == (Array("bf16", (M, N)),) and gemm.workspace > 0
  assert gemm.flops == 2 * M * N * K and gemm.executions == 1
  library = analysis.library_call_cost(text)
  assert library["bytes"] == 2 * (M * K + K * N + M * N)  # bf16 operands read, result written
  assert (
      library["flops"]
      == 2 * M * N * K
      == analysis.matmul_flops(jax.make_jaxpr(step)(x, w))["flops"]
  )
  assert library["workspace_bytes"] == gemm.workspace
  # The fusions' count leaves the call to library_call_cost: its FLOPs are the tanh fusion's.
  fusions_only = analysis.optimized_hlo_cost(text)
  assert fusions_only["flops"] < 4 * M * N
  total = analysis.with_library_calls(fusions_only, library)
  # The one fusion (bf16 -> tanh -> bf16) reads and writes [M, N] once.
  assert total["fusions"]["bytes accessed"] == 2 * (2 * M * N)
  assert total["bytes accessed"] == 2 * (2 * M * N) + 2 * (M * K + K * N + M * N)
  assert total["library_calls"] == {
      "flops": 2 * M * N * K,
      "bytes accessed": 2 * (M * K + K * N + M * N),
  }
  assert 2 * M * N * K < total["flops"] < 2 * M * N * K + 4 * M * N


def test_a_fusion_counts_the_slice_it_reads_and_a_loop_its_trip_count():
  mesh = _mesh("h100x1", (1,), ("data",))
  x = _spec(mesh, (1024, 256), dtype=jnp.float32)
  _, text = _compile(lambda x: jnp.tanh(x[:128] * 2), (x,))
  # One fusion: reads the slice, not all of x, writes its result; one multiply per element.
  assert analysis.optimized_hlo_cost(text) == {
      "flops": 128 * 256,
      "bytes accessed": 2 * 4 * 128 * 256,
  }
  carry = _spec(mesh, (16, 256, 256), dtype=jnp.float32)
  row = 4 * 256 * 256

  def loop(trips):
    body = lambda i, c: c.at[i].set(jnp.tanh(c[i]) * 2)  # noqa: E731
    return analysis.optimized_hlo_cost(
        _compile(lambda c: jax.lax.fori_loop(0, trips, body, c), (carry,))[1]
    )

  # Each more iteration reads row i and writes it back in place (a dynamic-update-slice), not
  # the whole carry, and multiplies and selects each element (and a few scalar ops).
  four, eight = loop(4), loop(8)
  assert 0 <= eight["bytes accessed"] - four["bytes accessed"] - 4 * 2 * row < 4 * 64
  assert 0 <= eight["flops"] - four["flops"] - 4 * 2 * 256 * 256 < 4 * 32


def test_cudnn_convolutions_forward_and_backward_are_counted():
  mesh = _mesh("h100x1", (1,), ("data",))
  image, kernel = _spec(mesh, (8, 32, 32, 64)), _spec(mesh, (3, 3, 64, 128))

  def conv(image, kernel):
    return jax.lax.conv_general_dilated(
        image, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )

  def step(image, kernel):  # Both gradients: cuDNN's backward-input and backward-filter calls.
    return jax.grad(lambda i, k: jnp.sum(conv(i, k).astype(jnp.float32)), argnums=(0, 1))(
        image, kernel
    )

  def forward_and_back(image, kernel):
    return conv(image, kernel), step(image, kernel)

  _, text = _compile(forward_and_back, (image, kernel), CUBLAS)
  calls = {c.target: c for c in hlo.library_calls(text) if c.kind == "convolution"}
  assert sorted(calls) == [
      "__cudnn$convBackwardFilter",
      "__cudnn$convBackwardInput",
      "__cudnn$convForward",
  ]
  # Each: 2 x (8 x 32 x 32 x 128 outputs) x (3 x 3 x 64 multiply-adds per output).
  one = 2 * (8 * 32 * 32 * 128) * (3 * 3 * 64)
  assert {c.flops for c in calls.values()} == {one}
  # Bytes: the two operands and the result of each, whatever the direction.
  image_b, kernel_b, out_b = 2 * 8 * 32 * 32 * 64, 2 * 3 * 3 * 64 * 128, 2 * 8 * 32 * 32 * 128
  assert {c.bytes for c in calls.values()} == {image_b + kernel_b + out_b}
  # The jaxpr of the gradient step has the same three convolutions (the compiled program
  # computes the forward once for both outputs).
  assert analysis.matmul_flops(jax.make_jaxpr(step)(image, kernel))["flops"] == 3 * one
  assert analysis.library_call_cost(text)["flops"] >= 3 * one


def test_a_gemm_in_a_loop_counts_its_trip_count():
  mesh = _mesh("h100x1", (1,), ("data",))
  x, w = _spec(mesh, (M, K)), _spec(mesh, (K, K))
  step = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x)  # noqa: E731
  _, text = _compile(step, (x, w), CUBLAS)
  (gemm,) = hlo.library_calls(text)
  assert gemm.executions == 3 and not gemm.in_unknown_loop
  assert analysis.library_call_cost(text)["flops"] == 3 * 2 * M * K * K


# --- Collectives priced ---------------------------------------------------------------------------


def _sum_over(mesh: Mesh, axes: tuple[str, ...], rows: int = 256, width: int = 512):
  """A jitted psum over `axes` of an f32 [rows, width] block per device, and its argument."""
  everything = tuple(mesh.axis_names)
  fn = jax.shard_map(
      lambda x: jax.lax.psum(x, axes), mesh=mesh, in_specs=P(everything), out_specs=P(everything)
  )
  x = _spec(mesh, (mesh.size * rows, width), P(everything), jnp.float32)
  return jax.jit(fn), x


def test_an_all_reduce_within_a_node_is_priced_by_the_ring_model():
  target = get_target("h100x8")
  mesh = _mesh("h100x8", (8,), ("data",))
  jitted, x = _sum_over(mesh, ("data",))
  with persistent_cache_off():  # A deviceless executable: as the preflight compiles.
    _, record = compile_step(jitted, (x,), mesh, target)
  block = 256 * 512 * 4  # Each device's f32 [256, 512].
  assert record["collectives"] == {"all-reduce": {"count": 1, "bytes": block}}
  # Ring all-reduce over n = 8: each GPU sends 2 (n - 1) / n of the block over NVLink 4, 450 GB/s
  # each way.
  assert target.interconnect_bandwidth == 450e9
  expected = 2 * 7 / 8 * block / 450e9
  assert record["collective_seconds"] == pytest.approx(expected, rel=1e-12)
  priced = record["collective_pricing"]["by_kind"]["all-reduce"]
  assert priced["group_sizes"] == [8] and priced["across_hosts"] == 0
  assert priced["bytes_sent"] == 2 * 7 / 8 * block
  # The step: a 1 ms roofline at 40% is 2.5 ms of compute; the collective adds to it without
  # overlap and hides under it with full overlap.
  estimate = step_estimate(1e-3, 0.4, record["collective_seconds"])
  assert estimate["compute_step_seconds"] == pytest.approx(2.5e-3)
  assert estimate["step_seconds_no_overlap"] == pytest.approx(2.5e-3 + expected)
  assert estimate["step_seconds_no_overlap"] > estimate["compute_step_seconds"]
  assert estimate["step_seconds_full_overlap"] == pytest.approx(2.5e-3)
  # A step all collectives: full overlap is the collectives' time.
  assert step_estimate(1e-9, 1.0, expected)["step_seconds_full_overlap"] == expected


@pytest.mark.parametrize("name, across", [("h100x16", 50e9), ("v5e-16", 200e9)])
def test_a_group_that_spans_hosts_is_priced_at_the_inter_host_bandwidth(name, across):
  # Two hosts' worth of devices on the first axis: a psum over the second stays on each host's
  # NVLink (GPU), one over both spans the hosts (a GPU's network; a TPU slice's ICI spans them).
  target = get_target(name)
  per_host = target.num_devices // target.num_hosts
  mesh = _mesh(name, (target.num_devices // per_host, per_host), ("hosts", "local"))
  assert [d.process_index for d in mesh.devices[:, 0]] == list(range(target.num_hosts))
  with persistent_cache_off():  # A deviceless executable: as the preflight compiles.
    jitted, x = _sum_over(mesh, ("local",))
    _, within = compile_step(jitted, (x,), mesh, target)
    jitted, x = _sum_over(mesh, ("hosts", "local"))
    _, spanning = compile_step(jitted, (x,), mesh, target)
  block, n = 256 * 512 * 4, target.num_devices
  assert target.inter_host_bandwidth == across
  assert within["collective_seconds"] == pytest.approx(
      2 * (per_host - 1) / per_host * block / target.interconnect_bandwidth, rel=1e-12
  )
  assert within["collective_pricing"]["by_kind"]["all-reduce"]["across_hosts"] == 0
  assert spanning["collective_seconds"] == pytest.approx(
      2 * (n - 1) / n * block / across, rel=1e-12
  )
  assert spanning["collective_pricing"]["by_kind"]["all-reduce"]["group_sizes"] == [n]
  assert spanning["collective_pricing"]["by_kind"]["all-reduce"]["across_hosts"] == 1


def test_replica_groups_and_ring_factors_are_read_from_hlo_text():
  # XLA's iota form: 8 ids as [4, 2], transposed, in groups of 4.
  assert hlo.replica_groups("x, replica_groups=[2,4]<=[4,2]T(1,0), y") == (
      (0, 2, 4, 6),
      (1, 3, 5, 7),
  )
  assert hlo.replica_groups("x, replica_groups=[1,8]<=[8], y") == ((0, 1, 2, 3, 4, 5, 6, 7),)
  assert hlo.replica_groups("x, replica_groups={{0,1},{2,3}}, y") == ((0, 1), (2, 3))
  assert hlo.replica_groups("x, replica_groups={}, y") is None  # Every device.
  # jaxlib 0.12's mesh-axes form: a group is the devices that differ along its axes only.
  mesh = "replica_groups=mesh['hosts'=2,'local'=4]"
  assert hlo.replica_groups(f"x, {mesh} {{'local'}}, y") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert hlo.replica_groups(f"x, {mesh} {{'hosts'}}, y") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert hlo.replica_groups(f"x, {mesh} {{'local':(2)2}}, y") == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert hlo.replica_groups(
      "x, replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]<=[2,2]T(1,0)) {'b'}, y"
  ) == ((0, 2), (1, 3))
  # libtpu prints the device ids of an iota as its reshape and transpose alone.
  assert hlo.replica_groups(
      "x, replica_groups=mesh['a'=2,'b'=1,'c'=4], device_ids=([4,2]T(1,0)) {'a'}, y"
  ) == ((0, 1), (2, 3), (4, 5), (6, 7))
  text = "\n".join(
      [
          "ENTRY %main (p: f32[64]) -> f32[8] {",
          "  %p = f32[64]{0} parameter(0)",
          "  %rs = f32[8]{0} reduce-scatter(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add",
          "  ROOT %cp = f32[8]{0} collective-permute(%rs), channel_id=2, source_target_pairs={{0,4},{4,0}}",
          "}",
      ]
  )
  hosts = [0, 0, 0, 0, 1, 1, 1, 1]
  priced = analysis.collective_seconds(text, hosts, bandwidth=100.0, inter_host_bandwidth=10.0)
  # Reduce-scatter over 8 spanning both hosts: (n - 1) / n of its 64-float input, i.e. 7 of its
  # 8-float results; the permute crosses hosts: its result once at the inter-host rate.
  assert priced["by_kind"]["reduce-scatter"]["seconds"] == pytest.approx(7 * 32 / 10.0)
  assert priced["by_kind"]["collective-permute"]["seconds"] == pytest.approx(32 / 10.0)
  assert priced["seconds"] == pytest.approx(8 * 32 / 10.0)
  assert analysis.ring_factor("all-reduce", 1) == 0.0  # A group of one moves nothing.


def test_every_target_states_its_interconnect():
  for target in TARGETS.values():
    assert target.interconnect and 0 < target.inter_host_bandwidth <= target.interconnect_bandwidth
    if target.platform == "tpu":  # A slice's ICI spans its hosts.
      assert target.inter_host_bandwidth == target.interconnect_bandwidth
  # Per device and per direction: half the data sheets' bidirectional figures.
  assert get_target("h100x8").interconnect_bandwidth == 900e9 / 2
  assert get_target("a100x8").interconnect_bandwidth == 600e9 / 2
  assert get_target("v5e-8").interconnect_bandwidth == 400e9 / 2
  assert get_target("v5p-8").interconnect_bandwidth == 1200e9 / 2
