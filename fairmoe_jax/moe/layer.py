"""Sparse mixture-of-experts feed-forward layer (paper Sec. 5.1, Eq. 5-6).

    y = sum_{i in Top-K} softmax(g(x))_i * E_i(x)

with E_i a GELU MLP of the same shape as a ViT block's MLP. The layer is
composed of three interchangeable pieces: a router (`TopKRouter`), a dispatch
algorithm (`fairmoe_jax.moe.algorithms`) and the stacked expert weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from fairmoe_jax.moe import dispatch as dispatch_lib
from fairmoe_jax.moe.algorithms import DISPATCH_ALGORITHMS, ExpertWeights
from fairmoe_jax.moe.expert_parallel import EP_ALGORITHMS, expert_parallel_moe
from fairmoe_jax.moe.routing import TopKRouter

# Logical axis name of the expert dimension. It is also the mesh axis name, so
# `nnx.get_partition_spec` gives specs that can be used with the mesh directly.
EXPERT_AXIS = "expert"

# Each expert is initialised like the dense ViT MLP it replaces (timm: N(0, 0.02)).
_KERNEL_INIT = nnx.initializers.normal(stddev=0.02)
_BIAS_INIT = nnx.initializers.zeros_init()


@struct.dataclass
class MoEAux:
  """Auxiliary outputs of one or more MoE layers.

  Attributes:
    loss: scalar load-balancing loss, unweighted (the caller scales it).
    z_loss: scalar router z-loss, unweighted.
    metrics: named arrays for logging, e.g. "fraction_dropped".
  """

  loss: jax.Array
  z_loss: jax.Array
  metrics: dict[str, jax.Array] = struct.field(default_factory=dict)

  @classmethod
  def zeros(cls) -> "MoEAux":
    """The aux of a model without MoE layers."""
    return cls(loss=jnp.zeros((), jnp.float32), z_loss=jnp.zeros((), jnp.float32), metrics={})

  @classmethod
  def merge(cls, named: Mapping[str, "MoEAux"]) -> "MoEAux":
    """Sums losses over layers and prefixes each layer's metrics with its name."""
    total = cls.zeros()
    metrics: dict[str, jax.Array] = {}
    for name, aux in named.items():
      total = total.replace(loss=total.loss + aux.loss, z_loss=total.z_loss + aux.z_loss)
      metrics.update({f"{name}/{k}": v for k, v in aux.metrics.items()})
    return total.replace(metrics=metrics)


