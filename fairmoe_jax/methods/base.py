"""The protocol every method of paper Tables 1-2 follows, and what the MoE methods share.

A method builds its model, names and computes its loss terms, says what context its model
reads at evaluation, and may add a review hook (FairSMoE's expert management). The training
loss is always the sum of the named terms (`make_loss_fn`), and each term is logged as
`loss/<name>`, so what a run minimised can be read term by term in metrics.jsonl.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from fairmoe_jax.data.augment import normalize_on_device
from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.fairness.surrogates import fairness_surrogate, psi_terms
from fairmoe_jax.moe import MoEAux

Batch = dict[str, jax.Array]
# (model, batch, rng, step, extra) -> ({term: weighted scalar}, {metric: scalar})
LossTerms = Callable[..., tuple[dict[str, jax.Array], dict[str, jax.Array]]]
# review(state) -> (state, scalars[, lines]); runs every `every_steps` training steps.
Review = Callable[[Any], tuple[Any, dict[str, float]]]


class Method:
  """What `fairmoe_jax.train` asks of a method; the defaults are those of a method that reads
  nothing at inference and never revises itself."""

  name: str

  def build_model(
      self, config: ml_collections.ConfigDict, info: DatasetInfo, rngs: nnx.Rngs, mesh: Mesh | None
  ) -> nnx.Module:
    raise NotImplementedError

  def loss_terms(self, config: ml_collections.ConfigDict, info: DatasetInfo) -> LossTerms:
    raise NotImplementedError

  def eval_context(self, config: ml_collections.ConfigDict, batch: Batch) -> dict | None:
    """What the model reads beside the images at evaluation (None: nothing)."""
    return None

  def initial_extra(self, config: ml_collections.ConfigDict, info: DatasetInfo) -> dict:
    """Host values kept in TrainState.extra (checkpointed with the run)."""
    return {}

  def review(
      self,
      config: ml_collections.ConfigDict,
      info: DatasetInfo,
      *,
      graphdef: nnx.GraphDef,
      mesh: Mesh,
      validate: Callable[[Any], dict[str, Any]],
  ) -> tuple[int, Review] | None:
    """(every_steps, review) for a method that revises itself during training, else None."""
    return None


def make_loss_fn(method: Method, config: ml_collections.ConfigDict, info: DatasetInfo):
  """`loss_fn(model, batch, rng, step, extra) -> (loss, metrics)`: the sum of the method's terms."""
  terms_fn = method.loss_terms(config, info)

  def loss_fn(model, batch, rng, step, extra):
    batch = dict(batch, image=normalize_on_device(batch["image"]))  # uint8 from the host.
    terms, metrics = terms_fn(model, batch, rng, step, extra)
    loss = sum(terms.values(), jnp.zeros((), jnp.float32))
    metrics = dict(metrics, **{f"loss/{name}": value for name, value in terms.items()})
    return loss, metrics

  return loss_fn


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def psi_term(config, info: DatasetInfo, logits, batch: Batch, attributes=None) -> jax.Array:
  """lambda * L_Psi (Eq. 3-4): each surrogate the `fair.psi` rule names, summed over attributes,
  times its own lambda (`fair.lambda_pqd`, `fair.lambda_dp`)."""
  return sum(
      config.fair[f"lambda_{psi}"]
      * fairness_surrogate(
          logits,
          batch["label"],
          batch["attributes"],
          info.group_sizes,
          psi,
          attribute_indices=attributes,
      )
      for psi in psi_terms(config.fair.psi)
  )


# `moe.dispatch="auto"` (the config's default): the dispatch measured fastest on the platform
# the model is built for (docs/benchmarks.md, "Which dispatch on an accelerator"). Each serves
# `sort`'s choices and has an expert-parallel version, so the platform changes results only by
# float rounding.
AUTO_DISPATCH = {"cpu": "sort", "tpu": "einsum", "gpu": "sort"}


def resolve_dispatch(dispatch: str, mesh: Mesh | None) -> str:
  """`dispatch`, or for "auto" `AUTO_DISPATCH` of the mesh's devices' platform (a TPU compile on
  a CPU host gets the TPU's choice), else of JAX's default backend; `sort` if not listed."""
  if dispatch != "auto":
    return dispatch
  platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  return AUTO_DISPATCH.get(platform, "sort")


def moe_kwargs(config: ml_collections.ConfigDict, mesh: Mesh | None, router: Any) -> dict:
  """`SparseMoE` keyword arguments from `config.moe`: on a mesh of several devices the layer
  dispatches each device's own examples, expert-parallel where `mesh.expert` > 1."""
  c = config.moe
  sharded = mesh is not None and mesh.size > 1
  return dict(
      num_experts=c.num_experts,
      top_k=c.top_k,
      dispatch=resolve_dispatch(c.dispatch, mesh),
      capacity_factor=c.capacity_factor,
      eval_capacity_factor=c.eval_capacity_factor,
      router=router,
      batch_priority=c.batch_priority,
      capacity_multiple_of=c.capacity_multiple_of,
      group_size=c.group_size,
      mesh=mesh if sharded else None,
  )


def auxiliary_terms(config: ml_collections.ConfigDict, aux: MoEAux) -> dict[str, jax.Array]:
  """The MoE auxiliary losses, one recipe for every MoE method (terms with weight 0 left out)."""
  terms = {}
  if config.moe.aux_loss_weight > 0:
    terms["load_balance"] = config.moe.aux_loss_weight * aux.loss
  if config.moe.z_loss_weight > 0:
    terms["router_z"] = config.moe.z_loss_weight * aux.z_loss
  return terms


def routing_metrics(aux: MoEAux) -> dict[str, jax.Array]:
  """The scalar routing metrics of every MoE block, for the training log."""
  return {k: v for k, v in aux.metrics.items() if jnp.ndim(v) == 0}
