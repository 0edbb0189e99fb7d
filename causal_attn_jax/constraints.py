"""Markov-blanket constraint on attention heads and its Lagrangian (paper Sec. 3.1, Eqs. 2-3, 6).

Definition 1 bounds, for every token i, tau(A_i.) = sum_j exp(A_ij) and tau(A_.i) by
N - 2 + 2 e^(1/2) <= tau <= N - 1 + e: a row split evenly over two parents gives the lower
bound, a one-hot row (one parent) the upper. We use tau - N instead,

    r_i = sum_j expm1(A_ij),    c_j = sum_i expm1(A_ij),

so that masked and padded entries (A_ij = 0) add exactly 0, the bounds no longer depend on the
length N (lower 2(sqrt(e) - 1), upper e - 1), and nothing cancels catastrophically
(tau is about N, the bounds differ from it by O(1)). Sums are taken in float32 (or float64 when
the probabilities are float64) whatever the compute dtype.

Two facts that follow from the bounds and shape the constraint in practice:
- A softmax row sums to 1 and expm1 is convex, so r <= e - 1 always (equality at one-hot): the
  row-upper constraint can never be violated; it is kept so that the four constraints of the
  spec stay uniform (and it matters for rows that do not sum to 1, e.g. with dropout on A).
- min over rows of r is N expm1(1/N) -> 1 as N grows, so row-lower asks each row to concentrate
  on about two keys; columns are unnormalised and can violate both bounds.

Slack (Definition 2). The encoder tolerates self-loops: Eq. 2 writes the per-token constraints
on the sum of row and column measures, with eps' next to the lower bound H' and eps'' next to the
upper bound H''. We read eps'_max = 0.7045 as the relaxation of the lower bound and
eps''_max = 0.5062 as that of the upper bound, and apply each in full to the row and to the
column bound (r, c >= lower - eps'_max; r, c <= upper + eps''_max). Decoder self-attention has no
self-loop and no slack. How the printed numbers relate to the "1/3 self-loop": 0.5062 is exactly
2 (e^(1/2) - e^(1/3)) = lower - 2 expm1(1/3), the lower-bound shortfall of a row whose two parents
keep 1/3 each next to a 1/3 self-loop when the self-loop entry is not counted. We found no
configuration of 1/3, 1/2, 2/3 weights that gives 0.7045 and use the printed value. A
self-loop row of thirds (r = 3 expm1(1/3) = 1.187 < lower = 1.297) is within the relaxed
encoder bounds.

Decoder columns (no self-loop). Under a causal mask column j can only be fed by rows i >= j; with
no self-loop only by the later rows i > j. Each such entry adds at most expm1(1) = e - 1 to c_j,
so a column with k_j admissible non-self rows has c_j <= k_j (e - 1). Since e - 1 > lower, the
lower bound is reachable iff k_j >= 1: only columns with no later valid row are unsatisfiable,
i.e. the last valid position of each sequence (and, with a sparse pattern ANDed in, any column
that no later row may see). Those columns are excluded from the column constraints and from the
within-bounds fraction instead of being penalised. We compute k_j from the mask itself, so the
rule follows padding and sparse patterns without special cases.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

# Order of the last axis of the violation / multiplier arrays.
CONSTRAINT_NAMES = ("row_lower", "row_upper", "col_lower", "col_upper")


@dataclasses.dataclass(frozen=True)
class Bounds:
  """Definition 1 bounds on r, c (tau - N) and Definition 2 slack maxima.

  Attributes:
    lower: 2 (sqrt(e) - 1), r or c of a row split 1/2, 1/2 (paper's N - 2 + 2 e^(1/2)).
    upper: e - 1, r or c of a one-hot row (paper's N - 1 + e).
    slack_lower: eps'_max, relaxation of the lower bound in the encoder.
    slack_upper: eps''_max, relaxation of the upper bound in the encoder.
  """

  lower: float = 2.0 * (math.sqrt(math.e) - 1.0)
  upper: float = math.e - 1.0
  slack_lower: float = 0.7045
  slack_upper: float = 0.5062

  def for_attention(self, *, self_attention: bool, decoder: bool) -> tuple[float, float]:
    """(lower, upper) for one attention: slack only for encoder self-attention (self-loops)."""
    if self_attention and not decoder:
      return self.lower - self.slack_lower, self.upper + self.slack_upper
    return self.lower, self.upper


BOUNDS = Bounds()


@struct.dataclass
class ConstraintStats:
  """Constraint measurements of one attention layer.

  Attributes:
    violations: [H, 4] hinge violations, mean over valid rows / columns and batch, in the order
      CONSTRAINT_NAMES; differentiable w.r.t. the attention probabilities.
    rows_within: scalar fraction of valid (batch, head, row) with lower <= r <= upper.
    cols_within: scalar fraction of constrained (batch, head, column) with lower <= c <= upper.
  """

  violations: jax.Array
  rows_within: jax.Array
  cols_within: jax.Array


def _sum_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """float32 for float32 and narrower inputs; float64 stays float64 (finite-difference tests)."""
  return jnp.promote_types(dtype, jnp.float32)


def blanket_sums(probs: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Row and column Markov-blanket measures of attention probabilities.

  Args:
    probs: [B, H, Nq, Nk] attention probabilities.
    mask: bool broadcastable to probs (True = allowed), or None; masked entries contribute 0
      even if probs is not 0 there.

  Returns:
    (r [B, H, Nq], c [B, H, Nk]): r_i = sum_j expm1(A_ij), c_j = sum_i expm1(A_ij).
  """
  e = jnp.expm1(probs.astype(_sum_dtype(probs.dtype)))
  if mask is not None:
    e = jnp.where(mask, e, 0.0)
  return e.sum(axis=-1), e.sum(axis=-2)


def _weighted_mean(values: jax.Array, weights: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  return (values * weights).sum(axes) / jnp.maximum(weights.sum(axes), 1.0)


def constraint_violations(
    probs: jax.Array,
    mask: jax.Array | None,
    *,
    self_attention: bool,
    decoder: bool,
    valid_q: jax.Array | None = None,
    valid_k: jax.Array | None = None,
    bounds: Bounds = BOUNDS,
) -> ConstraintStats:
  """Per-head hinge violations of the Markov-blanket bounds and within-bounds fractions.

  Args:
    probs: [B, H, Nq, Nk] attention probabilities.
    mask: bool broadcastable to [B, H, Nq, Nk] (the mask the attention used), or None.
    self_attention: encoder self-attention gets the slack; cross-attention does not (the
      paper constrains self-attention only; this allows monitoring cross-attention).
    decoder: causal self-attention: no slack, and columns that no later valid row may attend to
      (k_j = 0 in the module docstring) are excluded from the column constraints.
    valid_q: [B, Nq] bool (default all valid): padded rows are excluded.
    valid_k: [B, Nk] bool (default all valid): padded columns are excluded.
    bounds: the bounds and slacks.

  Returns:
    ConstraintStats with violations [H, 4] = mean over valid rows (columns) and batch of
    relu(lower - r), relu(r - upper), relu(lower - c), relu(c - upper).
  """
  batch, heads, n_q, n_k = probs.shape
  lower, upper = bounds.for_attention(self_attention=self_attention, decoder=decoder)
  valid_q = jnp.ones((batch, n_q), bool) if valid_q is None else jnp.asarray(valid_q, bool)
  valid_k = jnp.ones((batch, n_k), bool) if valid_k is None else jnp.asarray(valid_k, bool)
  allowed = jnp.ones((1, 1, n_q, n_k), bool) if mask is None else jnp.asarray(mask, bool)
  allowed = allowed & valid_q[:, None, :, None] & valid_k[:, None, None, :]
  r, c = blanket_sums(probs, allowed)

  # A row with no allowed key has r = 0 whatever the parameters: not a constraint.
  row_w = allowed.any(axis=-1)
  # Rows that may feed column j; without self-loops (decoder) the diagonal does not count.
  feeders = allowed
  if decoder:
    if n_q != n_k:
      raise ValueError("decoder=True needs square self-attention probabilities")
    feeders = feeders & ~jnp.eye(n_q, dtype=bool)
  num_feeders = feeders.sum(axis=-2)
  col_w = num_feeders * (math.e - 1.0) >= lower
  row_w = jnp.broadcast_to(row_w, r.shape).astype(r.dtype)
  col_w = jnp.broadcast_to(col_w, c.shape).astype(c.dtype)

  violations = jnp.stack(
      [
          _weighted_mean(jax.nn.relu(lower - r), row_w, (0, 2)),
          _weighted_mean(jax.nn.relu(r - upper), row_w, (0, 2)),
          _weighted_mean(jax.nn.relu(lower - c), col_w, (0, 2)),
          _weighted_mean(jax.nn.relu(c - upper), col_w, (0, 2)),
      ],
      axis=-1,
  )
  rows_in = ((r >= lower) & (r <= upper)).astype(r.dtype)
  cols_in = ((c >= lower) & (c <= upper)).astype(c.dtype)
  everything = (0, 1, 2)
  return ConstraintStats(
      violations=violations,
      rows_within=_weighted_mean(rows_in, row_w, everything),
      cols_within=_weighted_mean(cols_in, col_w, everything),
  )


def init_multipliers(num_layers: int, num_heads: int, value: float = 0.0) -> jax.Array:
  """[L, H, 4] float32 Lagrange multipliers gamma, for TrainState.extra (never parameters)."""
  return jnp.full((num_layers, num_heads, len(CONSTRAINT_NAMES)), value, jnp.float32)


def lagrangian_term(
    violations: jax.Array, multipliers: jax.Array, *, penalty: float | jax.Array = 0.0
) -> jax.Array:
  """sum(gamma * v) + (penalty / 2) * sum(v^2): the h(A) terms of Eq. 6, summed over layers.

  The multipliers get no gradient (they are updated by `dual_update` between steps); the
  quadratic term is the augmented-Lagrangian penalty (0 = plain Lagrangian).
  """
  violations = violations.astype(_sum_dtype(violations.dtype))
  gamma = jax.lax.stop_gradient(multipliers).astype(violations.dtype)
  return jnp.sum(gamma * violations) + 0.5 * penalty * jnp.sum(violations**2)


def dual_update(
    multipliers: jax.Array,
    violations: jax.Array,
    *,
    step_size: float | jax.Array,
    penalty_cap: float | None = None,
) -> jax.Array:
  """Projected dual ascent: gamma <- clip(gamma + step_size * v, 0, penalty_cap).

  Violations are hinges (>= 0), so multipliers only grow while a constraint is violated and
  stay put once it holds; the projection keeps gamma >= 0 for any input. `penalty_cap` bounds
  each multiplier from above, so that the constraint's pull on the loss stays bounded (for the
  augmented Lagrangian, use the current penalty as `step_size`, the method of multipliers'
  dual step, with the penalty itself capped by `grow_penalty`).
  """
  violations = jax.lax.stop_gradient(violations).astype(multipliers.dtype)
  updated = multipliers + step_size * violations
  return jnp.clip(updated, 0.0, penalty_cap)


def grow_penalty(penalty: float | jax.Array, *, factor: float, cap: float) -> float | jax.Array:
  """Augmented-Lagrangian penalty schedule: penalty <- min(penalty * factor, cap)."""
  return jnp.minimum(penalty * factor, cap)
