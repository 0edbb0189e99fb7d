"""FairSMoE's training-time pieces: L_Psi surrogates, the fairness-guided router, what each
reading of the specialization loss is minimised by, dynamic expert allocation and cross-group
mixup."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from fairmoe_jax.fairness.experts import (
    ExpertAllocator,
    attribute_assignment,
    class_assignment,
    initial_state,
)
from fairmoe_jax.fairness.mixup import cross_group_partners
from fairmoe_jax.fairness.surrogates import fairness_surrogate
from fairmoe_jax.methods.base import psi_term
from fairmoe_jax.moe.routers.fair import FairRouter

GROUP_SIZES = (2, 3)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------------------
# L_Psi surrogates
# ---------------------------------------------------------------------------


def _surrogate_reference(logits, labels, attributes, mask, psi):
  probs = _softmax(np.asarray(logits, np.float64))
  spreads = []
  for i, size in enumerate(GROUP_SIZES):
    per_group = []
    for g in range(size):
      members = (attributes[:, i] == g) & (mask > 0)
      if not members.any():
        continue
      if psi == "pqd":
        per_group.append(np.array([probs[members, labels[members]].mean()]))
      else:
        per_group.append(probs[members].mean(0))
    per_group = np.stack(per_group)
    spreads.append((per_group.max(0) - per_group.min(0)).max() if len(per_group) > 1 else 0.0)
  return np.sum(spreads)  # Eq. 3 sums over attributes.


@pytest.mark.parametrize("psi", ["pqd", "dp"])
def test_surrogate_matches_numpy_reference(psi):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(12, 3)) * 2
  labels = rng.integers(0, 3, 12)
  attributes = np.stack([rng.integers(0, 2, 12), rng.integers(-1, 2, 12)], 1)  # group 2 absent
  mask = (np.arange(12) < 10).astype(np.float32)  # Two padded examples.
  got = jax.jit(fairness_surrogate, static_argnums=(3, 4))(
      jnp.asarray(logits, jnp.float32),
      jnp.asarray(labels),
      jnp.asarray(attributes),
      GROUP_SIZES,
      psi,
      jnp.asarray(mask),
  )
  np.testing.assert_allclose(got, _surrogate_reference(logits, labels, attributes, mask, psi), 1e-5)


def _minimise_psi_term(rule, steps=300):
  """Free logits of 8 examples trained by `psi_term` alone under a `fair.psi` rule.

  Group 0's examples are all of class 0 and group 1's all of class 1, so equal accuracy across
  groups (PQD) and equal prediction rates (DP) pull apart: PQD alone is content with a perfect
  classifier, whose prediction rates differ by 1 between the groups.
  """
  config = ml_collections.ConfigDict(dict(fair=dict(psi=rule, lambda_pqd=1.0, lambda_dp=1.0)))
  info = types.SimpleNamespace(group_sizes=(2,))
  groups = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
  batch = {"label": groups, "attributes": groups[:, None]}
  logits = jnp.stack([2.0 - 4.0 * groups, 4.0 * groups - 2.0], axis=1).astype(jnp.float32)
  grad = jax.jit(jax.grad(lambda l: psi_term(config, info, l, batch)))
  for _ in range(steps):
    logits = logits - 0.5 * grad(logits)
  return logits, batch


@pytest.mark.parametrize("rule", ["pqd", "pqd+dp"])
def test_the_psi_rule_trains_each_term_it_names(rule):
  logits, batch = _minimise_psi_term(rule)
  probs = jax.nn.softmax(logits)
  rate_gap = float(jnp.abs(probs[:4, 1].mean() - probs[4:, 1].mean()))
  pqd_spread = fairness_surrogate(logits, batch["label"], batch["attributes"], (2,), "pqd")
  assert float(pqd_spread) < 0.05  # Both rules equalise the groups' soft accuracies ...
  if rule == "pqd":
    assert rate_gap > 0.9  # ... PQD alone keeps the classifier, and its rate gap of ~1 ...
  else:
    assert rate_gap < 0.1  # ... while the DP term closes it.


def test_surrogate_is_zero_for_identical_groups_and_has_gradient():
  logits = jnp.tile(jnp.array([[2.0, 0.0, -1.0]]), (4, 1))
  attributes = jnp.array([[0, 0], [1, 1], [0, 2], [1, 0]])
  labels = jnp.zeros(4, jnp.int32)
  assert float(fairness_surrogate(logits, labels, attributes, GROUP_SIZES)) == pytest.approx(0.0)
  skewed = logits.at[0, 0].set(5.0)
  grad = jax.grad(lambda x: fairness_surrogate(x, labels, attributes, GROUP_SIZES))(skewed)
  assert float(jnp.abs(grad).sum()) > 0


# ---------------------------------------------------------------------------
# Specialization loss (Eq. 8 as routing supervision)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Expert assignment (S_e as sets of attributes)
# ---------------------------------------------------------------------------


def test_attributes_start_on_distinct_experts_and_grow_onto_free_ones_first():
  a = attribute_assignment(3, 4)
  np.testing.assert_array_equal(a.argmax(1), [0, 1, 2])
  assert a.sum() == 3
  grown = attribute_assignment(3, 4, counts=(2, 1, 1))
  np.testing.assert_array_equal(grown[0], [1, 0, 0, 1])  # Expert 3 was held by nobody.
  np.testing.assert_array_equal(attribute_assignment(1, 4, counts=(4,)), np.ones((1, 4)))


def test_class_assignment_splits_an_attributes_experts_among_its_classes():
  attribute_rows = attribute_assignment(2, 4, counts=(2, 1))
  classes = class_assignment(attribute_rows, (2, 3))
  assert classes.shape == (5, 4)
  # Attribute 0 holds experts {0, 2}: class 0 gets expert 0, class 1 expert 2.
  np.testing.assert_array_equal(classes[0], [1, 0, 0, 0])
  np.testing.assert_array_equal(classes[1], [0, 0, 1, 0])
  # Attribute 1 holds one expert: all three classes share it.
  np.testing.assert_array_equal(classes[2:], [[0, 1, 0, 0]] * 3)


# ---------------------------------------------------------------------------
# Fairness-guided router
# ---------------------------------------------------------------------------


def _router(route_by="label", specialization="attribute_routing", random_projections=True, **kw):
  router = FairRouter(
      8, 4, 2, GROUP_SIZES, route_by=route_by, specialization=specialization, rngs=nnx.Rngs(0), **kw
  )
  if random_projections:
    rng = np.random.default_rng(1)
    for p in router.projections:
      p.set_value(jnp.asarray(rng.normal(size=p.shape), jnp.float32))
  return router


@nnx.jit
def _route(router, x, attributes):
  return router(x, context={"attributes": attributes})


def _tokens(n=6, seed=2):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n, 8)), jnp.float32)


def test_label_routing_adds_the_projection_row_of_the_true_class():
  router = _router()
  x = _tokens(2)
  a = _route(router, x, jnp.array([[0, 1], [0, 1]]))
  b = _route(router, x, jnp.array([[1, 1], [0, 2]]))
  w0, w1 = (np.asarray(p[...]) for p in router.projections)
  np.testing.assert_allclose(b.logits[0] - a.logits[0], w0[1] - w0[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(b.logits[1] - a.logits[1], w1[2] - w1[1], rtol=1e-5, atol=1e-6)


def test_predicted_routing_ignores_the_attributes_and_needs_none_at_evaluation():
  x = _tokens(3)
  predicted = _router("predicted")
  a = _route(predicted, x, jnp.array([[0, 0], [1, 1], [0, 2]]))
  b = _route(predicted, x, jnp.full((3, 2), -1))
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6)
  evaluated = predicted(x, train=False)  # No context at all.
  np.testing.assert_allclose(evaluated.logits, a.logits, rtol=1e-6)
  assert evaluated.extra_losses() == {}
  by_label = _router("label")
  c = _route(by_label, x, jnp.full((3, 2), -1))  # Missing classes fall back to the prediction.
  np.testing.assert_allclose(c.logits, b.logits, rtol=1e-6)


def test_confusion_trains_phi_only_and_attribute_ce_trains_classifiers_only():
  router = _router()
  graphdef, params, rest = nnx.split(router, nnx.Param, ...)
  x = _tokens()
  context = {"attributes": jnp.array([[0, 1], [1, 2], [0, 0], [1, 1], [0, 2], [1, 0]])}

  def grads_of(loss_name):
    def loss(p):
      return nnx.merge(graphdef, p, rest)(x, train=True, context=context).losses[loss_name]

    return jax.jit(jax.grad(loss))(params)

  confusion = grads_of("confusion")
  ce = grads_of("attribute_ce")
  norm = lambda tree: float(sum(jnp.abs(v).sum() for v in jax.tree.leaves(tree)))
  assert norm(confusion["feature"]) > 0 and norm(confusion["attribute_heads"]) == 0
  assert norm(ce["attribute_heads"]) > 0 and norm(ce["feature"]) == 0
  assert norm(confusion["gate"]) == 0 and norm(ce["gate"]) == 0


def test_router_without_attributes_in_training_is_a_clear_error():
  with pytest.raises(ValueError, match="attributes"):
    _router()(_tokens(), train=True)
  with pytest.raises(ValueError, match="route_by=label"):
    _router("label")(_tokens(), train=False)


# ---------------------------------------------------------------------------
# What each reading of Eq. 8 is minimised by
# ---------------------------------------------------------------------------


def _minimise_specialization(router, x, attributes, steps=300, lr=0.1):
  """Adam on the specialization loss alone; returns the trained router."""
  import optax

  graphdef, params, rest = nnx.split(router, nnx.Param, ...)
  context = {"attributes": attributes}
  tx = optax.adam(lr)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt):
    loss, g = jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p, rest)(x, train=True, context=context).losses[
            "specialization"
        ]
    )(params)
    updates, opt = tx.update(g, opt)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for _ in range(steps):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  return nnx.merge(graphdef, params, rest), losses


def _groups(n, seed=3):
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.stack([rng.integers(0, g, n) for g in GROUP_SIZES], 1), jnp.int32)


def test_attribute_routing_sends_each_attributes_vote_to_its_experts_whatever_the_group():
  # Attribute 0 holds expert 0, attribute 1 expert 1 (the initial assignment).
  router = _router("predicted", "attribute_routing", random_projections=False)
  x, attributes = _tokens(64), _groups(64)
  router, losses = _minimise_specialization(router, x, attributes)
  assert losses[-1] < 0.2 * losses[0]
  out = router(x, train=True, context={"attributes": attributes})
  for a, (probs, projection) in enumerate(zip(out.attribute_probs, router.projections)):
    vote = jax.nn.softmax(probs @ projection[...], axis=-1)
    assert float(vote[:, a].min()) > 0.9  # Every token, of every group, votes for a's expert.
  # The routing does not follow the sensitive class: tokens of both groups of attribute 0 are
  # sent to the same top expert.
  top = np.asarray(out.expert_index[:, 0])
  groups = np.asarray(attributes[:, 0])
  assert set(top[groups == 0]) == set(top[groups == 1])


def _choice_share(router, x, attributes, expert):
  out = router(x, train=True, context={"attributes": attributes})
  return float(jnp.mean(jnp.any(out.expert_index == expert, axis=-1)))


def test_growing_an_attributes_experts_moves_routing_onto_them_under_attribute_routing():
  # Under attribute_routing, FEM's allocation reaches routing directly: Eq. 8 pushes each
  # attribute's vote onto the experts it holds. (Under expert_competence it cannot: see
  # tests/fairmoe_jax/test_methods.py, the allocation reaches routing only through what the experts learn.)
  router = _router("predicted", "attribute_routing", random_projections=False)
  x, attributes = _tokens(64), _groups(64)
  router, _ = _minimise_specialization(router, x, attributes, steps=200)
  before = _choice_share(router, x, attributes, expert=2)
  # Attribute 0 grows from expert 0 to experts {0, 2} (attribute_assignment's order).
  router.assignment.set_value(jnp.asarray(attribute_assignment(2, 4, counts=(2, 1))))
  router, _ = _minimise_specialization(router, x, attributes, steps=200)
  after = _choice_share(router, x, attributes, expert=2)
  assert before < 0.05 and after > 0.3, (before, after)


def test_class_routing_is_minimised_by_routing_on_the_sensitive_label():
  router = FairRouter(8, 4, 2, (2,), guided=False, specialization="class_routing", rngs=nnx.Rngs(0))
  router.assignment.set_value(jnp.asarray(attribute_assignment(1, 4, counts=(2,))))
  x = _tokens(64)
  # Classes that the tokens carry linearly (so a linear gate can follow them).
  attributes = jnp.asarray((np.asarray(x[:, :1]) > 0).astype(np.int32))
  router, _ = _minimise_specialization(router, x, attributes, steps=400)
  out = router(x, train=True, context={"attributes": attributes})
  top = np.asarray(out.expert_index[:, 0])
  # The attribute holds experts {0, 1}: class 0 -> expert 0, class 1 -> expert 1. The route is
  # the sensitive label.
  np.testing.assert_array_equal(top, np.where(np.asarray(attributes[:, 0]) == 0, 0, 1))


def test_competence_rewards_held_attributes_and_caps_the_avoided_ones_at_chance():
  from fairmoe_jax.moe.routers.fair import competence_loss

  labels = jnp.array([0, 1, 0, 1])
  attributes = jnp.array([[0, 0], [0, 1], [1, 2], [1, 0]])
  assignment = jnp.array([[1.0, 0.0], [0.0, 0.0]])  # Expert 0 holds attribute 0 only.
  alpha, groups = 0.6, (2, 3)
  loss = lambda logits: float(
      competence_loss(logits, labels, attributes, assignment, groups, alpha)
  )
  right = jax.nn.one_hot(labels, 2) * 50.0  # [B, K]
  chance = jnp.zeros((4, 2, 2))
  # An expert is rewarded for being right on an attribute it holds.
  assert loss(chance.at[:, 0].set(right)) < loss(chance) - 0.1
  # On attributes it does not hold it is pushed to chance and no further: confidently wrong
  # scores the same as chance, so the avoid term cannot run to minus infinity.
  np.testing.assert_allclose(loss(chance.at[:, 1].set(-right * 100)), loss(chance), rtol=1e-5)
  bound = -(1 - alpha) * 3 * np.log(2)  # Three (expert, attribute) pairs are avoided.
  rng = np.random.default_rng(0)
  for scale in (0.1, 10.0, 1e4):
    assert loss(jnp.asarray(rng.normal(size=(4, 2, 2)) * scale, jnp.float32)) >= bound - 1e-5


def test_routing_supervision_is_bounded_below_by_zero():
  from fairmoe_jax.moe.routers.fair import routing_supervision

  probs = jax.nn.softmax(jnp.asarray(np.random.default_rng(0).normal(size=(5, 2, 4)) * 30), -1)
  assigned = jnp.array([[1.0, 0, 0, 0], [0, 1.0, 1.0, 0]])
  assert float(routing_supervision(probs, assigned, 0.6)) >= 0.0
  perfect = jnp.broadcast_to(assigned / assigned.sum(-1, keepdims=True), (5, 2, 4))
  assert float(routing_supervision(perfect, assigned, 1.0)) < float(
      routing_supervision(probs, assigned, 1.0)
  )


# ---------------------------------------------------------------------------
# Dynamic expert allocation
# ---------------------------------------------------------------------------


def test_allocator_grows_after_patience_and_undoes_a_harmful_growth():
  allocator = ExpertAllocator(2, 4, patience=2, tolerance=0.0)
  state = initial_state(2)
  history = []
  for sf, loss in [((0.8, 0.5), 1.0), ((0.8, 0.4), 0.9), ((0.85, 0.6), 0.8), ((0.9, 0.7), 0.95)]:
    state, events = allocator.update(state, sf, loss)
    history.append((tuple(state["counts"]), events))
  # Review 1 sets the baseline; reviews 2-3 held or improved attribute 0 -> grow at review 3.
  assert history[2] == ((2, 1), [("grow", 0)])
  # Review 4: the loss got worse than at the growth (0.95 > 0.8): undone. Attribute 1 (three
  # classes) held or improved twice since its drop at review 2, so it grows.
  assert history[3] == ((1, 2), [("shrink", 0), ("grow", 1)])
  np.testing.assert_array_equal(allocator.assignment(state), attribute_assignment(2, 4, (1, 2)))


def test_a_multi_class_attribute_can_grow_to_every_expert():
  allocator = ExpertAllocator(1, 4, patience=1, tolerance=0.0)
  state = initial_state(1)
  for review in range(8):
    state, _ = allocator.update(state, (0.5,), 1.0 - 0.1 * review)
  assert int(state["counts"][0]) == 4  # Capped at E, whatever the number of classes.


def test_each_fem_change_is_reported_with_its_experts_share_before_and_after():
  from fairmoe_jax.fairness.experts import allocation_changes

  def review(step, counts, share):
    record = {"step": step, "fem/experts/sex": counts[0], "fem/experts/age": counts[1]}
    record.update({f"fem/share/{e}": v for e, v in enumerate(share)})
    return record

  records = [
      {"step": 5, "loss": 1.0},  # Not a review.
      review(10, (1, 1), (0.5, 0.5, 0.0, 0.0)),
      review(20, (2, 1), (0.5, 0.5, 0.0, 0.0)),  # sex grows onto expert 2 (a + j m = 0 + 2).
      review(30, (2, 1), (0.4, 0.4, 0.2, 0.0)),  # ... and expert 2 is used afterwards.
      review(40, (1, 2), (0.4, 0.4, 0.2, 0.0)),  # sex shrinks, age grows onto expert 3 ...
  ]
  changes = allocation_changes(records, ("sex", "age"), 4, final_share=(0.4, 0.4, 0.2, 0.0))
  assert [(c["step"], c["attribute"], c["change"], c["experts"]) for c in changes] == [
      (20, "sex", "grow", [2]),
      (40, "sex", "shrink", [2]),
      (40, "age", "grow", [3]),
  ]
  assert changes[0]["share_before"] == 0.0 and changes[0]["share_after"] == pytest.approx(0.2)
  assert changes[0]["usage_changed"]
  assert not changes[2]["usage_changed"]  # ... which the last validation pass never uses.
  no_final = allocation_changes(records, ("sex", "age"), 4)
  assert no_final[2]["share_after"] is None and "usage_changed" not in no_final[2]


def test_tolerance_counts_a_small_drop_as_stable():
  allocator = ExpertAllocator(1, 4, patience=1, tolerance=0.02)
  state = initial_state(1)
  state, _ = allocator.update(state, (0.50,), 1.0)
  state, events = allocator.update(state, (0.49,), 0.9)
  assert events == [("grow", 0)]


# ---------------------------------------------------------------------------
# MultiFair mixup partners
# ---------------------------------------------------------------------------


def test_mixup_partners_come_from_another_group():
  groups = jnp.array([0, 0, 0, 1, 1, -1, 0, 1])
  for seed in range(5):
    partners = np.asarray(cross_group_partners(jax.random.key(seed), groups))
    g = np.asarray(groups)
    for i, p in enumerate(partners):
      assert p != i
      if g[i] >= 0 and g[p] >= 0:
        assert g[i] != g[p]
  single = np.asarray(cross_group_partners(jax.random.key(0), jnp.zeros(4, jnp.int32)))
  assert all(p != i for i, p in enumerate(single))  # No other group: any other example.
