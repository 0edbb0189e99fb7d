"""Markov-blanket constraint on attention heads and its Lagrangian (paper Sec. 3.1, Eqs. 2-3, 6).

Definition 1 bounds tau(A_i.) = sum_j exp(A_ij) and tau(A_.i) by N - 2 + 2 e^(1/2) <= tau <=
N - 1 + e. We use tau - N,

    r_i = sum_j expm1(A_ij),    c_j = sum_i expm1(A_ij),

so that masked and padded entries (A_ij = 0) add exactly 0, the bounds do not depend on the length
N and nothing cancels catastrophically (tau is about N; the bounds differ from it by O(1)). Sums
are taken in float32 (float64 stays float64) whatever the compute dtype.

The bands (`band`: each bound is the measure of a row shape of Definition 1 and Figure 5), the
forms (`form="node"`: Eq. 2's row plus column per token, halved so both forms share units;
`"separate"`: rows and columns each) and the losses (`loss="hinge"`, and `"linear"`: Eq. 3 as
written, whose minimising slacks are 0) are derived in docs/design.md, "Markov-blanket
constraint", which also says why `encoder_band="paper_slack"` (the printed constants) is not the
default: it cannot tell uniform attention from a Markov blanket.

A row (column) is unconstrainable, and left out, when no attention can put it in the band: a row
with no admissible key (a padded query; a decoder's first token once its self-loop is discounted),
an encoder row whose only key is itself (a one-hot self-loop exceeds the upper bound), a column
that no admissible row may feed (a decoder's last token) or whose feeders cannot reach the lower
bound. All of this is computed from the mask, so padding and sparse patterns need no special case;
in the node form, a node with one measure left out is held to the band by the other alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

FORMS = ("node", "separate")
LOSSES = ("hinge", "linear")
ENCODER_BANDS = ("derived_self_loop", "paper_slack")

# Definition 1: two parents at 1/2 (lower) to one parent (upper), in tau - N.
DEFINITION1_LOWER = 2.0 * math.expm1(0.5)
DEFINITION1_UPPER = math.expm1(1.0)
# Definition 2's printed slack maxima of the encoder (eps'_max, eps''_max).
PAPER_SLACK_LOWER = 0.7045
PAPER_SLACK_UPPER = 0.5062


@dataclasses.dataclass(frozen=True)
class Band:
  """Bounds on the measure of one row or column, and whether the self-loop A_ii is counted."""

  lower: float
  upper: float
  count_diagonal: bool


def band(*, decoder: bool, encoder_band: str = "derived_self_loop") -> Band:
  """The band of a self-attention layer (docs/design.md: one row shape per bound)."""
  if decoder:
    return Band(DEFINITION1_LOWER, DEFINITION1_UPPER, count_diagonal=False)
  if encoder_band == "derived_self_loop":
    third = math.expm1(1.0 / 3.0)
    return Band(3.0 * third, third + math.expm1(2.0 / 3.0), count_diagonal=True)
  if encoder_band == "paper_slack":
    return Band(
        DEFINITION1_LOWER - 2.0 * (math.exp(0.5) - math.exp(1.0 / 3.0)),
        DEFINITION1_UPPER - (math.e - math.exp(0.7)),
        count_diagonal=False,
    )
  raise ValueError(f"unknown encoder_band {encoder_band!r}; expected one of {ENCODER_BANDS}")


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
  """Which reading of Eqs. 2-3 a run uses (docs/design.md)."""

  form: str = "node"
  loss: str = "hinge"
  encoder_band: str = "derived_self_loop"

  def __post_init__(self):
    for name, value, choices in (
        ("form", self.form, FORMS),
        ("loss", self.loss, LOSSES),
        ("encoder_band", self.encoder_band, ENCODER_BANDS),
    ):
      if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    if self.loss == "linear" and self.form != "node":
      raise ValueError("loss 'linear' (Eq. 3) is written on node sums: needs form='node'")

  @property
  def names(self) -> tuple[str, ...]:
    """Order of the last axis of the violation and multiplier arrays."""
    if self.loss == "linear":
      return ("slack_lower", "slack_upper", "node_lower", "node_upper")
    if self.form == "node":
      return ("node_lower", "node_upper")
    return ("row_lower", "row_upper", "col_lower", "col_upper")


DEFAULT_SPEC = ConstraintSpec()


@struct.dataclass
class ConstraintStats:
  """Constraint measurements of one attention layer.

  Attributes:
    violations: [H, len(spec.names)]: hinge means (loss="hinge") or signed sums per example
      (loss="linear"), differentiable w.r.t. the attention probabilities.
    rows_within: fraction of constrained (batch, head, row) with lower <= r <= upper.
    cols_within: the same for constrained columns.
    nodes_within: the same for the node means (r + c) / 2 (one measure where the other is out).
  """

  violations: jax.Array
  rows_within: jax.Array
  cols_within: jax.Array
  nodes_within: jax.Array


def _sum_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """float32 for float32 and narrower inputs; float64 stays float64 (finite-difference tests)."""
  return jnp.promote_types(dtype, jnp.float32)


def blanket_sums(probs: jax.Array, edges: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Row and column Markov-blanket measures of attention probabilities.

  Args:
    probs: [B, H, Nq, Nk] attention probabilities.
    edges: bool broadcastable to probs (True = counted), or None; other entries contribute 0 even
      if probs is not 0 there.

  Returns:
    (r [B, H, Nq], c [B, H, Nk]): r_i = sum_j expm1(A_ij), c_j = sum_i expm1(A_ij).
  """
  e = jnp.expm1(probs.astype(_sum_dtype(probs.dtype)))
  if edges is not None:
    e = jnp.where(edges, e, 0.0)
  return e.sum(axis=-1), e.sum(axis=-2)


