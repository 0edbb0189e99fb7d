"""Every method of paper Tables 1-2 trains in the jitted step and minimises exactly the sum of
its named terms; the default FairSMoE never reads a sensitive label at evaluation; FEM changes
the expert assignment between steps without recompiling."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fairmoe_jax import config as fairmoe_config
from fairmoe_jax import evaluation, methods, train
from fairmoe_jax.models.muffin import Muffin
from fairmoe_jax.moe.routers.fair import FairRouter
from trainkit.mesh import make_mesh, shard_batch
from trainkit.optim import learning_rate_schedule, make_optimizer
from trainkit.train_state import jit_train_step, make_train_step


def _config(method: str, backbone: str = "vit", image_size: int = 16):
  config = fairmoe_config.base_config()
  config.method = method
  config.model.backbone = backbone
  config.data.update(train_size=64, val_size=32, test_size=32, num_threads=0, image_size=image_size)
  config.model.update(dim=16, depth=2, num_heads=2, mlp_dim=32)
  config.update(batch_size=16, eval_batch_size=16, num_train_steps=4)
  config.muffin.pretrain_fraction = 0.5
  fairmoe_config.validate(config, num_devices=jax.device_count())
  return config


def _setup(config):
  mesh = make_mesh({"data": 1, "expert": 1})
  info, splits = train.load_data(config)
  tx = make_optimizer(config.optimizer, config.num_train_steps)
  graphdef, state = train.create_state(config, info, tx, mesh)
  schedule = learning_rate_schedule(config.optimizer, config.num_train_steps)
  step = jit_train_step(
      make_train_step(graphdef, train.make_loss_fn(config, info), tx, schedule), state, mesh
  )
  batch = {
      "image": np.asarray(splits["train"]["image"][:16], np.float32) / 127.5 - 1,
      "label": splits["train"]["label"][:16],
      "attributes": splits["train"]["attributes"][:16],
      "mask": np.ones(16, np.float32),
  }
  return mesh, info, graphdef, state, step, shard_batch(batch, mesh)


# The loss terms each method minimises: an ablation removes exactly its own.
TERMS = {
    "fairsmoe": {"cross_entropy", "fairness", "confusion", "attribute_ce", "specialization"},
    "fairsmoe_no_fgr": {"cross_entropy", "fairness", "specialization"},
    "fairsmoe_no_fem": {"cross_entropy", "fairness", "confusion", "attribute_ce"},
    "vanilla_smoe": {"cross_entropy"},
    "vanilla_smoe_psi": {"cross_entropy", "fairness"},
    "smoe": {"cross_entropy"},
    "muffin": {"branch_cross_entropy", "branch_fairness", "cross_entropy", "fairness"},
    "multifair": {"cross_entropy", "mixup_cross_entropy"},
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,backbone",
    [(m, "vit") for m in sorted(methods.METHODS)] + [("fairsmoe", "swin_tiny_cpu")],
)
def test_every_method_trains_and_its_loss_is_the_sum_of_its_named_terms(method, backbone):
  config = _config(method, backbone, image_size=32 if backbone.startswith("swin") else 16)
  expected = TERMS[method]
  if method in ("fairsmoe", "vanilla_smoe") and backbone == "vit":
    # The MoE methods share one auxiliary-loss recipe: given weights, its terms join the sum.
    config.moe.aux_loss_weight, config.moe.z_loss_weight = 0.01, 0.001
    expected = expected | {"load_balance", "router_z"}
  mesh, info, graphdef, state, step, batch = _setup(config)
  model = nnx.merge(graphdef, state.params, state.model_state)
  has_fair_router = any(isinstance(n, FairRouter) for _, n in nnx.iter_graph(model))
  assert has_fair_router == method.startswith("fairsmoe")
  assert isinstance(model, Muffin) == (method == "muffin")
  losses, phases = [], []
  for _ in range(4):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    phases.append(float(metrics.get("muffin_phase", 0)))
    terms = {k[len("loss/") :]: float(v) for k, v in metrics.items() if k.startswith("loss/")}
    assert set(terms) == expected
    np.testing.assert_allclose(sum(terms.values()), float(metrics["loss"]), rtol=1e-5)
  assert np.all(np.isfinite(losses)), losses
  if method == "muffin":
    assert phases == [1.0, 1.0, 2.0, 2.0]  # Backbones first, then the fusion head.


@pytest.mark.parametrize("reading", ["attribute_routing", "expert_competence", "class_routing"])
def test_every_reading_of_the_specialization_loss_trains(reading):
  config = _config("fairsmoe")
  config.fair.specialization = reading
  _, _, _, state, step, batch = _setup(config)
  first = None
  for _ in range(3):
    state, metrics = step(state, batch)
    first = first if first is not None else float(metrics["loss/specialization"])
  assert np.isfinite(float(metrics["loss"]))
  assert float(metrics["loss/specialization"]) != first  # It moves: the term has a gradient.


def test_under_expert_competence_the_allocation_reaches_routing_only_through_the_experts():
  # The literal Eq. 8 is a task loss of each expert: its gradient trains the experts and their
  # competence head, never the router. So a FEM growth cannot move the routing by itself; it
  # changes what the experts it assigns learn, and the gate follows only through the task loss
  # (report.json's fem_changes says whether it did). docs/design.md, "FEM and routing".
  config = _config("fairsmoe")
  assert config.fair.specialization == "expert_competence"
  _, info, graphdef, state, _, batch = _setup(config)
  terms = methods.METHODS["fairsmoe"].loss_terms(config, info)

  def specialization(params):
    model = nnx.merge(graphdef, params, state.model_state)
    return terms(model, batch, jax.random.key(0), 0, {})[0]["specialization"]

  grads = nnx.to_flat_state(jax.jit(jax.grad(specialization))(state.params))
  norms = {}
  for path, leaf in grads:
    value = getattr(leaf, "get_value", lambda: leaf)()
    norms[".".join(str(p) for p in path)] = float(jnp.linalg.norm(value))
  routing = {k: v for k, v in norms.items() if "router" in k and "competence_head" not in k}
  experts = {k: v for k, v in norms.items() if ".mlp.w" in k or ".mlp.b" in k}
  assert routing and all(v == 0.0 for v in routing.values()), routing
  assert any(v > 0 for v in experts.values()), experts
  assert any(v > 0 for k, v in norms.items() if "competence_head" in k)


@pytest.fixture(scope="module")
def trained_fairsmoe():
  """The default FairSMoE, its info, graphdef, state and batch after 3 steps on that batch (the
  SA classifiers leave their initial point, so p_a varies over tokens): one compile of its train
  step for the tests that read its evaluation."""
  config = _config("fairsmoe")
  _, info, graphdef, state, step, batch = _setup(config)
  for _ in range(3):
    state, _ = step(state, batch)
  return config, info, graphdef, state, dict(batch, mask=jnp.ones(len(batch["label"])))


def _with_routers(trained, edit):
  """(graphdef, state) of a copy of the trained model after `edit(router)` on each FairRouter."""
  _, _, graphdef, state, _ = trained
  # A copy: merged models share the state's variables, which the other tests read unedited.
  model = nnx.clone(nnx.merge(graphdef, state.params, state.model_state))
  for _, node in nnx.iter_graph(model):
    if isinstance(node, FairRouter):
      edit(node)
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  return graphdef, state.replace(params=params, model_state=model_state)


def _sa_branch(trained, scale: float) -> dict:
  """`report["sa_branch"]` of one evaluation batch after the projections W_a and the SA
  classifiers' kernels are set to scale * N(0, 1) (0 = an SA branch that adds nothing; large =
  confident classifiers whose votes differ between tokens)."""
  config, info, _, _, batch = trained
  rng = np.random.default_rng(0)

  def scale_sa_branch(router):
    for p in [*router.projections, *(h.kernel for h in router.attribute_heads)]:
      p.set_value(jnp.asarray(rng.normal(size=p.shape) * scale, jnp.float32))

  graphdef, state = _with_routers(trained, scale_sa_branch)
  counts = evaluation.make_eval_step(graphdef, info, config)(state, batch)
  return evaluation.sa_branch_report(jax.device_get(counts["sa_branch"]))


def test_the_report_says_how_much_of_the_routing_the_sa_branch_decides(trained_fairsmoe):
  (silent,) = _sa_branch(trained_fairsmoe, 0.0).values()
  assert silent["variance_share"] == 0.0 and silent["choices_changed"] == 0.0
  (loud,) = _sa_branch(trained_fairsmoe, 30.0).values()
  assert loud["variance_share"] > 0.5 and loud["choices_changed"] > 0.1, loud
  assert loud["sa_logit_std"] > loud["gate_logit_std"]


def _eval_predictions(trained, route_by: str):
  """The eval step's counts and the model's logits on one batch, with its sensitive attributes
  as they are and scrambled, with the trained model's routers reading them as `route_by` says."""
  config, info, _, _, batch = trained
  config = config.copy_and_resolve_references()
  config.fair.route_by = route_by
  rng = np.random.default_rng(0)

  def read_attributes_strongly(router):
    router.route_by = route_by
    for p in router.projections:  # Make every attribute move the routing strongly.
      p.set_value(jnp.asarray(rng.normal(size=p.shape) * 10, jnp.float32))

  graphdef, state = _with_routers(trained, read_attributes_strongly)
  eval_step = evaluation.make_eval_step(graphdef, info, config)

  @jax.jit  # Eagerly, the forward compiles each of its hundreds of operations: 4x the time.
  def logits_of(state, image, context):
    model = nnx.merge(graphdef, state.params, state.model_state)
    return model(image, train=False, context=context)[0]

  attributes = np.asarray(batch["attributes"])
  scrambled = np.stack([(attributes[:, i] + 1) % g for i, g in enumerate(info.group_sizes)], 1)
  results = []
  for batch_attributes in (attributes, scrambled):
    probe = {**batch, "attributes": jnp.asarray(batch_attributes)}
    counts = eval_step(state, probe)
    context = methods.METHODS[config.method].eval_context(config, probe)
    logits = logits_of(state, probe["image"], context)
    results.append((np.asarray(counts["overall"]), np.asarray(logits)))
  return results


