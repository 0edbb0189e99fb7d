"""Sparse mixture-of-experts feed-forward layer (paper Sec. 5.1, Eq. 5-6).

    y = sum_{i in Top-K} softmax(g(x))_i * E_i(x)

with E_i a GELU MLP of a ViT block's MLP shape. A router (`ROUTERS` or any module following
`fairmoe_jax.moe.routers.base`), a dispatch algorithm (`fairmoe_jax.moe.dispatch`) and the
stacked expert weights; expert choice is a separate path (`SparseMoE`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe.dispatch import (
    DISPATCH_ALGORITHMS,
    EP_ALGORITHMS,
    DispatchStats,
    ExpertWeights,
    batch_priority_order,
    compute_capacity,
    data_parallel_moe,
    expert_parallel_moe,
    per_device,
    reorder_tokens,
    restore_token_order,
)
from fairmoe_jax.moe.dispatch.capacity import stats_per_example, to_groups
from fairmoe_jax.moe.routers import (
    ExpertChoiceRouter,
    NoisyTopKRouter,
    RouterOutput,
    TopKRouter,
    apply_expert_choice,
)
from fairmoe_jax.moe.routers.expert_choice import apply_expert_picks

# Logical axis name of the expert dimension, also the mesh axis name.
EXPERT_AXIS = "expert"
# Dispatches with a `per_group` form, taken with no mesh known on several devices (docs/moe.md).
PER_GROUP_DISPATCHES = ("dropless", "sort_blocks", "blocksparse", "einsum_fused")

# Each expert is initialised like the dense ViT MLP it replaces (timm: N(0, 0.02)).
_KERNEL_INIT = nnx.initializers.normal(stddev=0.02)
_BIAS_INIT = nnx.initializers.zeros_init()


@struct.dataclass
class RoutingReadings:
  """What an evaluation reads of one MoE layer's routing (never logged in training).

  Named fields, not metric names, so renaming a logged metric cannot change an evaluation.

  Attributes:
    fraction_dropped: scalar, dropped (token, choice) pairs (expert choice: tokens no expert took).
    expert_fraction: [B, E] share of each example's (token, choice) pairs each expert served
      (paper Figs. 2 and 5).
    gate_weight: [B, E] mean gate weight per expert and example; None for expert choice.
    router: the router's `RouterOutput.example_readings` (e.g. FGR's), None for plain routers.
  """

  fraction_dropped: jax.Array
  expert_fraction: jax.Array
  gate_weight: jax.Array | None = None
  router: Any = None


@struct.dataclass
class MoEAux:
  """Auxiliary outputs of one or more MoE layers (losses unweighted: the caller scales them).

  Attributes:
    loss: scalar load-balancing loss.
    z_loss: scalar router z-loss.
    metrics: named arrays for logging, e.g. "fraction_dropped".
    extra_losses: the router's further named losses (e.g. FGR's "confusion"), summed over layers.
    routing: each layer's `RoutingReadings` by block name ("" for a layer's own).
  """

  loss: jax.Array
  z_loss: jax.Array
  metrics: dict[str, jax.Array] = struct.field(default_factory=dict)
  extra_losses: dict[str, jax.Array] = struct.field(default_factory=dict)
  routing: dict[str, RoutingReadings] = struct.field(default_factory=dict)

  @classmethod
  def zeros(cls) -> "MoEAux":
    """The aux of a model without MoE layers."""
    return cls(loss=jnp.zeros((), jnp.float32), z_loss=jnp.zeros((), jnp.float32))

  @classmethod
  def merge(cls, named: Mapping[str, "MoEAux"]) -> "MoEAux":
    """Sums losses over layers and prefixes each layer's metrics with its name."""
    loss, z_loss = cls.zeros().loss, cls.zeros().z_loss
    metrics: dict[str, jax.Array] = {}
    extra: dict[str, jax.Array] = {}
    routing: dict[str, RoutingReadings] = {}
    for name, aux in named.items():
      loss, z_loss = loss + aux.loss, z_loss + aux.z_loss
      metrics.update({f"{name}/{k}": v for k, v in aux.metrics.items()})
      for k, v in aux.extra_losses.items():
        extra[k] = extra.get(k, 0.0) + v
      routing.update({f"{name}/{k}" if k else name: v for k, v in aux.routing.items()})
    return cls(loss=loss, z_loss=z_loss, metrics=metrics, extra_losses=extra, routing=routing)