def weighted_mean(values: jax.Array, weights: jax.Array, axes: tuple[int, ...] | None) -> jax.Array:
  """The mean of `values` weighted by `weights` over `axes` (None: all); 0 where no weight."""
  return (values * weights).sum(axes) / jnp.maximum(weights.sum(axes), 1.0)


def _within(measure: jax.Array, b: Band) -> jax.Array:
  # A measure exactly on a bound (two parents at exactly 1/2) is within it; float32 rounding of the
  # expm1 sums must not decide that.
  tol = 1e-5
  return ((measure >= b.lower - tol) & (measure <= b.upper + tol)).astype(measure.dtype)


def constraint_violations(
    probs: jax.Array,
    mask: jax.Array | None,
    *,
    decoder: bool,
    valid_q: jax.Array | None = None,
    valid_k: jax.Array | None = None,
    spec: ConstraintSpec = DEFAULT_SPEC,
) -> ConstraintStats:
  """Violations of the Markov-blanket constraint by one self-attention layer, per head.

  Args:
    probs: [B, H, N, N] self-attention probabilities.
    mask: bool broadcastable to [B, H, N, N] (the mask the attention used), or None.
    decoder: causal self-attention: no self-loop (Definition 2).
    valid_q: [B, N] bool (default all valid): padded rows are left out.
    valid_k: [B, N] bool (default all valid): padded columns are left out.
  """
  batch, heads, n_q, n_k = probs.shape
  if n_q != n_k:
    raise ValueError(f"the constraint is on self-attention: got {n_q} queries and {n_k} keys")
  b = band(decoder=decoder, encoder_band=spec.encoder_band)
  valid_q = jnp.ones((batch, n_q), bool) if valid_q is None else jnp.asarray(valid_q, bool)
  valid_k = jnp.ones((batch, n_k), bool) if valid_k is None else jnp.asarray(valid_k, bool)
  allowed = jnp.ones((1, 1, n_q, n_k), bool) if mask is None else jnp.asarray(mask, bool)
  allowed = allowed & valid_q[:, None, :, None] & valid_k[:, None, None, :]
  edges = allowed if b.count_diagonal else allowed & ~jnp.eye(n_q, dtype=bool)
  r, c = blanket_sums(probs, edges)

  # Which rows and columns some attention could put in the band (module docstring).
  row_keys = edges.sum(axis=-1)
  if b.count_diagonal:
    # A row whose every key is counted spends all its mass in r: uniform over k keys is the least.
    k = jnp.maximum(row_keys, 1)
    least = k * jnp.expm1(1.0 / k)
    row_w = (row_keys >= 1) & (least <= b.upper + 1e-6)
  else:
    row_w = row_keys >= 1
  col_w = edges.sum(axis=-2) * (math.e - 1.0) >= b.lower
  row_w = jnp.broadcast_to(row_w, r.shape).astype(r.dtype)
  col_w = jnp.broadcast_to(col_w, c.shape).astype(c.dtype)
  sides = row_w + col_w
  node = (r * row_w + c * col_w) / jnp.maximum(sides, 1.0)
  node_w = (sides > 0).astype(r.dtype)

  if spec.form == "separate":
    violations = jnp.stack(
        [
            weighted_mean(jax.nn.relu(b.lower - r), row_w, (0, 2)),
            weighted_mean(jax.nn.relu(r - b.upper), row_w, (0, 2)),
            weighted_mean(jax.nn.relu(b.lower - c), col_w, (0, 2)),
            weighted_mean(jax.nn.relu(c - b.upper), col_w, (0, 2)),
        ],
        axis=-1,
    )
  elif spec.loss == "hinge":
    violations = jnp.stack(
        [
            weighted_mean(jax.nn.relu(b.lower - node), node_w, (0, 2)),
            weighted_mean(jax.nn.relu(node - b.upper), node_w, (0, 2)),
        ],
        axis=-1,
    )
  else:
    violations = _linear_terms(node, node_w, b, decoder=decoder)

  return ConstraintStats(
      violations=violations,
      rows_within=weighted_mean(_within(r, b), row_w, None),
      cols_within=weighted_mean(_within(c, b), col_w, None),
      nodes_within=weighted_mean(_within(node, b), node_w, None),
  )


