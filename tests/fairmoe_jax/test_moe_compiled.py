"""The MoE block's per-device work and traffic, read from the program XLA compiles for a TPU slice
and a GPU node (deviceless, as the preflight compiles): what no CPU timing can show.

The block (router, dispatch, experts; FairSMoE's router with its competence pass) is built on
a (data, expert) mesh of the target's devices, its forward and backward pass compiled, and the
optimised HLO parsed (`trainkit.preflight.hlo`). Every expectation is computed here from the
shapes, never copied from a compile:

* data parallelism (expert axis 1): each device's expert matmuls have the rows of its own
  groups' capacity slots, [E, (B / n) C, H]; the only collective is one all-reduce per
  parameter, in float32, of the parameter's shape (the floor: the gradients' sum over devices);
* expert parallelism: the expert matmuls have [E / n_e, n_e (B / n) C, H]; the all-reduces are
  the same float32 parameter-shaped floor (expert weights: their shard); the all-to-alls move
  exactly tokens x capacity x width x dtype, two forward and two backward.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fairmoe_jax.config import base_config
from fairmoe_jax.methods.base import moe_kwargs
from fairmoe_jax.moe import SparseMoE
from fairmoe_jax.moe.dispatch import compute_capacity, spmd
from fairmoe_jax.moe.routers.fair import FairRouter
from trainkit.errors import UserError
from trainkit.mesh import BATCH_AXES, make_mesh
from trainkit.preflight import hlo
from trainkit.preflight.compile import persistent_cache_off
from trainkit.preflight.targets import devices, get_target

# Batch, tokens per image, width, expert MLP width, experts, top-k: sizes that differ from each
# other wherever a test tells dimensions apart.
B, S, D, H, E, K = 16, 8, 32, 96, 8, 2
CAPACITY_FACTOR = 1.25
CAPACITY = compute_capacity(S, E, K, CAPACITY_FACTOR)  # 3 slots per image and expert
GROUP_SIZES = (2, 3)  # FairSMoE: two sensitive attributes


def _devices(target_name: str):
  if target_name == "cpu":  # The tests' 8 fake CPU devices (tests/conftest.py).
    return jax.devices()
  try:
    return list(devices(get_target(target_name)))
  except UserError as e:  # The CUDA plugin or libtpu cannot describe the target here.
    pytest.skip(str(e))


def _block(mesh, dispatch: str, fair: bool, router_name: str = "topk") -> SparseMoE:
  """The MoE block as a training run builds it on `mesh` (`methods.base.moe_kwargs`)."""
  router = None
  if fair:

    def router(dim, num_experts, top_k, *, rngs):
      return FairRouter(dim, num_experts, top_k, GROUP_SIZES, num_classes=2, rngs=rngs)

  config = base_config()
  config.moe.update(
      num_experts=E,
      top_k=K,
      dispatch=dispatch,
      capacity_factor=CAPACITY_FACTOR,
      capacity_multiple_of=1,  # C = CAPACITY, unrounded: the sizes above stay apart.
      router=router_name,
  )
  kwargs = moe_kwargs(config, mesh, router or config.moe.router)
  return SparseMoE(D, H, **kwargs, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def _compile(
    target_name: str,
    data: int,
    expert: int,
    dispatch: str,
    fair: bool = False,
    router_name: str = "topk",
    mesh_from: str = "layer",
    batch_size: int = B,
):
  """The block's gradient step on the target's (data, expert) mesh: its optimised HLO and the
  block's parameters (abstract, laid out as training lays them out). `mesh_from` "context": the
  block is built without the mesh and compiled under `jax.set_mesh`, as a user's own model is;
  "none": nor under `jax.set_mesh`, the mesh only in the inputs' shardings. A `batch_size` that
  does not divide the mesh is replicated, as an evaluation's last batch."""
  mesh = make_mesh({"data": data, "expert": expert}, _devices(target_name))
  in_context = mesh_from == "context"
  block_mesh = mesh if mesh_from == "layer" else None
  abstract = nnx.eval_shape(lambda: _block(block_mesh, dispatch, fair, router_name))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  specs = nnx.get_partition_spec(params)

  def placed(tree, spec_tree):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        spec_tree,
    )

  params = placed(params, specs)
  rest = placed(rest, jax.tree.map(lambda _: P(), rest))
  batch = NamedSharding(mesh, P(BATCH_AXES) if batch_size % mesh.size == 0 else P())
  x = jax.ShapeDtypeStruct((batch_size, S, D), jnp.bfloat16, sharding=batch)
  cotangent = jax.ShapeDtypeStruct((batch_size, S, D), jnp.bfloat16, sharding=batch)
  context = None
  if fair:
    context = {
        "label": jax.ShapeDtypeStruct((B,), jnp.int32, sharding=batch),
        "attributes": jax.ShapeDtypeStruct((B, len(GROUP_SIZES)), jnp.int32, sharding=batch),
    }

  def loss(params, x, cotangent, context, rest):
    y, aux = nnx.merge(graphdef, params, rest)(x, train=True, context=context)
    value = jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))
    return value + sum(aux.extra_losses.values())

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  with persistent_cache_off(), jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
    compiled = step.lower(params, x, cotangent, context, rest).compile()
  return compiled.as_text(), params, mesh