@pytest.mark.slow
def test_default_evaluation_never_reads_the_sensitive_attributes(trained_fairsmoe):
  assert trained_fairsmoe[0].fair.route_by == "predicted"
  (counts, logits), (scrambled_counts, scrambled_logits) = _eval_predictions(
      trained_fairsmoe, "predicted"
  )
  np.testing.assert_array_equal(logits, scrambled_logits)
  np.testing.assert_array_equal(counts, scrambled_counts)
  # The same probe sees the difference when the same weights do read them (route_by=label).
  (_, by_label), (_, by_label_scrambled) = _eval_predictions(trained_fairsmoe, "label")
  assert np.abs(by_label - by_label_scrambled).max() > 1e-4


def test_expert_review_changes_the_assignment_without_recompiling():
  config = _config("fairsmoe")
  config.fair.patience = 1
  mesh, info, graphdef, state, step, batch = _setup(config)
  state, _ = step(state, batch)
  compiled = step._cache_size()
  reports = iter([0.5, 0.6])

  def validate(state):
    sf = next(reports)
    return {"attributes": {n: {"pqd": sf} for n in info.attribute_names}, "loss": 1.0}

  every, review = methods.METHODS["fairsmoe"].review(
      config, info, graphdef=graphdef, mesh=mesh, validate=validate
  )
  assert every == config.fair.review_every_steps

  def assignment(state):
    model = nnx.merge(graphdef, state.params, state.model_state)
    return next(
        np.asarray(n.assignment[...]) for _, n in nnx.iter_graph(model) if isinstance(n, FairRouter)
    )

  before = assignment(state)
  state, _, lines = review(state)  # Baseline.
  assert lines == []
  state, logged, lines = review(state)  # Improved: every attribute grows, and says so.
  assert "expert management: grow sex to 2 experts" in lines and len(lines) == 3
  after = assignment(state)
  assert logged["fem/experts/sex"] == 2 and logged["fem/experts/site"] == 2  # site has 8 groups.
  assert after.sum() == before.sum() + info.num_attributes
  state, metrics = step(state, batch)
  state, metrics = step(state, batch)
  assert step._cache_size() == compiled  # New assignment, same compiled step.
  assert np.isfinite(float(metrics["loss"]))
  np.testing.assert_array_equal(np.asarray(state.extra["fem"]["counts"]), 2)