def _linear_terms(node: jax.Array, node_w: jax.Array, b: Band, *, decoder: bool) -> jax.Array:
  """[H, 4] Eq. 3 terms (gamma_1..gamma_4 order), summed over nodes, mean over the batch.

  The slacks are at the minimiser of h over [0, eps_max] for multipliers >= 0, which is 0 with the
  printed signs (docs/design.md); they are kept as explicit zeros so that each term is Eq. 3's.
  Decoder slack maxima are 0 (Definition 2).
  """
  slack_max = (0.0, 0.0) if decoder else (PAPER_SLACK_LOWER, PAPER_SLACK_UPPER)
  slack = jnp.zeros_like(node)
  per_node = [
      slack - slack_max[0],
      slack - slack_max[1],
      b.lower - node + slack,
      node - b.upper + slack,
  ]
  batch = node.shape[0]
  return jnp.stack([(t * node_w).sum((0, 2)) / batch for t in per_node], axis=-1)


def init_multipliers(
    num_layers: int, num_heads: int, value: float = 0.0, spec: ConstraintSpec = DEFAULT_SPEC
) -> jax.Array:
  """[L, H, len(spec.names)] float32 Lagrange multipliers gamma, for TrainState.extra."""
  return jnp.full((num_layers, num_heads, len(spec.names)), value, jnp.float32)


def lagrangian_term(
    violations: jax.Array, multipliers: jax.Array, *, penalty: float | jax.Array = 0.0
) -> jax.Array:
  """sum(gamma * v) + (penalty / 2) * sum(relu(v)^2): the h(A) terms of Eq. 6, summed over layers.

  The multipliers get no gradient (they are updated by `dual_update` between steps); the
  quadratic term is the augmented-Lagrangian penalty (0 = plain Lagrangian). For the hinge loss
  v >= 0; for the linear loss only the violated part of a signed term is penalised.
  """
  violations = violations.astype(_sum_dtype(violations.dtype))
  gamma = jax.lax.stop_gradient(multipliers).astype(violations.dtype)
  return jnp.sum(gamma * violations) + 0.5 * penalty * jnp.sum(jax.nn.relu(violations) ** 2)


def dual_update(
    multipliers: jax.Array,
    violations: jax.Array,
    *,
    step_size: float | jax.Array,
    penalty_cap: float | None = None,
) -> jax.Array:
  """Projected dual ascent: gamma <- clip(gamma + step_size * v, 0, penalty_cap).

  Hinge violations are >= 0, so those multipliers only grow while a constraint is violated and
  stay put once it holds; the signed terms of the linear loss also shrink them while the
  constraint holds with room to spare. The projection keeps gamma >= 0 for any input;
  `penalty_cap` bounds each multiplier from above so that the constraint's pull stays bounded.
  """
  violations = jax.lax.stop_gradient(violations).astype(multipliers.dtype)
  updated = multipliers + step_size * violations
  return jnp.clip(updated, 0.0, penalty_cap)


def grow_penalty(penalty: float | jax.Array, *, factor: float, cap: float) -> float | jax.Array:
  """Augmented-Lagrangian penalty schedule: penalty <- min(penalty * factor, cap)."""
  return jnp.minimum(penalty * factor, cap)
