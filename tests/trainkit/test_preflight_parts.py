"""Where a compiled train step's bytes and FLOPs go (`analysis.cost_by_part`): a tiny transformer
block and its optimiser update compiled for this CPU, its ops split by the Python frames that
traced them; and a TPU's batched dots, which it compiles to dilated convolutions, counted."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainkit.errors import UserError
from trainkit.preflight import analysis
from trainkit.preflight.compile import persistent_cache_off
from trainkit.preflight.targets import devices, get_target

DIM, TOKENS, BATCH = 32, 16, 8


class Mlp(nnx.Module):  # Named as the vision backbones' feed-forward, which PARTS reads.

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.fc1, self.fc2 = nnx.Linear(DIM, width, rngs=rngs), nnx.Linear(width, DIM, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(DIM, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(4, DIM, decode=False, rngs=rngs)
    self.mlp = Mlp(width, rngs)

  def __call__(self, x):
    x = x + self.attention(self.norm(x))
    return x + self.mlp(x)


def _parts(width: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
  """The parts of a train step of a block whose MLP is `width` wide, and the program's total."""
  graph, params = nnx.split(Block(width, nnx.Rngs(0)))
  tx = optax.adamw(1e-3)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean(nnx.merge(graph, p)(x) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x = jnp.zeros((BATCH, TOKENS, DIM))
  text = jax.jit(step).lower(params, tx.init(params), x).compile().as_text()
  total = analysis.with_library_calls(
      analysis.optimized_hlo_cost(text), analysis.library_call_cost(text)
  )
  return analysis.cost_by_part(text), total


def test_the_parts_sum_to_the_step_and_a_wider_mlp_grows_only_its_part():
  narrow, total = _parts(64)
  for key in ("flops", "bytes accessed"):
    assert sum(p[key] for p in narrow.values()) == total[key]
  # fc1 and fc2, forward and both backward products: at least the MLP's.
  assert narrow["MLPs"]["flops"] >= 2 * BATCH * TOKENS * DIM * 64 * 2 * 3
  for name in ("attention", "MLPs", "norms", "optimizer update"):
    assert narrow[name]["bytes accessed"] > 0, name
  assert narrow["MoE block"] == narrow["collectives"] == {"flops": 0.0, "bytes accessed": 0.0}
  assert narrow["other"]["flops"] < 0.05 * total["flops"]
  wide, _ = _parts(256)
  # Four times the width: the MLP's products four times over, the attention's unchanged.
  assert 3.5 < wide["MLPs"]["flops"] / narrow["MLPs"]["flops"] <= 4
  assert wide["MLPs"]["bytes accessed"] > 2 * narrow["MLPs"]["bytes accessed"]
  assert wide["attention"] == narrow["attention"]
  # Adam reads and writes every parameter, and the MLP's grew four times.
  optimizer = [p["optimizer update"]["bytes accessed"] for p in (narrow, wide)]
  assert optimizer[1] > 2 * optimizer[0]


@pytest.mark.compile_tpu
def test_a_tpu_s_batched_dots_count_the_flops_xla_counts():
  try:
    mesh = Mesh(np.array(devices(get_target("v5e-8"))[:1]), ("data",))
  except UserError as e:  # libtpu cannot describe the target here.
    pytest.skip(str(e))
  spec = jax.ShapeDtypeStruct((32, 197, 6, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def attention(q, k, v):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits).astype(v.dtype), v))

  with jax.set_mesh(mesh), persistent_cache_off():
    compiled = jax.jit(jax.grad(attention, (0, 1, 2))).lower(spec, spec, spec).compile()
  text = compiled.as_text()
  # Its products are `convolution`s whose batch is a window over an input dilated as wide (one
  # tap in 32 x 6 meets an element); they are nearly all the FLOPs, the softmax's the rest.
  assert "lhs_dilate=" in text
  assert analysis.optimized_hlo_cost(text)["flops"] == pytest.approx(
      analysis.cost(compiled)["flops"], rel=1e-3
  )