@pytest.mark.parametrize("method", ["fairsmoe", "muffin"])
def test_pretrained_checkpoint_initialises_every_backbone(tmp_path, method):
  from fairmoe_jax.models.convert_timm import export_timm_state_dict

  config = _config(method)
  info, _ = train.load_data(config)
  # A "timm checkpoint" of the plain backbone, exported from a differently seeded model.
  plain = _config("vanilla_smoe")
  plain.moe.blocks = ()
  source = methods.METHODS[plain.method].build_model(plain, info, nnx.Rngs(7), None)
  path = tmp_path / "backbone.npz"
  np.savez(path, **export_timm_state_dict(source))
  config.model.pretrained = str(path)
  model = methods.METHODS[method].build_model(config, info, nnx.Rngs(0), None)
  train.load_pretrained(config, model)
  backbones = model.backbones if method == "muffin" else [model]
  for backbone in backbones:
    np.testing.assert_array_equal(backbone.pos_embed[...], source.pos_embed[...])
    np.testing.assert_array_equal(
        backbone.blocks[0].attn.qkv.kernel[...], source.blocks[0].attn.qkv.kernel[...]
    )
  if method == "fairsmoe":  # The MoE experts are upcycled from the dense MLP of their block.
    moe = model.blocks[-1].mlp
    for e in range(moe.num_experts):
      np.testing.assert_array_equal(moe.w1[...][e], source.blocks[-1].mlp.fc1.kernel[...])


