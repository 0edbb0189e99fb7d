"""Sparse mixture-of-experts: routing, dispatch and the MoE feed-forward layer."""

# Registers the experimental dispatches in DISPATCH_ALGORITHMS.
from fairmoe_jax.moe import experimental  # noqa: F401
from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    DispatchStats,
    ExpertWeights,
    compute_capacity,
    dispatch_and_combine_masks,
)
from fairmoe_jax.moe.layer import EXPERT_AXIS, MoEAux, SparseMoE
from fairmoe_jax.moe.routers import (
    ExpertChoiceRouter,
    NoisyTopKRouter,
    RouterOutput,
    TopKRouter,
    route_from_logits,
)

__all__ = [
    "DISPATCH_ALGORITHMS",
    "EXPERT_AXIS",
    "ExpertChoiceRouter",
    "ExpertWeights",
    "NoisyTopKRouter",
    "DispatchStats",
    "MoEAux",
    "RouterOutput",
    "SparseMoE",
    "TopKRouter",
    "compute_capacity",
    "dispatch_and_combine_masks",
    "route_from_logits",
]
