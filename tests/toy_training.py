"""A toy training loop for the training kit's tests: a one-parameter state, constant batches
with a hook before chosen ones, and `trainkit.loop.train_loop` run over them."""

import jax
import jax.numpy as jnp
import numpy as np

from trainkit.loop import train_loop
from trainkit.mesh import make_mesh
from trainkit.metric_writers import MetricWriter
from trainkit.train_state import TrainState


def toy_train_state(w: float = 0.0) -> TrainState:
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params={"w": jnp.full((), w)},
      model_state={},
      opt_state=(),
      rng=jax.random.PRNGKey(0),
  )


class WaitingIterator:
  """Constant batches; before producing batch `at`, runs `before(position)` (e.g. waits for a
  save to finish, then crashes as a SIGKILL would: nothing after it runs)."""

  def __init__(self, at: set[int], before):
    self.position, self.at, self.before = 0, at, before

  def __next__(self):
    self.position += 1
    if self.position in self.at:
      self.before(self.position)
    return {"x": np.ones((8, 1), np.float32)}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def toy_loop(tmp_path, checkpointer, iterator, *, steps=40, writer=None, device_prefetch=2):
  def train_step(state, batch):
    params = {"w": state.params["w"] + jnp.sum(batch["x"])}
    return state.replace(step=state.step + 1, params=params), {"loss": jnp.asarray(1.0)}

  return train_loop(
      state=toy_train_state(0.0),
      train_step=jax.jit(train_step),
      train_iterator=iterator,
      mesh=make_mesh({"data": 8, "expert": 1}),
      checkpointer=checkpointer,
      writer=writer or MetricWriter(str(tmp_path), tensorboard=False),
      num_train_steps=steps,
      log_every_steps=5,
      eval_every_steps=0,
      checkpoint_every_steps=10,
      examples_per_step=8,
      show_progress=False,
      device_prefetch=device_prefetch,
  )
