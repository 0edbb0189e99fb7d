"""The methods of paper Tables 1-2, selected by `config.method`: how each builds its model
and what it minimises.

| method            | model                       | loss                                               |
|-------------------|-----------------------------|----------------------------------------------------|
| fairsmoe          | backbone + MoE, FairRouter  | CE + lambda L_Psi + spec + confusion + attr CE + aux |
| fairsmoe_no_fgr   | same, plain gate + FEM      | without the SA branch (confusion, attr CE)         |
| fairsmoe_no_fem   | same, FGR only              | without specialization / dynamic allocation        |
| vanilla_smoe      | backbone + MoE, top-k       | CE only: no auxiliary loss, no noise (as the paper) |
| smoe              | backbone + MoE, moe.router  | CE + the moe.* auxiliary losses (no fairness terms) |
| muffin            | 2+ backbones, fusion head   | phase 1: per-backbone CE + lambda L_Psi(own attr); phase 2: fused CE + lambda L_Psi |
| multifair         | backbone, no MoE            | CE + weight * cross-group mixup CE                 |

`L_Psi` is the differentiable batch surrogate of `fairmoe_jax.fairness.surrogates`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from fairmoe_jax.data.types import DatasetInfo
from fairmoe_jax.fairness import experts as experts_lib
from fairmoe_jax.fairness.mixup import mix
from fairmoe_jax.fairness.surrogates import fairness_surrogate
from fairmoe_jax.models.backbones import build_backbone
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.moe.fair_router import FairRouter
from trainkit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Method:
  """What distinguishes the methods; see the module docstring."""

  moe: bool = True
  fair_router: bool = False
  guided: bool = False  # FGR
  specialize: bool = False  # FEM
  psi: bool = False  # lambda * L_Psi
  moe_aux: bool = True  # load-balancing / z-loss from config.moe
  muffin: bool = False
  multifair: bool = False


METHODS: dict[str, Method] = {
    "fairsmoe": Method(fair_router=True, guided=True, specialize=True, psi=True),
    "fairsmoe_no_fgr": Method(fair_router=True, guided=False, specialize=True, psi=True),
    "fairsmoe_no_fem": Method(fair_router=True, guided=True, specialize=False, psi=True),
    "vanilla_smoe": Method(moe_aux=False),
    "smoe": Method(),
    "muffin": Method(moe=False, muffin=True, psi=True),
    "multifair": Method(moe=False, multifair=True),
}


def build_model(
    config: ml_collections.ConfigDict,
    info: DatasetInfo,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
) -> nnx.Module:
  """The model of `config.method`; with a mesh whose expert axis is > 1, its MoE is expert-parallel."""
  method = METHODS[config.method]
  moe = None
  if method.moe:
    c = config.moe
    expert_parallel = mesh is not None and mesh.shape["expert"] > 1
    moe = dict(
        num_experts=c.num_experts,
        top_k=c.top_k,
        dispatch=c.dispatch,
        capacity_factor=c.capacity_factor,
        eval_capacity_factor=c.eval_capacity_factor,
        router=c.router,
        batch_priority=c.batch_priority,
        mesh=mesh if expert_parallel else None,
    )
    if method.fair_router:
      moe["router"] = _fair_router_factory(config, info, method)
  if method.muffin:
    attributes = muffin_attributes(config, info)
    bad = [a for a in attributes if not 0 <= a < info.num_attributes]
    if bad:
      raise ConfigError(
          "muffin.attributes",
          f"{attributes}: one attribute index per backbone, each in "
          f"[0, {info.num_attributes}) for the attributes {', '.join(info.attribute_names)}",
      )
    make = lambda r: build_backbone(config, info.num_classes, None, r)
    return Muffin(make, len(attributes), info.num_classes, rngs=rngs)
  return build_backbone(config, info.num_classes, moe, rngs)


def muffin_attributes(config: ml_collections.ConfigDict, info: DatasetInfo) -> tuple[int, ...]:
  """The attribute each Muffin backbone is first trained on; () means the first two."""
  return tuple(config.muffin.attributes) or tuple(range(min(2, info.num_attributes)))


def _fair_router_factory(config, info: DatasetInfo, method: Method) -> Callable[..., FairRouter]:
  """A router per MoE block (each block has its own router parameters)."""
  f = config.fair

  def make(dim: int, num_experts: int, top_k: int, *, rngs: nnx.Rngs) -> FairRouter:
    return FairRouter(
        dim,
        num_experts,
        top_k,
        info.group_sizes,
        experts_lib.initial_assignment(info.group_sizes, num_experts),
        guided=method.guided,
        specialize=method.specialize,
        route_by=f.route_by,
        feature_dim=f.feature_dim or None,
        alpha=f.alpha,
        rngs=rngs,
    )

  return make


def context_of(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """What travels with the batch to every MoE router."""
  return {"attributes": batch["attributes"]}


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_loss_fn(config: ml_collections.ConfigDict, info: DatasetInfo):
  """`loss_fn(model, batch, rng, step, extra) -> (loss, metrics)` of `config.method`."""
  method = METHODS[config.method]
  f = config.fair
  group_sizes = info.group_sizes

  def psi(logits, batch, attribute_indices=None):
    return fairness_surrogate(
        logits,
        batch["label"],
        batch["attributes"],
        group_sizes,
        f.psi,
        attribute_indices=attribute_indices,
    )

  def smoe_loss(model, batch, rng, step, extra):
    del step, extra
    rngs = nnx.Rngs(dropout=rng, noise=jax.random.fold_in(rng, 1))
    logits, aux = model(batch["image"], train=True, rngs=rngs, context=context_of(batch))
    ce = _cross_entropy(logits, batch["label"])
    loss = ce
    metrics = {"cross_entropy": ce}
    if method.moe_aux:
      loss += config.moe.aux_loss_weight * aux.loss + config.moe.z_loss_weight * aux.z_loss
      metrics["moe_aux_loss"] = aux.loss
    if method.psi:
      l_psi = psi(logits, batch)
      loss += f.lambda_psi * l_psi
      metrics["fairness_surrogate"] = l_psi
    weights = {
        "confusion": f.confusion_weight,
        "attribute_ce": f.attribute_ce_weight,
        "specialization": f.specialization_weight,
    }
    for name, value in aux.extra_losses.items():
      loss += weights[name] * value
      metrics[name] = value
    metrics["accuracy"] = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    metrics.update({k: v for k, v in aux.metrics.items() if jnp.ndim(v) == 0})
    return loss, metrics

  def muffin_loss(model: Muffin, batch, rng, step, extra):
    del extra
    # Phase 1 trains each backbone (with its own head) toward fairness on its attribute;
    # phase 2 trains the fusion head on the frozen backbones' features.
    pretrain_steps = int(config.muffin.pretrain_fraction * config.num_train_steps)
    in_phase_1 = step < pretrain_steps
    rngs = nnx.Rngs(dropout=rng)
    fused, branch_logits, features = model.branches(batch["image"], train=True, rngs=rngs)
    branch_loss = 0.0
    for logits, attribute in zip(branch_logits, muffin_attributes(config, info)):
      branch_loss += _cross_entropy(logits, batch["label"])
      branch_loss += f.lambda_psi * psi(logits, batch, (attribute,))
    fused = model.fuse([jax.lax.stop_gradient(x) for x in features])
    ce = _cross_entropy(fused, batch["label"])
    fusion_loss = ce + f.lambda_psi * psi(fused, batch)
    loss = jnp.where(in_phase_1, branch_loss, fusion_loss)
    metrics = {
        "cross_entropy": ce,
        "muffin_phase": 2.0 - in_phase_1.astype(jnp.float32),
        "accuracy": jnp.mean(jnp.argmax(fused, -1) == batch["label"]),
    }
    return loss, metrics

  def multifair_loss(model, batch, rng, step, extra):
    del extra
    rngs = nnx.Rngs(dropout=rng)
    logits, _ = model(batch["image"], train=True, rngs=rngs)
    ce = _cross_entropy(logits, batch["label"])
    attribute = step % len(group_sizes)
    groups = jnp.take(batch["attributes"], attribute, axis=1)
    images, partners, lam = mix(
        jax.random.fold_in(rng, 2), batch["image"], groups, config.multifair.mixup_alpha
    )
    mixed_logits, _ = model(images, train=True, rngs=rngs)
    mixed_ce = jnp.mean(
        lam * optax.softmax_cross_entropy_with_integer_labels(mixed_logits, batch["label"])
        + (1 - lam)
        * optax.softmax_cross_entropy_with_integer_labels(mixed_logits, batch["label"][partners])
    )
    loss = ce + config.multifair.weight * mixed_ce
    metrics = {
        "cross_entropy": ce,
        "mixup_cross_entropy": mixed_ce,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
    }
    return loss, metrics

  if method.muffin:
    return muffin_loss
  if method.multifair:
    return multifair_loss
  return smoe_loss


def uses_expert_management(config: ml_collections.ConfigDict) -> bool:
  method = METHODS[config.method]
  return method.fair_router and method.specialize and config.fair.dynamic_allocation


def single_attribute_fairness(report: dict[str, Any], psi: str) -> list[float]:
  """SF_i from a validation report, oriented so that higher is fairer."""
  values = [attr[psi] for attr in report["attributes"].values()]
  return [v if psi == "pqd" else -v for v in values]
