"""Training-time fairness machinery: differentiable fairness surrogates, cross-group mixup and
FairSMoE's expert management."""

from fairmoe_jax.fairness.experts import ExpertAllocator, attribute_assignment
from fairmoe_jax.fairness.surrogates import PSI_RULES, PSI_SURROGATES, fairness_surrogate

__all__ = [
    "ExpertAllocator",
    "PSI_RULES",
    "PSI_SURROGATES",
    "attribute_assignment",
    "fairness_surrogate",
]
