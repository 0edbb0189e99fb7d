"""The methods of paper Tables 1-2, selected by `config.method`, one module per family.

| method            | module        | model                         |
|-------------------|---------------|-------------------------------|
| fairsmoe          | fairsmoe.py   | backbone + MoE, FGR + FEM     |
| fairsmoe_no_fgr   | fairsmoe.py   | plain gate + FEM (Table 2)    |
| fairsmoe_no_fem   | fairsmoe.py   | FGR only (Table 2)            |
| vanilla_smoe      | smoe.py       | backbone + MoE, top-k router  |
| vanilla_smoe_psi  | smoe.py       | vanilla_smoe + lambda L_Psi   |
| smoe              | smoe.py       | backbone + MoE, `moe.router`  |
| muffin            | muffin.py     | 2+ backbones, fusion head     |
| multifair         | multifair.py  | backbone, cross-group mixup   |

Each is a `base.Method`; `base.make_loss_fn` sums a method's named loss terms.
"""

from __future__ import annotations

from fairmoe_jax.methods.base import Method, make_loss_fn
from fairmoe_jax.methods.fairsmoe import FairSMoE
from fairmoe_jax.methods.muffin import MuffinMethod, muffin_attributes
from fairmoe_jax.methods.multifair import MultiFair
from fairmoe_jax.methods.smoe import PlainSMoE

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        FairSMoE("fairsmoe", guided=True, managed=True),
        FairSMoE("fairsmoe_no_fgr", guided=False, managed=True),
        FairSMoE("fairsmoe_no_fem", guided=True, managed=False),
        PlainSMoE("vanilla_smoe", fixed_router="topk"),
        PlainSMoE("vanilla_smoe_psi", fixed_router="topk", fairness_loss=True),
        PlainSMoE("smoe", fixed_router=None),
        MuffinMethod(),
        MultiFair(),
    )
}

__all__ = ["METHODS", "Method", "make_loss_fn", "muffin_attributes"]
