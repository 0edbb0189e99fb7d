"""`blocksparse` dispatch: dropless, the expert MLP on fixed-size blocks of expert-sorted rows.

The MegaBlocks idea (Gale et al. 2023) in JAX. All T * k choices are sorted by expert; each
expert's rows are padded up to a multiple of the block size B, so its rows fill whole blocks,
and the block bounds of every expert say which expert's weights each block uses. The expert MLP
then runs expert by expert and, inside, block by block (loops whose trip counts are known only
at run time), so the work is T * k rows rounded up to a block per expert, at most
T * k + E * (B - 1) rows, never the E * C slots of a capacity buffer, and never the E-fold work
of a grouped matmul lowered densely (`jax.lax.ragged_dot` on XLA's CPU backend, `dropless`).

Nothing is dropped; the results equal `moe_dense`'s. Data movement reuses `sort`'s row
gathers in both passes (`gather_slots` / `combine_slots` with a `SlotPlan` whose slots are the
block rows). The block MLP has a custom VJP with the same loops, which accumulates each
expert's weight gradient over its blocks and writes it once, so no [blocks, D, H] copy of the
weights is ever made.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, dropless_stats
from fairmoe_jax.moe.dispatch.experts import ExpertWeights, add_bias, gelu_exact
from fairmoe_jax.moe.dispatch.slots import SlotPlan, combine_slots, gather_slots

# Block sizes the automatic choice picks from (`choose_block_size`).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 128


def choose_block_size(num_choices: int, num_experts: int) -> int:
  """Rows per block: the power of two nearest half an expert's average load, in [16, 128].

  Each expert wastes B/2 rows on average (its last block is part-full), while larger blocks
  run the per-block matmuls more efficiently; half the average load keeps the waste near a
  quarter of a block per row-block and was the fastest measured on CPU (docs/benchmarks.md).
  """
  half_load = max(num_choices / num_experts / 2, 1.0)
  return int(min(max(2 ** round(math.log2(half_load)), MIN_BLOCK_SIZE), MAX_BLOCK_SIZE))


@struct.dataclass
class BlockPlan:
  """Expert-sorted rows in blocks of B, and which expert each block belongs to.

  Attributes:
    slots: the row <-> choice maps as a `SlotPlan` over the [num_rows] block rows (one
      "expert" axis of size 1 in `slot_choice`, so `sort`'s gathers apply unchanged).
    block_bounds: [E + 1] int32, expert e's blocks are [block_bounds[e], block_bounds[e + 1]);
      blocks from block_bounds[E] on are computed by no expert (empty rows, and with `kept`,
      the dropped choices; then block_bounds has one more entry).
    block_size: rows per block.
  """

  slots: SlotPlan
  block_bounds: jax.Array
  block_size: int = struct.field(pytree_node=False)


def max_blocks(num_choices: int, num_experts: int, block_size: int) -> int:
  """Blocks needed in the worst case: sum_e ceil(n_e / B) <= (N + E (B - 1)) / B."""
  return (num_choices + num_experts * (block_size - 1)) // block_size


def block_plan(
    expert_index: jax.Array,
    *,
    num_experts: int,
    block_size: int,
    kept: jax.Array | None = None,
) -> BlockPlan:
  """Sorts the [G, S, k] choices by expert into blocks of `block_size` rows.

  With `kept` ([G, S, k] bool, e.g. a capacity plan's), only the kept choices get rows of
  their experts' blocks: the others are sorted behind every expert, into blocks that no
  expert computes, so their outputs are zero, as a dropped choice's are.
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
  """The expert whose blocks [block_bounds[e], block_bounds[e + 1]) hold each block number
  (clipped to [0, num_experts - 1] for blocks past every expert's)."""
  expert = jnp.searchsorted(block_bounds, block, side="right") - 1
  return jnp.clip(expert, 0, num_experts - 1).astype(jnp.int32)


@jax.custom_vjp
def block_mlp(rows: jax.Array, block_bounds: jax.Array, experts: ExpertWeights) -> jax.Array:
  """Expert e's MLP on blocks [block_bounds[e], block_bounds[e + 1]) of rows [NB, B, D].

  Blocks from `block_bounds[-1]` on are not computed: their outputs are zero. The loops run
  expert by expert, so each expert's weights are sliced (and, backwards, its gradients
  written) once, however many blocks it has.
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
  """float32 zeros of `shape` that vary over the mesh axes any of `like` varies over (inside
  `shard_map`), so that a loop may accumulate gradients of varying weights in them."""
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
      # The weight gradients are sums over every block of the expert: accumulated in float32
      # whatever the compute dtype (a bfloat16 accumulator rounds at every block).
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


def ragged_block_mlp(
    rows: jax.Array, block_bounds: jax.Array, experts: ExpertWeights
) -> jax.Array:
  """`block_mlp` with two `jax.lax.ragged_dot` grouped matmuls over all blocks instead of loops.

  Expert e's group is its blocks' rows; the rows of blocks from `block_bounds[E]` on belong to
  no group and their outputs are zero, as in `block_mlp`. The matmuls accumulate and return
  float32 (then cast), so the weight gradients, ragged_dot's transposes, are float32 sums over
  each expert's rows; the biases are gathered in float32 (`add_bias`) for the same reason.
  """
  num_blocks, block_size, dim = rows.shape
  num_experts = experts.num_experts
  group_sizes = (block_bounds[1 : num_experts + 1] - block_bounds[:num_experts]) * block_size
  block = jnp.arange(num_blocks * block_size, dtype=jnp.int32) // block_size
  row_expert = _block_expert(block, block_bounds, num_experts)
  w = experts.cast(rows.dtype)

  def grouped_matmul(lhs, rhs):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

  def row_bias(bias):  # Its transpose: a float32 scatter-add with sorted indices.
    return bias.at[row_expert].get(indices_are_sorted=True)

  pre = add_bias(grouped_matmul(rows.reshape(-1, dim), w.w1), row_bias(experts.b1))
  h = gelu_exact(pre.astype(rows.dtype))
  out = add_bias(grouped_matmul(h, w.w2), row_bias(experts.b2))
  out = jnp.where((block < block_bounds[num_experts])[:, None], out, 0.0)
  return out.astype(rows.dtype).reshape(rows.shape)


# How `apply_on_blocks` runs the expert MLP on the blocks (`matmul=`):
#   loop: `block_mlp`, loops over the experts and their blocks with one B x D x H matmul at a
#     time: the work and memory are the real blocks' only. The default on every platform.
#   ragged_dot: `ragged_block_mlp`, XLA's grouped matmul over all blocks at once. XLA's CPU
#     backend lowers it as E dense matmuls, and the H100 compiler (jax 0.10.2) needs 10 to 170
#     times the loops' scratch for it (23.5 GB against 0.22 GB at DeiT-S, 32 images, E=64,
#     bfloat16; docs/benchmarks.md), as for `dropless`: an option for a compiler with a
#     grouped-matmul kernel, not a default.
# The two give the same results up to float rounding.
BLOCK_MATMULS = ("loop", "ragged_dot")


def _check_block_matmul(matmul: str) -> None:
  if matmul not in BLOCK_MATMULS:
    raise ValueError(f"matmul={matmul!r}; known: {', '.join(BLOCK_MATMULS)}")


def apply_on_blocks(
    x: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    plan: BlockPlan,
    matmul: str = "loop",
) -> jax.Array:
  """The layer output [G, S, D] of tokens x [G, S, D] with gates [G, S, k], computed on the
  plan's blocks by `matmul` (`BLOCK_MATMULS`)."""
  _check_block_matmul(matmul)
  num_groups, group_size, dim = x.shape
  tokens = x.reshape(num_groups * group_size, dim)
  rows = gather_slots(tokens, plan.slots).reshape(-1, plan.block_size, dim)
  mlp = {"loop": block_mlp, "ragged_dot": ragged_block_mlp}[matmul]
  outputs = mlp(rows, plan.block_bounds, experts)
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
    matmul: str = "loop",
) -> tuple[jax.Array, DispatchStats]:
  """Dropless dispatch on blocks of expert-sorted rows; `capacity` is ignored.

  `block_size` None chooses it from the average load (`choose_block_size`); `matmul` says how
  the expert MLP runs on the blocks (`BLOCK_MATMULS`).
  """
  del capacity
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  if block_size is None:
    block_size = choose_block_size(expert_index.size, num_experts)
  plan = block_plan(expert_index, num_experts=num_experts, block_size=block_size)
  return apply_on_blocks(x, gates, experts, plan, matmul), plan.slots.stats
