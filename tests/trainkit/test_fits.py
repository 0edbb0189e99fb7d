"""Whether a compiled step fits a device's memory (`trainkit.fits`)."""

import jax
import jax.numpy as jnp
import pytest

from trainkit.errors import UserError


def test_a_step_that_cannot_fit_is_refused_before_it_runs_naming_the_key(tmp_path, monkeypatch):
  from trainkit import fits

  big = jnp.ones((2048,))
  batch_heavy = jax.jit(lambda x: jnp.outer(x, x)).lower(big).compile()  # A 16 MiB output
  weight_heavy = jax.jit(lambda w: w[:4] * 2).lower(jnp.ones((1 << 22,))).compile()  # 16 MiB arg
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 1 << 20)  # A 1 MiB device.
  with pytest.raises(
      UserError,
      match=r"the train step needs .* but a device here has 0\.0 GiB: "
      r"lower batch_size \(now 2048\); --mode=compile",
  ):
    fits.require_fits(batch_heavy, what="train step", batch_key="batch_size", batch_size=2048)
  with pytest.raises(
      UserError, match=r"make the model smaller \(its model\.\* keys, moe\.num_experts\)"
  ):
    fits.require_fits(weight_heavy, what="train step", batch_key="batch_size", batch_size=8)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: 1 << 30)
  fits.require_fits(batch_heavy, what="train step", batch_key="batch_size", batch_size=2048)


def test_the_fit_counts_the_batches_device_prefetch_keeps_beside_the_step(monkeypatch):
  # The step's own batch is an argument of its program; DevicePrefetch places
  # DEFAULT_PREFETCH more on the device ahead of it (trainkit.prefetch.resident_batches, which
  # the preflight counts too).
  from trainkit import fits
  from trainkit.prefetch import DEFAULT_PREFETCH, resident_batches
  from trainkit.preflight.analysis import memory

  batch = jnp.ones((1 << 18,))  # 1 MiB
  compiled = jax.jit(jnp.sum).lower(batch).compile()
  peak = memory(compiled)["peak"]
  ahead = resident_batches() - 1
  assert ahead == DEFAULT_PREFETCH and batch.nbytes * ahead > 0
  kwargs = {"what": "train step", "batch_key": "batch_size", "batch_size": 8, "batch": batch}
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: peak + ahead * batch.nbytes)
  fits.require_fits(compiled, **kwargs)
  monkeypatch.setattr(fits, "device_memory_bytes", lambda device: peak + ahead * batch.nbytes - 1)
  with pytest.raises(
      UserError, match=rf"the train step needs .*; 0\.0 GiB of the {ahead} batches prefetched ahead"
  ):
    fits.require_fits(compiled, **kwargs)
  # A step whose batches are not prefetched (an evaluation's) counts its own only.
  fits.require_fits(compiled, **kwargs, prefetch=0)
  fits.require_fits(compiled, **{**kwargs, "batch": None})  # Without the batch: the program's.


def test_a_cpu_device_s_memory_is_its_share_of_the_host_s():
  from trainkit import fits
  from trainkit.config import host_memory_bytes

  # The 8 fake CPU devices share one host: together they may not claim more than it has.
  cpu = jax.local_devices(backend="cpu")
  assert len(cpu) == 8
  share = fits.device_memory_bytes(cpu[0])
  assert 0 < share and share * len(cpu) <= host_memory_bytes() < (share + 1) * len(cpu)