def _parameter_floor(params, mesh) -> int:
  """Bytes per device of one float32 all-reduce of every parameter's local shard."""
  total = 0
  for leaf in jax.tree.leaves(params):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * 4
  return total


def _expert_rows(text: str, local_experts: int) -> set[int]:
  """N of every expert matmul result [E_l, N, H] (any order, N possibly split, as [E_l, G, C, H];
  the weight gradients [E_l, D, H] left out)."""
  rows = set()
  for array in hlo.matmul_results(text):
    dims = [d for d in array.dims if d != 1]
    if local_experts in dims and H in dims and len(dims) >= 3:
      rest = list(dims)
      rest.remove(local_experts)
      rest.remove(H)
      if rest != [D]:
        rows.add(math.prod(rest))
  return rows


# Each target's compiler (tests/conftest.py skips a case whose compiler is not installed).
COMPILER = {"v5e-8": pytest.mark.compile_tpu, "h100x8": pytest.mark.compile_gpu}


def on(target: str, *rest):
  return pytest.param(target, *rest, marks=COMPILER[target])


CASES = [
    # target, data, expert
    on("v5e-8", 8, 1),
    on("v5e-8", 4, 2),
    on("h100x8", 8, 1),
    on("h100x8", 2, 4),
]


@pytest.mark.parametrize(("target", "data", "expert"), CASES)
@pytest.mark.parametrize("dispatch", ["sort", "einsum"])
def test_each_device_runs_its_own_tokens_and_sends_the_floor(target, data, expert, dispatch):
  text, params, mesh = _compile(target, data, expert, dispatch)
  devices_ = data * expert
  local_groups = B // devices_
  local_experts = E // expert
  # Expert matmuls: each local expert on the capacity slots of the groups it serves.
  assert _expert_rows(text, local_experts) == {expert * local_groups * CAPACITY}

  collectives = hlo.collective_results(text)
  all_reduce = collectives.pop("all-reduce", [])
  assert {a.dtype for a in all_reduce} == {"f32"}, all_reduce
  assert sum(a.bytes for a in all_reduce) == _parameter_floor(params, mesh)
  all_to_all = collectives.pop("all-to-all", [])
  if expert == 1:
    assert all_to_all == []
  else:  # Dispatch and return, forward and backward: [E, G_l C, D] bfloat16 each.
    assert len(all_to_all) == 4
    assert {a.dtype for a in all_to_all} == {"bf16"}
    assert sum(a.bytes for a in all_to_all) == 4 * E * local_groups * CAPACITY * D * 2
  assert collectives == {}, f"unexpected collectives: {collectives}"


# The capacity dispatches and the dropless ones (every choice a row), experimental ones included.
DROPLESS = ("dropless", "blocksparse")
EXPERIMENTAL = ("sort_blocks", "einsum_fused", "blocksparse")
EVERY_DISPATCH = ("sort", "einsum", "dropless", *EXPERIMENTAL)


