"""Dispatch: serving routing decisions with the experts, under a capacity limit.

Interchangeable dispatch algorithms with one interface (`base`), each in the
module of its name:

    y, stats = DISPATCH_ALGORITHMS[name](x, expert_index, gates, experts, capacity=C)

The main path (what `auto` picks from, and the dense oracle):

* `dense`: every expert on every token; the test oracle.
* `einsum`: GShard / V-MoE one-hot [G, S, E, C] dispatch and combine
  tensors; the reference for the capacity semantics.
* `sort`: the same capacity semantics and expert buffers as `einsum`,
  built by sorting, with no [S, E, C] tensor.
* `dropless`: `jax.lax.ragged_dot` grouped matmuls; nothing is
  ever dropped.

The experimental dispatches `einsum_fused`, `sort_blocks` and `blocksparse`
live in `fairmoe_jax.moe.experimental`, which registers them here under those
names when `fairmoe_jax.moe` is imported.

Beside them: `capacity` (expert capacity and `DispatchStats`), `experts` (the
stacked expert weights `ExpertWeights`), `slots` (the row gathers `sort` moves
data with), `data_parallel` (any algorithm under `jax.shard_map`, each device
on its own groups), `expert_parallel` (the capacity algorithms under
`jax.shard_map` with all-to-all over an "expert" mesh axis), `spmd` (what those
two share) and `batch_priority` (V-MoE batch-priority ordering of the tokens of
each group around a capacity dispatch).
"""

from fairmoe_jax.moe.dispatch.base import DispatchAlgorithm, check_inputs
from fairmoe_jax.moe.dispatch.batch_priority import (
    batch_priority_order,
    priority_scores,
    reorder_tokens,
    restore_token_order,
)
from fairmoe_jax.moe.dispatch.capacity import (
    DispatchStats,
    compute_capacity,
    dropless_stats,
    resolve_capacity,
)
from fairmoe_jax.moe.dispatch.data_parallel import data_parallel_moe, per_device
from fairmoe_jax.moe.dispatch.dense import moe_dense
from fairmoe_jax.moe.dispatch.dropless import moe_dropless
from fairmoe_jax.moe.dispatch.einsum import (
    dispatch_and_combine_masks,
    einsum_combine,
    einsum_dispatch,
    moe_einsum,
)
from fairmoe_jax.moe.dispatch.expert_parallel import EP_ALGORITHMS, expert_parallel_moe
from fairmoe_jax.moe.dispatch.experts import ExpertWeights
from fairmoe_jax.moe.dispatch.sort import (
    SlotPlan,
    combine_slots,
    gather_slots,
    moe_sort,
    sort_slot_plan,
)

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
    "SlotPlan",
    "batch_priority_order",
    "check_inputs",
    "combine_slots",
    "compute_capacity",
    "data_parallel_moe",
    "dispatch_and_combine_masks",
    "dropless_stats",
    "einsum_combine",
    "einsum_dispatch",
    "expert_parallel_moe",
    "gather_slots",
    "moe_dense",
    "moe_dropless",
    "moe_einsum",
    "moe_sort",
    "per_device",
    "priority_scores",
    "reorder_tokens",
    "resolve_capacity",
    "restore_token_order",
    "sort_slot_plan",
]
