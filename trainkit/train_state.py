"""Explicit training state and a pure train step built from a model's loss function."""

from __future__ import annotations

from typing import Any, Callable

import flax
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from trainkit.mesh import place, replicated

# loss_fn(model, batch, rng, step, extra) -> (scalar loss, metrics); `step` is the int32 counter
# (for training phases), `extra` TrainState.extra, read-only here.
LossFn = Callable[
    [nnx.Module, dict[str, jax.Array], jax.Array, jax.Array, dict[str, Any]],
    tuple[jax.Array, dict[str, jax.Array]],
]
# update_extra(extra, metrics) -> (extra, scalars): after the optimiser step (e.g. dual ascent).
UpdateExtraFn = Callable[
    [dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, jax.Array]]
]


@flax.struct.dataclass
class TrainState:
  """Everything a run needs to continue, as one pytree; step t uses fold_in(rng, t), and `extra`
  is non-gradient state updated between steps (e.g. Lagrange multipliers)."""

  step: jax.Array
  params: nnx.State
  model_state: nnx.State
  # An optax.OptState, whose recursive alias the API reference cannot resolve.
  opt_state: Any
  rng: jax.Array
  extra: dict[str, Any] = flax.struct.field(default_factory=dict)


def create_train_state(
    make_model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    seed: int,
    *,
    load_weights: Callable[[nnx.Module], None] | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
  """Builds the model in one jitted call on `mesh` (each process creates only its own shards),
  then the optimiser state. `load_weights(model)` runs eagerly after and must keep the shapes."""

  def init() -> nnx.Module:
    model = make_model()
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model

  with jax.set_mesh(mesh):
    model = nnx.jit(init)()
  if load_weights is not None:
    load_weights(model)
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  params = place(params, state_shardings(params, mesh))
  model_state = place(model_state, state_shardings(model_state, mesh))
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init, out_shardings=_optimizer_shardings(tx, params, mesh))(params)
  scalars = place(
      {"step": np.zeros((), np.int32), "rng": np.asarray(jax.random.PRNGKey(seed))},
      replicated(mesh),
  )
  state = TrainState(
      step=scalars["step"],
      params=params,
      model_state=model_state,
      opt_state=opt_state,
      rng=scalars["rng"],
  )
  return graphdef, state


def abstract_train_state(
    make_model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    extra: dict[str, Any] | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
  """The state `create_train_state` would build, as ShapeDtypeStructs with its shardings,
  traced (`nnx.eval_shape`) so that `mesh` may be of devices this host lacks."""
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(make_model)
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree, shardings
  )
  params, model_state = (placed(s, nnx.get_named_sharding(s, mesh)) for s in (params, model_state))
  opt_state = placed(jax.eval_shape(tx.init, params), _optimizer_shardings(tx, params, mesh))
  replicate = lambda x: jax.ShapeDtypeStruct(
      np.shape(x), np.asarray(x).dtype, sharding=replicated(mesh)
  )
  state = TrainState(
      step=replicate(np.zeros((), np.int32)),
      params=params,
      model_state=model_state,
      opt_state=opt_state,
      rng=jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated(mesh)),
      extra=jax.tree.map(replicate, dict(extra or {})),
  )
  return graphdef, state


def _optimizer_shardings(tx: optax.GradientTransformation, params: nnx.State, mesh: Mesh) -> Any:
  """Optimizer moments take their parameter's sharding; counts and scalars are replicated."""
  return optax.tree_map_params(
      tx,
      lambda _, sharding: sharding,
      jax.eval_shape(tx.init, params),
      state_shardings(params, mesh),
      transform_non_params=lambda _: replicated(mesh),
  )


def state_shardings(state: Any, mesh: Mesh) -> Any:
  """Each leaf's NamedSharding on `mesh`; leaves not placed by name are replicated."""
  default = replicated(mesh)
  return jax.tree.map(
      lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else default,
      state,
  )


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    update_extra: UpdateExtraFn | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """A pure `train_step(state, batch) -> (state, metrics)` to jit; metrics named "_..." are
  `update_extra`'s alone, not returned."""

  def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
    rng = jax.random.fold_in(state.rng, state.step)

    def objective(params):
      model = nnx.merge(graphdef, params, state.model_state)
      loss, metrics = loss_fn(model, batch, rng, state.step, state.extra)
      _, _, model_state = nnx.split(model, nnx.Param, ...)
      return loss, (metrics, model_state)

    (loss, (metrics, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
        state.params
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    extra = state.extra
    if update_extra is not None:
      extra, extra_metrics = update_extra(extra, metrics)
      metrics = dict(metrics, **extra_metrics)
    metrics = {k: v for k, v in metrics.items() if not k.startswith("_")}
    metrics = dict(
        metrics, loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params)
    )
    if schedule is not None:
      metrics["learning_rate"] = schedule(state.step)
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        extra=extra,
    )
    return new_state, metrics

  return train_step


def jit_train_step(train_step, state: TrainState, mesh: Mesh):
  """Jits with the state donated and its shardings pinned, so steps never reshard it."""
  with jax.set_mesh(mesh):
    return jax.jit(train_step, donate_argnums=0, out_shardings=(state_shardings(state, mesh), None))


def compute_dtype(name: str) -> jnp.dtype:
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
