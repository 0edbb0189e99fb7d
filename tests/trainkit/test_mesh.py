"""The device mesh (`trainkit.mesh`): its shape from the config, and batches sharded over it."""

import jax
import numpy as np
import pytest

from trainkit.errors import ConfigError
from trainkit.mesh import batch_sharding, make_mesh, mesh_shape, shard_batch


def test_eight_fake_devices_are_visible():
  assert jax.device_count() == 8


@pytest.mark.parametrize("data,expert", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_mesh_shapes_on_eight_devices(data, expert):
  mesh = make_mesh({"data": data, "expert": expert})
  assert dict(mesh.shape) == {"data": data, "expert": expert}
  batch = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3)}
  x = shard_batch(batch, mesh)["x"]
  assert x.sharding == batch_sharding(mesh)
  # Each device holds a distinct 1/8 of the batch rows.
  rows = sorted(int(s.data[0, 0]) // 3 for s in x.addressable_shards)
  assert rows == list(range(0, 16, 2))
  np.testing.assert_array_equal(np.asarray(x), batch["x"])


def test_mesh_minus_one_fills_remaining_devices():
  assert mesh_shape({"data": -1, "expert": 2}, 8) == (4, 2)
  assert mesh_shape({"data": 2, "expert": -1}, 8) == (2, 4)
  assert mesh_shape({"data": 2, "expert": 2}, 8) == (2, 2)  # A smaller mesh uses the first devices.


@pytest.mark.parametrize(
    "mesh_config,key",
    [
        ({"data": 4, "expert": 4}, "mesh"),
        # The key set to a number that does not divide 8, not mesh.data's default -1.
        ({"data": -1, "expert": 3}, "mesh.expert"),
        ({"data": -1, "expert": -1}, "mesh"),
        ({"data": 0, "expert": 1}, "mesh.data"),
        ({"data": 1, "expert": "2"}, "mesh.expert"),
        ({"data": -1, "expert": 16}, "mesh.expert"),  # The key set too large, not the -1.
        ({"data": 9, "expert": 1}, "mesh.data"),
    ],
)
def test_impossible_meshes_name_the_key(mesh_config, key):
  with pytest.raises(ConfigError) as e:
    mesh_shape(mesh_config, 8)
  assert e.value.key == key
  assert key in str(e.value)
