"""`fairmoe_jax.moe.experimental.fused_mlp`: the expert MLP's Pallas kernels, run by Pallas'
interpreter on the CPU, against a float64 numpy MLP; values and every gradient.

Tolerances come from the computation: a float sum of n terms carries a rounding error of at
most about n u times the sum of its terms' magnitudes (u the dtype's unit roundoff; for
float32, u = 2^-24). Each reference below is paired with the same computation on absolute
values (`_magnitudes`), and the kernels' error must stay within `n_terms * u * magnitude` per
element, with n_terms the longest chain of roundings the value passed through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS, ExpertWeights, data_parallel_moe, spmd
from fairmoe_jax.moe.experimental import fused_mlp

# Checked against float64 at float32's rounding (tests/conftest.py: full precision on accelerators).
pytestmark = pytest.mark.float32_reference

E, D, H = 3, 16, 24
UNIT_ROUNDOFF = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}


def _weights(seed: int) -> ExpertWeights:
  r = np.random.default_rng(seed)
  return ExpertWeights(
      w1=jnp.asarray(r.normal(size=(E, D, H)) / math.sqrt(D), jnp.float32),
      b1=jnp.asarray(r.normal(size=(E, H)) * 0.3, jnp.float32),
      w2=jnp.asarray(r.normal(size=(E, H, D)) / math.sqrt(H), jnp.float32),
      b2=jnp.asarray(r.normal(size=(E, D)) * 0.3, jnp.float32),
  )


def _reference(x, w, d_y, absolute: bool = False):
  """float64 numpy: y = GELU(x W1 + b1) W2 + b2 per expert, and the gradients of sum(y d_y)
  with respect to x and the four weights; x [E, N, D].

  `absolute`: the same computation on absolute values, with |GELU(h)| <= |h| and
  |GELU'(h)| <= 1.13: every term's magnitude summed, what a float sum's rounding error scales
  with."""
  arrays = [np.asarray(a, np.float64) for a in (x, d_y, w.w1, w.b1, w.w2, w.b2)]
  if absolute:
    arrays = [np.abs(a) for a in arrays]
  x, d_y, w1, b1, w2, b2 = arrays
  h = np.einsum("end,edh->enh", x, w1) + b1[:, None]
  if absolute:
    a, slope = h, 1.13
  else:
    cdf = 0.5 * special.erfc(-h / math.sqrt(2.0))
    a, slope = h * cdf, cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
  y = np.einsum("enh,ehd->end", a, w2) + b2[:, None]
  d_h = np.einsum("end,ehd->enh", d_y, w2) * slope
  grads = dict(
      x=np.einsum("enh,edh->end", d_h, w1),
      w1=np.einsum("end,enh->edh", x, d_h),
      b1=d_h.sum(1),
      w2=np.einsum("enh,end->ehd", a, d_y),
      b2=d_y.sum(1),
  )
  return y, grads


def _magnitudes(x, w, d_y):
  return _reference(x, w, d_y, absolute=True)


def _kernels_value_and_grads(x, w, d_y):
  def loss(x, w):
    y = fused_mlp.fused_expert_mlp_kernels(x, w, interpret=True)
    return jnp.sum(y.astype(jnp.float32) * d_y.astype(jnp.float32)), y

  (_, y), (d_x, d_w) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
  return y, dict(x=d_x, w1=d_w.w1, b1=d_w.b1, w2=d_w.w2, b2=d_w.b2)


def _assert_within_rounding(name, got, want, magnitude, dtype, n_terms):
  err = np.abs(np.asarray(got, np.float64) - want)
  bound = n_terms * UNIT_ROUNDOFF[dtype] * magnitude + 1e-30
  worst = float(np.max(err / bound))
  assert worst <= 1.0, f"{name}: error {worst:.2f}x its rounding bound"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "rows, max_row_block, weight_buffers",
    [((2, 8), 128, 1), ((3, 5), 128, 1), ((4, 6), 8, 1), ((4, 6), 8, 2)],
    ids=["one_block", "padded", "three_blocks", "three_blocks_two_buffers"],
)
def test_kernels_match_the_float64_mlp_values_and_gradients(
    dtype, rows, max_row_block, weight_buffers, monkeypatch
):
  """[E, G, C, D] buffers, merged to E x G C rows: 16 (one block), 15 (padded to 16: the
  padding must add nothing to any gradient) and 24 in blocks of 8 (each expert's weight
  gradients summed over three grid steps), with one buffer per weight block (the default) and
  with two."""
  monkeypatch.setattr(fused_mlp, "MAX_ROW_BLOCK", max_row_block)
  monkeypatch.setattr(fused_mlp, "WEIGHT_BUFFERS", weight_buffers)
  r = np.random.default_rng(1)
  x = jnp.asarray(r.normal(size=(E, *rows, D)), dtype)
  d_y = jnp.asarray(r.normal(size=(E, *rows, D)), dtype)
  w = _weights(2)
  y, grads = _kernels_value_and_grads(x, w, d_y)
  assert y.dtype == dtype and y.shape == x.shape
  assert grads["x"].dtype == dtype
  assert all(grads[k].dtype == jnp.float32 for k in ("w1", "b1", "w2", "b2"))

  flat = lambda a: np.asarray(a, np.float64).reshape(E, -1, D)  # noqa: E731
  want_y, want = _reference(flat(x), w, flat(d_y))
  mag_y, mag = _magnitudes(flat(x), w, flat(d_y))
  num_rows = int(np.prod(rows))
  # Roundings on a value's longest path: the operands cast to `dtype` (x, W), the two matmuls'
  # float32 sums (D and H terms), GELU(h) cast to `dtype`, the result cast. Backward adds the
  # cast of dh and the sums over the expert's rows.
  forward_terms = 4 + (D + H) * UNIT_ROUNDOFF[jnp.float32] / UNIT_ROUNDOFF[dtype]
  backward_terms = (
      forward_terms + 2 + (num_rows + D + H) * (UNIT_ROUNDOFF[jnp.float32] / UNIT_ROUNDOFF[dtype])
  )
  _assert_within_rounding("y", flat(y), want_y, mag_y, dtype, forward_terms)
  for name in want:
    got = flat(grads[name]) if name == "x" else grads[name]
    _assert_within_rounding(name, got, want[name], mag[name], dtype, backward_terms)


def test_kernels_agree_with_the_xla_mlp_they_replace():
  """On the CPU `fused_expert_mlp` is `ExpertWeights.apply_expert_major` itself (the kernels
  are lowered for a TPU only); the interpreted kernels give its values to float32 rounding."""
  r = np.random.default_rng(3)
  x = jnp.asarray(r.normal(size=(E, 2, 4, D)), jnp.float32)
  w = _weights(4)
  xla = w.apply_expert_major(x)
  np.testing.assert_array_equal(fused_mlp.fused_expert_mlp(x, w), xla)
  kernels = fused_mlp.fused_expert_mlp_kernels(x, w, interpret=True)
  magnitude, _ = _magnitudes(np.asarray(x).reshape(E, -1, D), w, np.ones((E, 8, D)))
  # Both round the same float64 values: twice one computation's bound.
  bound = 2 * (4 + D + H) * UNIT_ROUNDOFF[jnp.float32] * magnitude.reshape(x.shape)
  assert np.all(np.abs(np.asarray(kernels, np.float64) - np.asarray(xla)) <= bound)


def test_each_fall_back_to_xla_s_mlp_is_said_once_and_kept_for_run_info(monkeypatch, caplog):
  """Off a TPU, and inside shard_map where jax's private check_vma switch is gone, einsum_fused
  runs XLA's MLP: one log line each, listed in `spmd.FALLBACKS` (run_info.json's "fallbacks")."""
  monkeypatch.setattr(spmd, "FALLBACKS", [])
  x, w = jnp.ones((E, 2, 4, D)), _weights(4)
  for _ in range(2):
    fused_mlp.fused_expert_mlp(x, w)
  assert spmd.FALLBACKS == ["einsum_fused on cpu: XLA's MLP, no kernel: the einsum dispatch's cost"]
  monkeypatch.setattr(spmd, "vma_check_off", lambda: None)  # A jax without the switch.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  rows, replicated = jax.sharding.PartitionSpec(None, "data"), jax.sharding.PartitionSpec()
  body = lambda x, w: fused_mlp.fused_expert_mlp(x, spmd.vary_over(w, ("data",)))  # noqa: E731
  jax.shard_map(body, mesh=mesh, in_specs=(rows, replicated), out_specs=rows)(x, w)
  assert spmd.FALLBACKS[1] == (
      f"einsum_fused on cpu: XLA's MLP: jax {jax.__version__} lacks jax._src.config._check_vma"
  )
  assert [r.getMessage() for r in caplog.records] == [f"fall-back: {f}" for f in spmd.FALLBACKS]


@pytest.mark.parametrize(
    "dim, hidden, capacity",
    [(384, 1536, 16 * 2**20), (768, 3072, 64 * 2**20), (1024, 4096, 128 * 2**20)],
    ids=["deit_s_v4", "vit_b_v5p", "swin_b_v5e"],
)
def test_the_kernels_vector_memory_fits_the_paper_widths(dim, hidden, capacity):
  """The kernels' vector memory (float32 tokens, the larger need) within a core's: DeiT-S's
  experts in a v4's 16 MiB, ViT-B's in a v5p's 64 MiB, Swin-B's last stage in a v5e's 128 MiB
  (as the deviceless compiles of docs/design.md found)."""
  block = fused_mlp.row_block(4096, hidden)
  assert fused_mlp.vmem_bytes(block, dim, hidden, 4, fused_mlp.WEIGHT_BUFFERS) <= capacity


@pytest.mark.parametrize(
    "rows, hidden, block",
    [
        (256, 1536, 128),  # DeiT-S, E=64: two blocks of every expert's rows.
        (3968, 1536, 128),  # DeiT-S, E=4 (C = 124): 31 blocks.
        (1000, 1536, 40),  # The largest multiple of 8 dividing 1000 within 128.
        (4096, 16384, 64),  # A hidden width this wide caps the block (16 MiB of intermediates).
        (15, 64, 16),  # No multiple of 8 divides 15: padded to 16.
        (5, 64, 8),
    ],
)
def test_row_blocks_divide_the_rows_in_multiples_of_eight(rows, hidden, block):
  assert fused_mlp.row_block(rows, hidden) == block
  chosen = fused_mlp.row_block(rows, hidden)
  assert chosen % 8 == 0 and chosen <= fused_mlp.MAX_ROW_BLOCK
  assert 16 * hidden * chosen <= fused_mlp.HIDDEN_BLOCK_BYTES


def test_the_kernels_cost_counts_each_experts_weights_once_per_pass():
  """The cost the kernels give XLA: FLOPs of two matmuls forward and five backward (h is
  recomputed), and bytes where the weights are read once per expert, not once per row block;
  doubling the rows doubles only the per-row part."""
  one = fused_mlp.backward_cost(4, 256, 384, 1536, 4)
  two = fused_mlp.backward_cost(4, 512, 384, 1536, 4)
  per_row_bytes = two.bytes_accessed - one.bytes_accessed
  assert per_row_bytes == 3 * 4 * 4 * 256 * 384  # x and dy read, dx written.
  weights = 2 * 4 * (384 * 1536 * 2) * 4  # W1, W2 read and their gradients written.
  assert one.bytes_accessed - per_row_bytes >= weights
  assert two.flops == 5 * 2 * (4 * 512) * 384 * 1536
  forward = fused_mlp.forward_cost(4, 256, 384, 1536, 4)
  assert forward.flops == 2 * 2 * (4 * 256) * 384 * 1536


def test_inside_shard_map_each_device_runs_the_kernels_on_its_own_rows():
  """Under `jax.shard_map` over 2 devices, each with its own rows and the weights replicated:
  the values, and the gradients of the whole batch (the weights' summed over the devices).

  Pallas' interpreter cannot run a kernel inside a shard_map that checks varying axes (its
  grid loop's carry loses them, jax 0.10-0.12), so this one does not check; the typing under
  `check_vma=True`, as `data_parallel.py` runs the layer, is checked where the kernels are
  lowered, for a TPU (`tests/fairmoe_jax/test_moe_compiled.py`, `einsum_fused` on a v5e-8)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  rows = jax.sharding.PartitionSpec(None, "data")
  r = np.random.default_rng(5)
  x = jnp.asarray(r.normal(size=(E, 2, 8, D)), jnp.float32)  # Each device: [E, 1, 8, D].
  d_y = jnp.asarray(r.normal(size=(E, 2, 8, D)), jnp.float32)
  w = _weights(6)

  def body(x, w):
    return fused_mlp.fused_expert_mlp(x, w, interpret=True)

  layer = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(rows, jax.sharding.PartitionSpec()),
      out_specs=rows,
      check_vma=False,
  )

  def loss(x, w):
    y = layer(x, w)
    return jnp.sum(y * d_y), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, y), (d_x, d_w) = step(x, w)
  flat = lambda a: np.asarray(a, np.float64).reshape(E, -1, D)  # noqa: E731
  want_y, want = _reference(flat(x), w, flat(d_y))
  mag_y, mag = _magnitudes(flat(x), w, flat(d_y))
  terms = 6 + 16 + D + H  # `test_kernels_match...`'s backward chain in float32, 16 rows.
  _assert_within_rounding("y", flat(y), want_y, mag_y, jnp.float32, terms)
  got = dict(x=flat(d_x), w1=d_w.w1, b1=d_w.b1, w2=d_w.w2, b2=d_w.b2)
  for name in want:
    _assert_within_rounding(name, got[name], want[name], mag[name], jnp.float32, terms)


