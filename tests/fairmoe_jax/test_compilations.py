"""What a run compiles: one program per jitted function and shape, never op by op.

An eager JAX operation compiles a program of its own for every new shape, so a tree of
parameters or counts handled leaf by leaf costs dozens of compilations (the quickstart's
starting parameter norm alone made some 150). These tests count the programs JAX lowers.
"""

from __future__ import annotations

import contextlib
import logging
import types

import jax
import numpy as np
import pytest
from test_methods import _config, _setup

from fairmoe_jax import evaluation, methods, train
from trainkit import loop


@contextlib.contextmanager
def lowered_programs():
  """Lists the programs JAX lowers inside the block ("jit(eval_step)", "jit(add)", ...): every
  in-memory cache miss, whether or not the persistent compilation cache then has the binary."""
  names: list[str] = []

  class Handler(logging.Handler):

    def emit(self, record):
      message = record.getMessage()
      if message.startswith("Compiling "):
        names.append(message.split(" ")[1])

  logger = logging.getLogger("jax._src.interpreters.pxla")
  handler = Handler(logging.WARNING)
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logger.removeHandler(handler)


def test_the_starting_parameter_norm_is_one_program():
  # Shapes no other test uses, so that nothing is cached already.
  shapes = [(7, 11), (13,), (3, 17), (19, 5), (23,), (2, 29)]
  rng = np.random.default_rng(0)
  params = {
      f"w{i}": jax.device_put(rng.normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)
  }
  with lowered_programs() as names:
    norm = loop._starting_param_norm(types.SimpleNamespace(params=params))
  assert len(names) <= 1, names
  expected = np.sqrt(sum(float(np.sum(np.asarray(p, np.float64) ** 2)) for p in params.values()))
  np.testing.assert_allclose(norm["param_norm"], expected, rtol=1e-5)


@pytest.mark.slow
def test_validation_compiles_once_across_fem_reviews():
  # A FEM review validates between training steps; the quickstart reviews six times. Its
  # validation split ends on a padded batch, which must not compile a program of its own.
  config = _config("fairsmoe")
  config.data.val_size = 40  # Batches of 16: the third is padded.
  mesh, info, graphdef, state, step, batch = _setup(config)
  _, splits = train.load_data(config)
  eval_step = evaluation.make_eval_step(graphdef, info, config)
  reports = []

  def validate(state):
    report, _ = evaluation.evaluate(eval_step, state, splits["val"], info, config, mesh)
    reports.append(report)
    return report

  _, review = methods.METHODS["fairsmoe"].review(
      config, info, graphdef=graphdef, mesh=mesh, validate=validate
  )
  state, _ = step(state, batch)
  with lowered_programs() as first:
    state, _, _ = review(state)
  # The eval step, and its counts summed in one program (not one `add` per count's shape).
  assert set(first) - {"jit(stage)"} <= {"jit(eval_step)", "jit(_add_counts)"}, first
  assert "jit(eval_step)" in first
  for _ in range(2):
    state, _ = step(state, batch)
    with lowered_programs() as later:
      state, _, _ = review(state)
    assert later == []
  assert eval_step._cache_size() == 1 and step._cache_size() == 1
  assert [r["num_examples"] for r in reports] == [40, 40, 40]