@pytest.mark.slow
def test_the_eval_step_reads_routing_readings_not_metric_names(monkeypatch, trained_fairsmoe):
  """Each MoE block's expert usage is the masked sum of its `RoutingReadings` (numpy), and
  renaming every logged metric changes none of the eval step's counts."""
  from fairmoe_jax.data.augment import normalize_on_device
  from fairmoe_jax.moe import MoEAux

  config, info, graphdef, state, batch = trained_fairsmoe
  mask = np.r_[np.ones(12), np.zeros(4)].astype(np.float32)
  batch = dict(batch, mask=jnp.asarray(mask))
  counts = jax.device_get(evaluation.make_eval_step(graphdef, info, config)(state, batch))

  @jax.jit  # Eagerly, the forward compiles each of its hundreds of operations.
  def forward_aux(state, images):
    return nnx.merge(graphdef, state.params, state.model_state)(images, train=False)[1]

  aux = forward_aux(state, normalize_on_device(batch["image"], batch["mask"]))
  assert set(counts["expert_usage"]["choices"]) == set(aux.routing) == {"moe_block1"}
  assert set(counts["sa_correct"]) == set(counts["sa_branch"]) == set(aux.routing)
  for block, readings in aux.routing.items():
    per_example_usage = {"choices": readings.expert_fraction, "gate_weight": readings.gate_weight}
    for kind, per_example in per_example_usage.items():
      np.testing.assert_allclose(
          counts["expert_usage"][kind][block]["total"],
          (np.asarray(per_example, np.float64) * mask[:, None]).sum(0),
          rtol=1e-5,
      )

  merge = MoEAux.merge.__func__

  def renamed(cls, named):
    merged = merge(cls, named)
    return merged.replace(metrics={f"renamed/{k}": v for k, v in merged.metrics.items()})

  monkeypatch.setattr(MoEAux, "merge", classmethod(renamed))
  again = jax.device_get(evaluation.make_eval_step(graphdef, info, config)(state, batch))
  assert jax.tree.structure(again) == jax.tree.structure(counts)
  jax.tree.map(np.testing.assert_array_equal, again, counts)
