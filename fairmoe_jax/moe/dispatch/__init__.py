"""Dispatch: serving routing decisions with the experts, under a capacity limit.

    y, stats = DISPATCH_ALGORITHMS[name](x, expert_index, gates, experts, capacity=C)

The main path, one module each (interface in `base`):

* `dense`: every expert on every token; the test oracle.
* `einsum`: GShard / V-MoE one-hot [G, S, E, C] tensors; the reference capacity semantics.
* `sort`: the same semantics and buffers, built by sorting, with no [S, E, C] tensor.
* `dropless`: grouped matmuls (`jax.lax.ragged_dot`); nothing is dropped.

`fairmoe_jax.moe.experimental` registers `einsum_fused`, `sort_blocks` and `blocksparse` here
when `fairmoe_jax.moe` is imported. Beside them: `capacity`, `experts` (`ExpertWeights`),
`slots` (`sort`'s row gathers), `data_parallel` and `expert_parallel` (under `jax.shard_map`),
`spmd` (what those two share) and `batch_priority` (V-MoE's token order).
"""

from fairmoe_jax.moe.dispatch.base import DispatchAlgorithm
from fairmoe_jax.moe.dispatch.batch_priority import (
    batch_priority_order,
    reorder_tokens,
    restore_token_order,
)
from fairmoe_jax.moe.dispatch.capacity import DispatchStats, compute_capacity
from fairmoe_jax.moe.dispatch.data_parallel import data_parallel_moe, per_device
from fairmoe_jax.moe.dispatch.dense import moe_dense
from fairmoe_jax.moe.dispatch.dropless import moe_dropless
from fairmoe_jax.moe.dispatch.einsum import dispatch_and_combine_masks, moe_einsum
from fairmoe_jax.moe.dispatch.expert_parallel import EP_ALGORITHMS, expert_parallel_moe
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.sort import moe_sort, sort_slot_plan

# Dispatch algorithms by name (`SparseMoE(dispatch=...)`, config key `moe.dispatch`);
# `fairmoe_jax.moe.experimental` adds its own.
DISPATCH_ALGORITHMS: dict[str, DispatchAlgorithm] = {
    "dense": moe_dense,
    "einsum": moe_einsum,
    "sort": moe_sort,
    "dropless": moe_dropless,
}

__all__ = [
    "DISPATCH_ALGORITHMS",
    "DispatchAlgorithm",
    "DispatchStats",
    "EP_ALGORITHMS",
    "ExpertWeights",
    "batch_priority_order",
    "compute_capacity",
    "data_parallel_moe",
    "dispatch_and_combine_masks",
    "expert_parallel_moe",
    "moe_dense",
    "moe_dropless",
    "moe_einsum",
    "moe_sort",
    "per_device",
    "reorder_tokens",
    "restore_token_order",
    "sort_slot_plan",
]