@pytest.mark.parametrize(
    ("target", "dispatch", "mesh_from", "batch_size"),
    [("cpu", d, "context", b) for d in ("sort", "dropless", "einsum") for b in (B, B - 4)]
    + [on(t, d, "context", B - 4) for t in ("v5e-8", "h100x8") for d in ("sort", "einsum")]
    # 24: dropless' 3 S k local rows differ from D.
    + [("cpu", d, "none", 24) for d in EVERY_DISPATCH]
    + [on(t, d, "none", 24) for t in ("v5e-8", "h100x8") for d in EVERY_DISPATCH],
)
def test_a_user_s_model_runs_each_device_s_own_tokens(
    target, dispatch, mesh_from, batch_size, monkeypatch
):
  """A user's model: the block built without a mesh, compiled by plain `jax.jit` on 8 devices
  under `jax.set_mesh`, or with no mesh at all but the batch's sharding (the SPMD partitioner
  splits the per-group dispatch; the experimental ones run their XLA reference, and say so).
  Each device's expert matmuls have its own examples' rows (a batch of 12 padded to 16):
  [E, (B / 8) C, H], dropless's [(B / 8) S k, H] (or [E, ..., H] where every expert runs on
  them: `dropless._ragged_dot` per group)."""
  monkeypatch.setattr(spmd, "FALLBACKS", [])
  text, _, _ = _compile(target, 8, 1, dispatch, mesh_from=mesh_from, batch_size=batch_size)
  local_groups = -(-batch_size // 8)
  rows = local_groups * (S * K if dispatch in DROPLESS else CAPACITY)
  # Rows per expert, the weight and bias gradients' matmuls left out, whatever their layout.
  matmuls = [
      a for a in hlo.matmul_results(text) if H in a.dims and a.size not in (E * D * H, E * H)
  ]
  assert {a.size // H // (E if E in a.dims else 1) for a in matmuls} == {rows}, matmuls
  said = [line.split(" on ")[0] for line in spmd.FALLBACKS if ": no mesh: " in line]
  assert said == ([dispatch] if mesh_from == "none" and dispatch in EXPERIMENTAL else []), said


@pytest.mark.compile_tpu
@pytest.mark.parametrize(
    "dispatch", ["sort_blocks", "blocksparse", "dropless", "dense", "einsum_fused"]
)
def test_data_parallel_every_dispatch_has_no_collective_but_the_gradient_sum(dispatch):
  text, params, mesh = _compile("v5e-8", 8, 1, dispatch)
  if dispatch == "einsum_fused":
    # The expert MLP's two Pallas kernels (forward, backward), each on this device's rows: its
    # B / 8 images' capacity slots, padded to the kernels' 8-row tile.
    kernels = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 2, kernels
    local_rows = -(-(B // 8) * CAPACITY // 8) * 8
    assert all(f"[{E},{local_rows},{D}]" in line for line in kernels), kernels
  collectives = hlo.collective_results(text)
  all_reduce = collectives.pop("all-reduce", [])
  assert {a.dtype for a in all_reduce} == {"f32"}
  assert sum(a.bytes for a in all_reduce) == _parameter_floor(params, mesh)
  assert collectives == {}, f"unexpected collectives: {collectives}"
  # No matmul of the block covers more than this device's B / 8 images' choices.
  local_choices = (B // 8) * S * K
  for array in hlo.matmul_results(text):
    if H in array.dims:
      assert array.size // H <= max(E * local_choices, E * D), array


@pytest.mark.parametrize("target", [on("v5e-8"), on("h100x8")])
def test_data_parallel_expert_choice_runs_each_device_s_picks(target):
  """Expert choice (experts pick C tokens of each example): per device, [E, B / 8, C, H]."""
  text, params, mesh = _compile(target, 8, 1, "sort", router_name="expert_choice")
  local_groups = B // 8
  for array in hlo.matmul_results(text):
    if H in array.dims:
      assert array.size // (H * E) in (local_groups * CAPACITY, D), array
  collectives = hlo.collective_results(text)
  all_reduce = collectives.pop("all-reduce", [])
  assert {a.dtype for a in all_reduce} == {"f32"}, all_reduce
  assert sum(a.bytes for a in all_reduce) == _parameter_floor(params, mesh)
  assert collectives == {}, f"unexpected collectives: {collectives}"


@pytest.mark.parametrize(("target", "data", "expert"), [on("v5e-8", 8, 1), on("v5e-8", 4, 2)])
def test_fairsmoe_competence_pass_runs_on_each_device_s_examples(target, data, expert):
  """FairSMoE's router runs every expert on every token (its competence pass): per device,
  on its own B / n examples, and its weights' gradients join the one float32 all-reduce."""
  text, params, mesh = _compile(target, data, expert, "sort", fair=True)
  local_groups = B // (data * expert)
  local_experts = E // expert
  # The competence pass: [E_l, n_e (B / n) S, H] (any layout), beside the dispatch's rows.
  competence = expert * local_groups * S
  for array in hlo.matmul_results(text):
    if H in array.dims:
      rows = array.size // (H * local_experts)
      assert rows in (competence, expert * local_groups * CAPACITY, D), array
  collectives = hlo.collective_results(text)
  all_reduce = collectives.pop("all-reduce", [])
  # Beside the gradients, its loss sums statistics over the devices' examples: per attribute a,
  # the examples of each group [G_a] and each expert's loss per group [G_a, E] (the
  # group-balanced cross-entropy), and a few scalar counts. None of them grows with the tokens.
  statistics = 4 * sum(g * (E + 1) for g in GROUP_SIZES) + 4 * 8
  floor = _parameter_floor(params, mesh)
  assert all(a.dtype == "f32" or a.dims == () for a in all_reduce), all_reduce
  assert floor <= sum(a.bytes for a in all_reduce if a.dtype == "f32") <= floor + statistics
  largest_shard = max(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params))
  assert max(a.size for a in all_reduce) <= largest_shard
  if expert > 1:
    # The competence pass gathers the expert axis' tokens (its gradient: a float32
    # reduce-scatter) and returns [B / n, E, D] features by all-to-all.
    gathered = collectives.pop("all-gather")
    assert sum(a.size for a in gathered) == expert * local_groups * S * D
    scattered = collectives.pop("reduce-scatter")
    assert [a.dtype for a in scattered] == ["f32"]
    assert sum(a.size for a in scattered) == local_groups * S * D
    all_to_all = collectives.pop("all-to-all")
    dispatch_elements = 4 * E * local_groups * CAPACITY * D
    features_elements = 2 * expert * local_groups * local_experts * D
    assert sum(a.size for a in all_to_all) == dispatch_elements + features_elements
  assert collectives == {}, f"unexpected collectives: {collectives}"
