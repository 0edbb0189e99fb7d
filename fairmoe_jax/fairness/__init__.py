"""Training-time fairness machinery: differentiable fairness surrogates and expert management."""

from fairmoe_jax.fairness.experts import ExpertAllocator, initial_assignment
from fairmoe_jax.fairness.surrogates import PSI_SURROGATES, fairness_surrogate

__all__ = ["ExpertAllocator", "PSI_SURROGATES", "fairness_surrogate", "initial_assignment"]
