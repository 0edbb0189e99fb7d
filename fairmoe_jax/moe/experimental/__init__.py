"""The dispatches `auto` never picks, beside the main path of `fairmoe_jax.moe.dispatch`.

Each keeps the dispatch signature, is tested against the `dense` oracle like the main ones, and
registers itself in `DISPATCH_ALGORITHMS` under its name when this package is imported (which
`fairmoe_jax.moe` does), so `moe.dispatch=<name>` selects it:

* `einsum_fused` (`fused_mlp`): `einsum` with the expert MLP in one Pallas kernel per pass on a
  TPU, the hidden activation never in memory; on every other platform, `einsum` itself.
* `sort_blocks` (`sort_blocks`): `sort`'s capacity semantics, the expert MLP on blocks of the
  served choices only (no empty capacity slot computed).
* `blocksparse` (`blocksparse`): dropless, the expert MLP on fixed-size blocks of expert-sorted
  rows with a block-to-expert map (MegaBlocks); computes only the real rows, rounded up to a
  block per expert.
"""

from fairmoe_jax.moe.dispatch import DISPATCH_ALGORITHMS
from fairmoe_jax.moe.experimental.blocksparse import moe_blocksparse
from fairmoe_jax.moe.experimental.fused_mlp import moe_einsum_fused
from fairmoe_jax.moe.experimental.sort_blocks import moe_sort_blocks

DISPATCH_ALGORITHMS.update(
    einsum_fused=moe_einsum_fused, sort_blocks=moe_sort_blocks, blocksparse=moe_blocksparse
)

__all__ = ["moe_blocksparse", "moe_einsum_fused", "moe_sort_blocks"]