# Built-in routers by name (`SparseMoE(router=...)`).
ROUTERS = ("topk", "noisy_topk", "expert_choice")

# The two ways `SparseMoE` matches tokens with experts (`SparseMoE.routing`).
TOKEN_CHOICE = "token_choice"
EXPERT_CHOICE = "expert_choice"


class SparseMoE(nnx.Module):
  """Top-k sparse MoE replacing a transformer block's MLP: `y, aux = layer(x)`, x [B, S, D].

  The routing path (`self.routing`) is fixed at construction from `router`:

  * token choice (`TOKEN_CHOICE`): the router picks k experts per token; the dispatch algorithm
    serves them under the capacity limit, optionally in batch-priority order or
    expert-parallel over `mesh`.
  * expert choice (`EXPERT_CHOICE`, router="expert_choice"): every expert picks its C best tokens
    of each example; `dispatch` is unused, `batch_priority` and expert parallelism unavailable.

  Expert weights are stacked along a leading axis annotated "expert". Capacity factor and router
  noise follow `train=` when given, else `model.train()` / `model.eval()`.

  Args:
    dispatch: a key of `DISPATCH_ALGORITHMS`; all agree wherever capacity suffices.
    eval_capacity_factor: token choice's, usually larger than `capacity_factor`: drops almost
      nothing. Expert choice evaluates at `capacity_factor`.
    router: "topk" (Switch losses), "noisy_topk" (Shazeer et al. 2017), "expert_choice" (Zhou
      et al. 2022, C = the top-k capacity, so expert FLOPs match), a router module, or a factory
      `router(dim, num_experts, top_k, rngs=rngs)`.
    batch_priority: V-MoE batch-priority routing: the most confident tokens of each example are
      served first, so overflow drops the least confident choices.
    capacity_multiple_of: token choice's C rounded up to a multiple of it (`compute_capacity`).
    group_size: examples per routing group (token choice): their tokens compete for the same
      slots, as in V-MoE's groups of images; 1 (one group per example) is the papers' reading.
    mesh: the device mesh (batch split over every axis), or None for the one in context at call
      time (`jax.set_mesh`). With an "expert" axis > 1 the experts are split over it
      (`dispatch.expert_parallel`); otherwise each device dispatches its own examples
      (`dispatch.data_parallel`). A batch that does not divide the mesh is padded with empty
      examples. With no mesh at all every dispatch works per group, which XLA's partitioner
      splits over a sharded batch (the experimental ones as their XLA reference; docs/moe.md).
    dtype: compute dtype of the experts; routing is always float32.
    rngs: parameter RNGs; a seed gives the same weights whatever the mesh.
  """

  def __init__(
      self,
      dim: int,
      hidden_dim: int,
      num_experts: int,
      top_k: int,
      *,
      dispatch: str = "sort",
      capacity_factor: float = 1.25,
      eval_capacity_factor: float = 2.0,
      router: str | nnx.Module | Callable[..., nnx.Module] = "topk",
      batch_priority: bool = False,
      capacity_multiple_of: int = 1,
      group_size: int = 1,
      mesh: jax.sharding.Mesh | None = None,
      dtype: Any = jnp.float32,
      param_dtype: Any = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if dispatch not in DISPATCH_ALGORITHMS:
      raise ValueError(f"dispatch={dispatch!r}; known: {', '.join(DISPATCH_ALGORITHMS)}")
    if isinstance(router, str) and router not in ROUTERS:
      raise ValueError(f"router={router!r}; known: {', '.join(ROUTERS)} (or a router module)")
    self.routing = EXPERT_CHOICE if router == "expert_choice" else TOKEN_CHOICE
    self.dispatch = dispatch
    self.num_experts = num_experts
    if mesh is not None:
      self._check_mesh(mesh)
    if batch_priority and self.routing == EXPERT_CHOICE:
      raise ValueError("batch_priority applies to token-choice routers, not 'expert_choice'")
    self.mesh = mesh
    self.dim = dim
    self.hidden_dim = hidden_dim
    self.top_k = top_k
    self.capacity_factor = capacity_factor
    self.eval_capacity_factor = eval_capacity_factor
    self.batch_priority = batch_priority
    if group_size > 1 and self.routing == EXPERT_CHOICE:
      raise ValueError(f"group_size={group_size}: expert choice routes one group per example")
    self.capacity_multiple_of = capacity_multiple_of
    self.group_size = group_size
    self.dtype = dtype
    self.deterministic = False  # Toggled by model.eval() / model.train().
    if router == "topk":
      self.router = TopKRouter(dim, num_experts, top_k, rngs=rngs)
    elif router == "noisy_topk":
      self.router = NoisyTopKRouter(dim, num_experts, top_k, rngs=rngs)
    elif self.routing == EXPERT_CHOICE:
      self.router = ExpertChoiceRouter(dim, num_experts, capacity_factor=top_k, rngs=rngs)
    elif isinstance(router, nnx.Module):
      self.router = router
    else:  # A factory, so that every MoE block of a model builds its own router.
      self.router = router(dim, num_experts, top_k, rngs=rngs)

    def param(init: Callable[..., jax.Array], shape: tuple[int, ...]) -> nnx.Param:
      # One tensor for all experts, sharded along its leading expert axis only: eagerly where
      # the mesh in context has that axis.
      sharding = (EXPERT_AXIS,) + (None,) * len(shape)
      mesh = jax.sharding.get_abstract_mesh()
      eager = not mesh.empty and EXPERT_AXIS in mesh.axis_names
      annotated = nnx.with_partitioning(init, sharding, eager_sharding=eager)
      return nnx.Param(annotated(rngs.params(), (num_experts, *shape), param_dtype))

    self.w1 = param(_KERNEL_INIT, (dim, hidden_dim))
    self.b1 = param(_BIAS_INIT, (hidden_dim,))
    self.w2 = param(_KERNEL_INIT, (hidden_dim, dim))
    self.b2 = param(_BIAS_INIT, (dim,))

  def __call__(
      self,
      x: jax.Array,
      *,
      train: bool | None = None,
      rngs: nnx.Rngs | None = None,
      context: Mapping[str, jax.Array] | None = None,
  ) -> tuple[jax.Array, MoEAux]:
    """x: [B, S, D] -> (y [B, S, D], MoEAux); capacity per example and expert. `train` None
    follows the module's mode; `rngs` feeds noisy routers' `noise` stream; `context` holds
    per-example arrays [B, ...] for the router (e.g. sensitive attributes)."""
    if train is None:
      train = not self.deterministic
    # Trace-time checks: a wrong shape fails here, not deep inside a dispatch einsum.
    chex.assert_rank(x, 3)
    chex.assert_axis_dimension(x, 2, self.dim)
    if context is not None:
      chex.assert_equal_shape_prefix([x, *context.values()], 1)
    x = x.astype(self.dtype)
    experts = ExpertWeights.from_module(self)
    if self.routing == EXPERT_CHOICE:
      # One capacity in training and evaluation (Zhou et al.): a larger one would give each
      # expert more tokens, another function than the one trained. Token choice's larger
      # evaluation capacity only drops fewer tokens.
      capacity = compute_capacity(x.shape[1], self.num_experts, self.top_k, self.capacity_factor)
      return self._expert_choice(x, experts, capacity)
    capacity_factor = self.capacity_factor if train else self.eval_capacity_factor
    # Token choice's C: for groups of `group_size` examples, rounded up (`compute_capacity`).
    capacity = compute_capacity(
        self.group_size * x.shape[1],
        self.num_experts,
        self.top_k,
        capacity_factor,
        self.capacity_multiple_of,
    )
    return self._token_choice(x, experts, capacity, train=train, rngs=rngs, context=context)

  def _token_choice(
      self,
      x: jax.Array,
      experts: ExpertWeights,
      capacity: int,
      *,
      train: bool,
      rngs: nnx.Rngs | None,
      context: Mapping[str, jax.Array] | None,
  ) -> tuple[jax.Array, MoEAux]:
    """Token choice: the router picks k experts per token, the dispatch algorithm serves them."""
    batch, seq_len, dim = x.shape
    token_context = None
    if context is not None:  # [B, ...] -> [B * S, ...]: every token carries its example's.
      token_context = {k: jnp.repeat(v, seq_len, axis=0) for k, v in context.items()}
    route: RouterOutput = self.router(
        x.reshape(batch * seq_len, dim), train=train, rngs=rngs, context=token_context
    )
    expert_index = route.expert_index.reshape(batch, seq_len, self.top_k)
    gates = route.gates.reshape(batch, seq_len, self.top_k)
    extra_losses = dict(route.extra_losses())
    # What the router's losses need of the experts, computed beside the dispatch (routers/base.py).
    expert_features = None
    if train and jax.eval_shape(route.expert_features, x, experts) is not None:
      expert_features = route.expert_features
    # Mean gate weight each expert receives per example: unlike choice counts, it tells a router
    # that spreads its weight from one that routes with a dominant expert and a token second pick.
    gate_weight = (
        jnp.einsum(
            "bsk,bske->be", gates, jax.nn.one_hot(expert_index, self.num_experts, dtype=gates.dtype)
        )
        / seq_len
    )
    if self.group_size > 1:  # The tokens of `group_size` examples compete for the same slots.
      x, expert_index, gates = to_groups((x, expert_index, gates), self.group_size)
      if expert_features is not None:  # Per example (routers/base.py), not per group.
        if self.batch_priority:
          raise ValueError("batch_priority with group_size > 1 mixes the examples' tokens")
        example_features = expert_features

        def expert_features(x: jax.Array, experts: ExpertWeights) -> jax.Array:
          return example_features(x.reshape(-1, seq_len, dim), experts)

    order = None
    if self.batch_priority:  # Serve confident tokens first; undone on y and the stats below.
      order = batch_priority_order(gates)
      x, expert_index, gates = reorder_tokens((x, expert_index, gates), order)

    y, stats, features = self._dispatch(x, expert_index, gates, experts, capacity, expert_features)
    if expert_features is not None:
      extra_losses.update(route.expert_losses(features, context))
    if order is not None:
      y, kept = restore_token_order((y, stats.kept), order)
      stats = stats.replace(kept=kept)
    if self.group_size > 1:
      y = y.reshape(batch, seq_len, -1)
      token_expert = route.expert_index.reshape(batch, seq_len, self.top_k)
      stats = stats_per_example(stats, token_expert, self.num_experts)

    metrics = _routing_metrics(route.probs, stats.fraction_dropped, stats.group_expert_fraction)
    metrics["example_gate_weight"] = gate_weight
    # Per example, for an evaluation; dead code in training, which never reads them.
    readings = RoutingReadings(
        fraction_dropped=stats.fraction_dropped,
        expert_fraction=stats.group_expert_fraction,
        gate_weight=gate_weight,
        router=route.example_readings(batch, seq_len),
    )
    aux = MoEAux(
        loss=route.load_balance_loss,
        z_loss=route.z_loss,
        metrics=metrics,
        extra_losses=extra_losses,
        routing={"": readings},
    )
    return y, aux

  def _dispatch(
      self,
      x: jax.Array,
      expert_index: jax.Array,
      gates: jax.Array,
      experts: ExpertWeights,
      capacity: int,
      expert_features: Callable[[jax.Array, ExpertWeights], jax.Array] | None,
  ) -> tuple[jax.Array, DispatchStats, jax.Array | None]:
    """The dispatch on one device or per device of the mesh, with `expert_features`."""
    algorithm = DISPATCH_ALGORITHMS[self.dispatch]
    mesh = self._mesh()
    if mesh is None:
      if self.dispatch in PER_GROUP_DISPATCHES and jax.device_count() > 1:
        # The batch may be sharded: each group's choices apart, which the SPMD partitioner
        # splits (`sort` and `einsum` are per group anyway; one device runs the named path).
        algorithm = functools.partial(algorithm, per_group=True)
      y, stats = algorithm(x, expert_index, gates, experts, capacity=capacity)
      features = None if expert_features is None else expert_features(x, experts)
      return y, stats, features
    if mesh.shape.get(EXPERT_AXIS, 1) == 1:  # Each device dispatches its own examples.
      sharded = functools.partial(data_parallel_moe, algorithm)
    else:  # Each device routes its own examples; tokens reach their experts by all_to_all.
      sharded = functools.partial(expert_parallel_moe, algorithm=self.dispatch)
    outputs = sharded(
        *_pad_groups((x, expert_index, gates), mesh.size),
        experts,
        capacity=capacity,
        mesh=mesh,
        expert_features=expert_features,
    )
    batch = x.shape[0]  # The padding's outputs and statistics are cut off.
    y, stats = outputs[0][:batch], outputs[1]
    stats = DispatchStats.from_kept(stats.kept[:batch], stats.group_expert_fraction[:batch])
    return y, stats, (outputs[2][:batch] if expert_features is not None else None)

  def _mesh(self) -> jax.sharding.Mesh | jax.sharding.AbstractMesh | None:
    """The mesh the layer's dispatch runs on: its own, else the one in context (`jax.set_mesh`);
    None on one device."""
    mesh = self.mesh
    if mesh is None:
      mesh = jax.sharding.get_abstract_mesh()
      if mesh.empty:
        return None
      self._check_mesh(mesh)
    return mesh if mesh.size > 1 else None

  def _check_mesh(self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> None:
    """Raises ValueError where the layer cannot split its experts over the mesh's expert axis."""
    if mesh.shape.get(EXPERT_AXIS, 1) == 1:
      return
    if self.routing == EXPERT_CHOICE:
      raise ValueError("router='expert_choice' has no expert-parallel version: expert axis 1")
    if self.dispatch not in EP_ALGORITHMS:
      raise ValueError(
          f"dispatch={self.dispatch!r} has no expert-parallel version; with a mesh use one of "
          f"{', '.join(EP_ALGORITHMS)}"
      )
    if self.num_experts % mesh.shape[EXPERT_AXIS]:
      raise ValueError(
          f"num_experts={self.num_experts} is not divisible by the mesh's {EXPERT_AXIS!r} axis "
          f"of size {mesh.shape[EXPERT_AXIS]}"
      )

  def _expert_choice(
      self, x: jax.Array, experts: ExpertWeights, capacity: int
  ) -> tuple[jax.Array, MoEAux]:
    """Expert choice: every expert takes its `capacity` best tokens of each example."""
    batch, seq_len, _ = x.shape
    assignment = self.router(x, capacity=capacity)
    mesh = self._mesh()
    if mesh is None:
      y = apply_expert_choice(x, assignment, experts.apply)
    else:  # Each device gathers, runs and scatters its own examples' picks.
      y = per_device(
          lambda x, index, gates, experts: apply_expert_picks(x, index, gates, experts.apply),
          _pad_groups((x, assignment.token_index, assignment.gates), mesh.size),
          experts,
          mesh=mesh,
      )[:batch]
    # Each expert serves `capacity` tokens of the S * k slots a top-k router would fill.
    served = jnp.full((batch, self.num_experts), capacity / (seq_len * self.top_k), jnp.float32)
    probs = assignment.probs.reshape(-1, self.num_experts)
    metrics = _routing_metrics(probs, assignment.fraction_unrouted, served)
    readings = RoutingReadings(
        fraction_dropped=assignment.fraction_unrouted, expert_fraction=served
    )
    # Perfectly balanced by construction: no load-balancing loss.
    return y, MoEAux(
        loss=jnp.zeros((), jnp.float32),
        z_loss=assignment.z_loss,
        metrics=metrics,
        routing={"": readings},
    )


def _pad_groups(arrays: tuple[jax.Array, ...], devices: int) -> tuple[jax.Array, ...]:
  """The arrays' group (leading) axis zero-padded to a multiple of `devices`: whole groups of
  zero gates, which take no other group's capacity (capacity is per group)."""
  pad = -arrays[0].shape[0] % devices
  if not pad:
    return arrays
  return tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays)


def _routing_metrics(
    probs: jax.Array, fraction_dropped: jax.Array, example_expert_fraction: jax.Array
) -> dict[str, jax.Array]:
  """Per-layer routing metrics; `example_expert_fraction` [B, E] gives per-example usage."""
  return {
      # Token-choice routers: dropped (token, choice) pairs; expert choice: tokens no expert took.
      "fraction_dropped": fraction_dropped,
      # Served (token, choice) pairs per expert, as a fraction of all T * k.
      "tokens_per_expert": example_expert_fraction.mean(axis=0),
      "example_expert_fraction": example_expert_fraction,
      "router_entropy": jnp.mean(jnp.sum(jax.scipy.special.entr(probs), axis=-1)),
      "importance": probs.sum(axis=0) / probs.sum(),
  }
