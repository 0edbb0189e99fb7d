"""`blocksparse` dispatch: dropless, the expert MLP on fixed-size blocks of expert-sorted rows.

MegaBlocks (Gale et al. 2023) in JAX: the T * k choices are sorted by expert, each expert's rows
padded to whole blocks of B, and the MLP runs expert by expert, block by block (run-time trip
counts): at most T * k + E * (B - 1) rows, never E * C capacity slots nor a densely lowered
grouped matmul's E-fold work. Results equal `moe_dense`'s. Data moves by `sort`'s row gathers
(`slots`); the block MLP's custom VJP accumulates each expert's weight gradient over its blocks
and writes it once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.dropless import moe_dropless
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, gelu_exact
from fairmoe_jax.moe.dispatch.slots import SlotPlan, combine_slots, gather_slots

# Block sizes the automatic choice picks from (`choose_block_size`).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 128


def choose_block_size(num_choices: int, num_experts: int) -> int:
  """Rows per block: the power of two nearest half an expert's mean load, in [16, 128]
  (the fastest on CPU, docs/benchmarks.md: waste vs. per-block matmul efficiency).
  """
  half_load = max(num_choices / num_experts / 2, 1.0)
  return int(min(max(2 ** round(math.log2(half_load)), MIN_BLOCK_SIZE), MAX_BLOCK_SIZE))


@struct.dataclass
class BlockPlan:
  """Expert-sorted rows in blocks of B, and which expert each block belongs to.

  Attributes:
    slots: a `SlotPlan` over the block rows (an "expert" axis of size 1), for `sort`'s gathers.
    block_bounds: [E + 1] int32, expert e's blocks are [block_bounds[e], block_bounds[e + 1]);
      later blocks are computed by no expert (with `kept`, one more entry for the dropped).
    block_size: rows per block.
  """

  slots: SlotPlan
  block_bounds: jax.Array
  block_size: int = struct.field(pytree_node=False)


def max_blocks(num_choices: int, num_experts: int, block_size: int) -> int:
  """Blocks needed in the worst case: sum_e ceil(n_e / B) <= (N + E (B - 1)) / B."""
  return (num_choices + num_experts * (block_size - 1)) // block_size


def block_plan(
    expert_index: jax.Array, *, num_experts: int, block_size: int, kept: jax.Array | None = None
) -> BlockPlan:
  """Sorts the [G, S, k] choices by expert into blocks of `block_size` rows.

  With `kept` ([G, S, k] bool), the other choices go to blocks behind every expert, computed by
  none, so their outputs are zero, as a dropped choice's are.
  """
  num_groups, group_size, top_k = expert_index.shape
  stats = dropless_stats(expert_index, num_experts) if kept is None else None
  if kept is not None:
    expert_index = jnp.where(kept, expert_index, num_experts)
    num_experts += 1
  num_choices = num_groups * group_size * top_k
  num_rows = max_blocks(num_choices, num_experts, block_size) * block_size

  flat_expert = expert_index.reshape(num_choices).astype(jnp.int32)
  choice = jnp.arange(num_choices, dtype=jnp.int32)  # Choice t * k + j, as in `SlotPlan`.
  sorted_expert, sorted_choice = jax.lax.sort(
      (flat_expert, choice), dimension=0, is_stable=True, num_keys=1
  )
  bounds = jnp.searchsorted(sorted_expert, jnp.arange(num_experts + 1, dtype=jnp.int32))
  start, count = bounds[:-1], bounds[1:] - bounds[:-1]
  blocks = -(-count // block_size)
  block_bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks)])
  num_blocks = block_bounds[-1]

  # Each sorted choice goes to its expert's first block + its rank within the expert.
  rank = jnp.arange(num_choices, dtype=jnp.int32) - start[sorted_expert]
  sorted_row = block_bounds[sorted_expert] * block_size + rank
  choice_row = (
      jnp.zeros((num_choices,), jnp.int32).at[sorted_choice].set(sorted_row, unique_indices=True)
  )

  # Each row: its block's expert, and the sorted choice it holds unless it is padding.
  row = jnp.arange(num_rows, dtype=jnp.int32)
  block = row // block_size
  row_expert = _block_expert(block, block_bounds, num_experts)
  offset = row - block_bounds[row_expert] * block_size
  held = (offset < count[row_expert]) & (block < num_blocks)
  row_choice = jnp.where(
      held, sorted_choice[jnp.clip(start[row_expert] + offset, 0, num_choices - 1)], num_choices
  )
  slots = SlotPlan(
      slot_choice=row_choice[None, :],
      choice_slot=choice_row.reshape(num_groups * group_size, top_k),
      stats=stats,
  )
  return BlockPlan(slots=slots, block_bounds=block_bounds, block_size=block_size)


def _block_expert(block: jax.Array, block_bounds: jax.Array, num_experts: int) -> jax.Array:
  """The expert whose blocks hold each block number (clipped to [0, E - 1])."""
  expert = jnp.searchsorted(block_bounds, block, side="right") - 1
  return jnp.clip(expert, 0, num_experts - 1).astype(jnp.int32)


@jax.custom_vjp
def block_mlp(rows: jax.Array, block_bounds: jax.Array, experts: ExpertWeights) -> jax.Array:
  """Expert e's MLP on blocks [block_bounds[e], block_bounds[e + 1]) of rows [NB, B, D].

  Blocks from `block_bounds[-1]` on give zeros. Each expert's weights are sliced (and its
  gradients written) once, however many blocks it has.
  """
  return _block_mlp_fwd(rows, block_bounds, experts)[0]


def _block_mlp_fwd(rows, block_bounds, experts):
  w = experts.cast(rows.dtype)

  def expert_body(e, out):
    w1, b1, w2, b2 = w.w1[e], w.b1[e], w.w2[e], w.b2[e]

    def block_body(b, out):
      return out.at[b].set(gelu_exact(rows[b] @ w1 + b1) @ w2 + b2)

    return jax.lax.fori_loop(block_bounds[e], block_bounds[e + 1], block_body, out)

  out = jax.lax.fori_loop(0, w.num_experts, expert_body, jnp.zeros_like(rows))
  # The hidden pre-activations are recomputed backwards (one more matmul per block) rather than
  # kept: a [blocks, B, H] buffer sized for the worst case costs more to fill than to redo.
  return out, (rows, block_bounds, experts)


def _zeros(shape: tuple[int, ...], *like: jax.Array) -> jax.Array:
  """float32 zeros varying over the mesh axes `like` varies over, to accumulate gradients in."""
  axes = set().union(*(spmd.varying_axes(a) for a in like))
  return spmd.vary_over(jnp.zeros(shape, jnp.float32), tuple(sorted(axes)))


def _block_mlp_bwd(residuals, d_out):
  rows, block_bounds, experts = residuals
  w = experts.cast(rows.dtype)

  def matmul(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)

  def expert_body(e, carry):
    d_rows, grads = carry
    w1, b1, w2 = w.w1[e], w.b1[e], w.w2[e]

    def block_body(b, carry):
      d_rows, g = carry
      h, gelu_vjp = jax.vjp(gelu_exact, rows[b] @ w1 + b1)
      d_o = d_out[b]
      (d_pre,) = gelu_vjp(d_o @ w2.T)
      # Accumulated in float32 whatever the compute dtype (bfloat16 would round at every block).
      g = ExpertWeights(
          w1=g.w1 + matmul(rows[b].T, d_pre),
          b1=g.b1 + d_pre.astype(jnp.float32).sum(0),
          w2=g.w2 + matmul(h.T, d_o),
          b2=g.b2 + d_o.astype(jnp.float32).sum(0),
      )
      return d_rows.at[b].set(d_pre @ w1.T), g

    local = jax.tree.map(lambda a: _zeros(a.shape[1:], a, rows), w)
    d_rows, g = jax.lax.fori_loop(block_bounds[e], block_bounds[e + 1], block_body, (d_rows, local))
    return d_rows, jax.tree.map(lambda all_, one: all_.at[e].set(one), grads, g)

  zeros = jax.tree.map(lambda a: _zeros(a.shape, a, rows), w)
  d_rows, grads = jax.lax.fori_loop(0, w.num_experts, expert_body, (jnp.zeros_like(rows), zeros))
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, experts)
  return d_rows, None, grads


block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)


def apply_on_blocks(
    x: jax.Array, gates: jax.Array, experts: ExpertWeights, plan: BlockPlan
) -> jax.Array:
  """Layer output [G, S, D] of x [G, S, D], gates [G, S, k] on the plan's blocks."""
  num_groups, group_size, dim = x.shape
  tokens = x.reshape(num_groups * group_size, dim)
  rows = gather_slots(tokens, plan.slots).reshape(-1, plan.block_size, dim)
  outputs = block_mlp(rows, plan.block_bounds, experts)
  gates = gates.reshape(num_groups * group_size, -1)
  return combine_slots(outputs.reshape(1, -1, dim), gates, plan.slots).reshape(x.shape)


def moe_blocksparse(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
    block_size: int | None = None,
    per_group: bool = False,
) -> tuple[jax.Array, DispatchStats]:
  """Dropless dispatch on blocks of expert-sorted rows (`block_size` None: `choose_block_size`);
  `capacity` is ignored. `per_group` (the layer's where no mesh is known): `moe_dropless`'s per
  group path, which the SPMD partitioner splits over a sharded batch (the blocks sort every
  group's choices together)."""
  if per_group:
    spmd.report_fallback(
        "blocksparse", f"no mesh: dropless per group, {experts.num_experts} times the expert FLOPs"
    )
    return moe_dropless(x, expert_index, gates, experts, per_group=True)
  del capacity
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  if block_size is None:
    block_size = choose_block_size(expert_index.size, num_experts)
  plan = block_plan(expert_index, num_experts=num_experts, block_size=block_size)
  return apply_on_blocks(x, gates, experts, plan), plan.slots.stats
