"""The preflight's compilation (`trainkit.preflight.compile`): the persistent cache while off."""

import jax
import jax.numpy as jnp


def test_the_persistent_cache_is_neither_read_nor_written_while_off(private_compilation_cache):
  from trainkit.preflight.compile import persistent_cache_off

  def entries():
    return sorted(path.name for path in private_compilation_cache.iterdir())

  events = []

  def listen(event, **kwargs):
    if event.startswith("/jax/compilation_cache/"):
      events.append(event)

  before = entries()
  assert before  # The fixture's compile was written: the cache is in use in this process.
  jax.monitoring.register_event_listener(listen)
  try:
    with persistent_cache_off():
      jax.jit(lambda x: 3 * x - 2).lower(jnp.ones(4)).compile()
      jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()  # The fixture's program.
    assert entries() == before
    assert "/jax/compilation_cache/cache_hits" not in events
    # On again after the block: the fixture's program is read back, a new one written.
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
    assert "/jax/compilation_cache/cache_hits" in events
    jax.jit(lambda x: 5 * x - 7).lower(jnp.ones(5)).compile()
    assert len(entries()) > len(before)
  finally:
    jax.monitoring.unregister_event_listener(listen)
