"""`sort_blocks` dispatch: `sort`'s capacity plan (`sort_slot_plan`, exactly `einsum`'s drops),
then the served choices sorted into their experts' blocks (`blocksparse.block_plan(kept=...)`),
so no empty capacity slot is computed. `sort`'s output up to float rounding (the weight
gradients sum in another order), so `sort` stays the default and recorded runs reproduce.
"""

from __future__ import annotations

import jax

from fairmoe_jax.moe.dispatch import spmd
from fairmoe_jax.moe.dispatch.base import check_inputs
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, resolve_capacity
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.sort import moe_sort, sort_slot_plan
from fairmoe_jax.moe.experimental.blocksparse import apply_on_blocks, block_plan, choose_block_size


def moe_sort_blocks(
    x: jax.Array,
    expert_index: jax.Array,
    gates: jax.Array,
    experts: ExpertWeights,
    *,
    capacity: int | None = None,
    per_group: bool = False,
) -> tuple[jax.Array, DispatchStats]:
  """`moe_sort` with the expert MLP on blocks of the served choices (no empty slot computed).
  `per_group` (the layer's where no mesh is known): `moe_sort` itself, which the SPMD partitioner
  splits over a sharded batch; the blocks sort every group's choices together."""
  if per_group:
    spmd.report_fallback("sort_blocks", "no mesh: sort per group, every empty capacity slot run")
    return moe_sort(x, expert_index, gates, experts, capacity=capacity)
  check_inputs(x, expert_index, gates)
  num_experts = experts.num_experts
  capacity = resolve_capacity(capacity, x.shape[1])
  stats = sort_slot_plan(expert_index, num_experts=num_experts, capacity=capacity).stats
  blocks = block_plan(
      expert_index,
      num_experts=num_experts,
      block_size=choose_block_size(expert_index.size, num_experts),
      kept=stats.kept,
  )
  return apply_on_blocks(x, gates, experts, blocks), stats