def _expert_param(
    init: Callable[..., jax.Array],
    key: jax.Array,
    shape: Sequence[int],
    dtype: Any,
    sharding: tuple[str | None, ...],
) -> nnx.Param:
  """A Param annotated with logical axis names for expert parallelism.

  Flax shards annotated variables eagerly at creation, which needs a mesh that
  defines the named axes. We only ask for that when such a mesh is active, so
  the same layer can be built on a single device; elsewhere the annotation is
  kept as metadata for `nnx.get_partition_spec` / `nnx.get_named_sharding`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  eager = not mesh.empty and all(a in mesh.axis_names for a in sharding if a is not None)
  annotated = nnx.with_partitioning(init, sharding, eager_sharding=eager)
  return nnx.Param(annotated(key, tuple(shape), dtype))


class SparseMoE(nnx.Module):
  """Top-k sparse MoE replacing a transformer block's MLP.

  Expert weights are stacked along a leading expert axis (one parameter per
  weight) and annotated ("expert", ...) so they can be sharded over an
  "expert" mesh axis.

  Args:
    dim: model width D.
    hidden_dim: hidden width of each expert MLP.
    num_experts: E.
    top_k: experts per token.
    capacity_factor: capacity factor used when `train=True`.
    eval_capacity_factor: capacity factor used when `train=False`; usually
      larger, so evaluation drops (almost) nothing.
    dispatch: dispatch algorithm, a key of `DISPATCH_ALGORITHMS` ("dense",
      "einsum", "sort", "dropless"); all give the same output wherever capacity
      suffices (see `fairmoe_jax.moe.algorithms`).
    mesh: a mesh with an "expert" axis: experts are split over it and tokens
      travel to them by all_to_all inside `jax.shard_map`
      (`fairmoe_jax.moe.expert_parallel`); capacity algorithms only.
    dtype: compute dtype of the experts; routing is always float32.
    param_dtype: dtype of the parameters.
    rngs: parameter RNGs.
  """

  def __init__(
      self,
      dim: int,
      hidden_dim: int,
      num_experts: int,
      top_k: int,
      *,
      capacity_factor: float = 1.25,
      eval_capacity_factor: float = 2.0,
      dispatch: str = "einsum",
      mesh: jax.sharding.Mesh | None = None,
      dtype: Any = jnp.float32,
      param_dtype: Any = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if dispatch not in DISPATCH_ALGORITHMS:
      raise ValueError(f"dispatch={dispatch!r}; known: {', '.join(DISPATCH_ALGORITHMS)}")
    if mesh is not None:
      if dispatch not in EP_ALGORITHMS:
        raise ValueError(
            f"dispatch={dispatch!r} has no expert-parallel version; with a mesh use one of "
            f"{', '.join(EP_ALGORITHMS)}"
        )
      if num_experts % mesh.shape[EXPERT_AXIS]:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the mesh's {EXPERT_AXIS!r} axis "
            f"of size {mesh.shape[EXPERT_AXIS]}"
        )
    self.dispatch = dispatch
    self.mesh = mesh
    self.dim = dim
    self.hidden_dim = hidden_dim
    self.num_experts = num_experts
    self.top_k = top_k
    self.capacity_factor = capacity_factor
    self.eval_capacity_factor = eval_capacity_factor
    self.dtype = dtype
    self.router = TopKRouter(dim, num_experts, top_k, rngs=rngs)

    def param(init: Callable[..., jax.Array], shape: tuple[int, ...]) -> nnx.Param:
      # One tensor for all experts, sharded along its leading expert axis only.
      sharding = (EXPERT_AXIS,) + (None,) * len(shape)
      return _expert_param(init, rngs.params(), (num_experts, *shape), param_dtype, sharding)

    self.w1 = param(_KERNEL_INIT, (dim, hidden_dim))
    self.b1 = param(_BIAS_INIT, (hidden_dim,))
    self.w2 = param(_KERNEL_INIT, (hidden_dim, dim))
    self.b2 = param(_BIAS_INIT, (dim,))

  def __call__(self, x: jax.Array, *, train: bool) -> tuple[jax.Array, MoEAux]:
    """x: [B, S, D] -> (y [B, S, D] in the compute dtype, MoEAux).

    Each example is one dispatch group, so capacity is per example and per
    expert: C = ceil(capacity_factor * S * k / E).
    """
    batch, seq_len, dim = x.shape
    x = x.astype(self.dtype)
    route = self.router(x.reshape(batch * seq_len, dim))
    expert_index = route.expert_index.reshape(batch, seq_len, self.top_k)
    gates = route.gates.reshape(batch, seq_len, self.top_k)

    capacity_factor = self.capacity_factor if train else self.eval_capacity_factor
    capacity = dispatch_lib.compute_capacity(seq_len, self.num_experts, self.top_k, capacity_factor)
    experts = ExpertWeights.from_module(self)
    if self.mesh is None:
      y, stats = DISPATCH_ALGORITHMS[self.dispatch](
          x, expert_index, gates, experts, capacity=capacity
      )
    else:  # Each device routes its own examples; tokens reach their experts by all_to_all.
      y, stats = expert_parallel_moe(
          x,
          expert_index,
          gates,
          experts,
          capacity=capacity,
          mesh=self.mesh,
          algorithm=self.dispatch,
      )

    probs = route.probs
    metrics = {
        "fraction_dropped": stats.fraction_dropped,
        # Served (token, choice) pairs per expert, as a fraction of all T * k;
        # equals the batch mean of example_expert_fraction.
        "tokens_per_expert": stats.group_expert_fraction.mean(axis=0),
        "example_expert_fraction": stats.group_expert_fraction,
        "router_entropy": jnp.mean(jnp.sum(jax.scipy.special.entr(probs), axis=-1)),
        "importance": probs.sum(axis=0) / probs.sum(),
    }
    aux = MoEAux(loss=route.load_balance_loss, z_loss=route.z_loss, metrics=metrics)
    return y, aux
