"""A hand-built routing case shared by the MoE layer and dispatch-algorithm tests.

(a, b) means top-1 = expert a, top-2 = expert b; capacity is 3 per expert and example.
"""

import numpy as np

HAND_BUILT_PREFERENCES = [
    # Example 0. Top-1 round: e0 gets t1, t2, t3 (t4 dropped), e1 gets t0, e2 gets
    # t5. Top-2 round: t0 -> e0 is dropped although t0 is the first token (top-1
    # choices come first), t5 -> e0 dropped too; the rest fit.
    [(1, 0), (0, 1), (0, 2), (0, 1), (0, 3), (2, 0)],
    # Example 1: everyone wants (e0, e1); t3..t5 lose both choices.
    [(0, 1)] * 6,
]
HAND_BUILT_EXPECTED_KEPT = np.array(
    [
        [[1, 0], [1, 1], [1, 1], [1, 1], [0, 1], [1, 0]],
        [[1, 1], [1, 1], [1, 1], [0, 0], [0, 0], [0, 0]],
    ],
    bool,
)