@pytest.mark.compile_tpu
def test_replicated_weights_get_every_devices_gradient_when_lowered_for_a_tpu():
  """The kernels in `jax.shard_map(check_vma=True)` with the weights replicated over the mesh,
  compiled for 2 devices of a v5e (deviceless): the custom VJP types each cotangent as its
  primal, so the weights' gradients are summed over the devices by one float32 all-reduce of
  their shapes, and the rows' gradient stays on its device (no other collective)."""
  from trainkit.errors import UserError  # pylint: disable=import-outside-toplevel
  from trainkit.preflight import hlo  # pylint: disable=import-outside-toplevel
  from trainkit.preflight.compile import persistent_cache_off  # pylint: disable=import-outside-toplevel
  from trainkit.preflight.targets import devices, get_target  # pylint: disable=import-outside-toplevel

  try:
    mesh = jax.sharding.Mesh(np.array(devices(get_target("v5e-8"))[:2]), ("data",))
  except UserError as e:
    pytest.skip(str(e))
  rows, replicated = jax.sharding.PartitionSpec(None, "data"), jax.sharding.PartitionSpec()
  dim, hidden = 128, 256  # Lane-aligned widths, as the TPU takes them.
  spec = lambda shape, s: jax.ShapeDtypeStruct(  # noqa: E731
      shape, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, s)
  )
  x = spec((E, 2, 8, dim), rows)
  w = ExpertWeights(
      spec((E, dim, hidden), replicated),
      spec((E, hidden), replicated),
      spec((E, hidden, dim), replicated),
      spec((E, dim), replicated),
  )
  # The kernels themselves: `fused_expert_mlp`'s other branch, XLA's MLP, needs the weights
  # marked varying first, as `data_parallel.py` marks them.
  layer = jax.shard_map(
      fused_mlp.fused_expert_mlp_kernels, mesh=mesh, in_specs=(rows, replicated), out_specs=rows
  )
  step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(layer(x, w)), argnums=(0, 1)))
  with persistent_cache_off():  # A deviceless executable cannot be read back from the cache.
    text = step.lower(x, w).compile().as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 2
  collectives = hlo.collective_results(text)
  all_reduce = collectives.pop("all-reduce", [])
  assert {a.dtype for a in all_reduce} == {"f32"}, all_reduce
  # The weights' gradients, and the loss: a sum over both devices' rows (one float32 scalar).
  assert sum(a.bytes for a in all_reduce) == 4 * E * (2 * dim * hidden + hidden + dim) + 4
  assert collectives == {}, collectives


def test_einsum_fused_in_a_data_parallel_layer_on_the_cpu_is_einsum():
  """`einsum_fused` as `data_parallel.py` runs it on 2 CPU devices (`shard_map` checking varying
  axes, the weights marked varying): the Pallas kernels' branch is traced and the CPU's, XLA's
  MLP, lowered, so values and gradients are `einsum`'s own."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  r = np.random.default_rng(7)
  x = jnp.asarray(r.normal(size=(4, 6, D)), jnp.float32)
  index = jnp.asarray(np.stack([r.permutation(E)[:2] for _ in range(24)]).reshape(4, 6, 2))
  gates = jnp.asarray(r.uniform(0.1, 1.0, size=(4, 6, 2)), jnp.float32)
  w = _weights(8)

  def step(name):
    def loss(x, gates, w):
      y, _ = data_parallel_moe(DISPATCH_ALGORITHMS[name], x, index, gates, w, capacity=4, mesh=mesh)
      return jnp.sum(y * y)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, gates, w)

  fused, einsum = step("einsum_fused"), step("einsum")
  for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(einsum), strict=True):
    np.testing.assert_array_equal(got, want)
