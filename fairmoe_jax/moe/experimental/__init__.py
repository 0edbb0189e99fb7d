"""The dispatches `auto` never picks, beside the main path of `fairmoe_jax.moe.dispatch`.

Each keeps the dispatch signature, is tested against the `dense` oracle, and registers itself in
`DISPATCH_ALGORITHMS` when this package is imported (as `fairmoe_jax.moe` does):

* `einsum_fused` (`fused_mlp`): `einsum` with the expert MLP in Pallas kernels on a TPU.
* `sort_blocks`: `sort`'s capacity semantics, the MLP on blocks of the served choices only.
* `blocksparse`: dropless, the MLP on blocks of expert-sorted rows (MegaBlocks).
"""

from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS
from fairmoe_jax.moe.experimental.blocksparse import moe_blocksparse
from fairmoe_jax.moe.experimental.fused_mlp import moe_einsum_fused
from fairmoe_jax.moe.experimental.sort_blocks import moe_sort_blocks

DISPATCH_ALGORITHMS.update(
    einsum_fused=moe_einsum_fused, sort_blocks=moe_sort_blocks, blocksparse=moe_blocksparse
)

__all__ = ["moe_blocksparse", "moe_einsum_fused", "moe_sort_blocks"]
