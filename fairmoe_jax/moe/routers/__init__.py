"""Routers of sparse MoE layers (logits always float32).

* `base`: the token-choice router protocol, `RouterOutput` and shared pieces.
* `topk`: `TopKRouter`, softmax top-k (paper Eq. 5).
* `noisy_topk`: `NoisyTopKRouter` (Shazeer et al. 2017).
* `expert_choice`: `ExpertChoiceRouter` (Zhou et al. 2022), its own path through `SparseMoE`.
"""

from fairmoe_jax.moe.routers.base import (
    RouterOutput,
    load_balance_loss,
    route_from_logits,
    router_z_loss,
)
from fairmoe_jax.moe.routers.expert_choice import (
    ExpertChoiceRouter,
    apply_expert_choice,
    expert_choice_from_logits,
)
from fairmoe_jax.moe.routers.noisy_topk import (
    NoisyRouterOutput,
    NoisyTopKRouter,
    noisy_top_k_from_logits,
)
from fairmoe_jax.moe.routers.topk import TopKRouter

__all__ = [
    "ExpertChoiceRouter",
    "NoisyRouterOutput",
    "NoisyTopKRouter",
    "RouterOutput",
    "TopKRouter",
    "apply_expert_choice",
    "expert_choice_from_logits",
    "load_balance_loss",
    "noisy_top_k_from_logits",
    "route_from_logits",
    "router_z_loss",
]
