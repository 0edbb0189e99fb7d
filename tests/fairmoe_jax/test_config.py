"""Config files load and validate; impossible values are rejected naming the key."""

import importlib
import importlib.util

import pytest

from conftest import REPO_ROOT
from fairmoe_jax import config as fairmoe_config
from trainkit.errors import ConfigError

# The fairmoe configs; the causal_attn_jax ones (their docstrings run causal_attn_jax.main) are
# checked by tests/e2e/test_causal_cli.py with that package's validator.
CONFIG_FILES = sorted(
    p
    for p in (REPO_ROOT / "configs").glob("*.py")
    if "python -m causal_attn_jax.main" not in p.read_text()
)
ALL_CONFIG_FILES = sorted((REPO_ROOT / "configs").glob("*.py"))


def _load(path, arg=None):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_files_load_and_validate(path):
  config = _load(path)
  for key in (
      "num_train_steps",
      "checkpoint_every_steps",
      "eval_every_steps",
      "seed",
      "batch_size",
  ):
    assert key in config
  if config.data.name in ("celeba", "isic2019"):
    config.data.root = "/data/layout"  # The only key a user must add for the real datasets.
  fairmoe_config.validate(config, num_devices=8)
  assert path.read_text().count("python -m fairmoe_jax.main") >= 1, "docstring gives the command"


def test_quickstart_arguments_reach_the_config():
  config = _load(REPO_ROOT / "configs/quickstart.py", "steps=7,experts=8,top_k=1")
  assert (config.num_train_steps, config.moe.num_experts, config.moe.top_k) == (7, 8, 1)


@pytest.mark.parametrize(
    "mutate,key",
    [
        (
            lambda c: c.mesh.update(data=2, expert=4) or c.moe.update(num_experts=6, top_k=2),
            "moe.num_experts",
        ),
        (lambda c: c.update(batch_size=100), "batch_size"),
        (lambda c: c.update(eval_batch_size=12), "eval_batch_size"),
        (lambda c: c.mesh.update(data=16), "mesh.data"),
        (lambda c: c.moe.update(blocks=(4,)), "moe.blocks"),
        (lambda c: c.moe.update(top_k=5), "moe.top_k"),
        (lambda c: c.moe.update(dispatch="scatter"), "moe.dispatch"),
        (
            lambda c: c.mesh.update(data=4, expert=2) or c.moe.update(dispatch="dropless"),
            "moe.dispatch",
        ),
        (lambda c: c.update(compute_dtype="float16"), "compute_dtype"),
        (lambda c: c.model.update(num_heads=3), "model.num_heads"),
        (lambda c: c.update(num_train_steps=0), "num_train_steps"),
        (lambda c: c.data.update(name="imagenet"), "data.name"),
        (lambda c: c.data.update(train_size=100), "data.train_size"),
        (lambda c: c.data.update(num_workers=-1), "data.num_workers"),
        (lambda c: c.data.update(train_resampling="bicubic"), "data.train_resampling"),
        (lambda c: c.optimizer.update(final_lr_fraction=2.0), "optimizer.final_lr_fraction"),
        (lambda c: c.fair.update(psi="eodds"), "fair.psi"),
        (lambda c: c.fair.update(lambda_dp=-0.1), "fair.lambda_dp"),
        (lambda c: c.moe.update(capacity_multiple_of=0), "moe.capacity_multiple_of"),
        (lambda c: c.moe.update(group_size=0), "moe.group_size"),
        # 128 / 8 devices = 16 examples per device, not a multiple of 3.
        (lambda c: c.moe.update(group_size=3), "moe.group_size"),
        # The training batch divides (16 per device), the evaluation batch (8) does not.
        (
            lambda c: c.update(batch_size=128, eval_batch_size=64) or c.moe.update(group_size=16),
            "moe.group_size",
        ),
        (
            lambda c: c.update(method="smoe") or c.moe.update(router="expert_choice", group_size=2),
            "moe.group_size",
        ),
    ],
)
def test_impossible_values_name_the_key(mutate, key):
  config = fairmoe_config.base_config()
  mutate(config)
  with pytest.raises(ConfigError) as e:
    fairmoe_config.validate(config, num_devices=8)
  assert e.value.key == key
  assert key in str(e.value) and "\n" not in str(e.value)


def test_batch_must_split_over_processes():
  config = fairmoe_config.base_config()
  config.update(batch_size=8 * 3, eval_batch_size=8 * 3)
  with pytest.raises(ConfigError, match="process"):
    fairmoe_config.validate(config, num_devices=8, num_processes=16)


def test_base_config_is_valid_on_eight_devices():
  fairmoe_config.validate(fairmoe_config.base_config(), num_devices=8)


@pytest.mark.parametrize("path", ALL_CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_file_documents_its_command(path):
  text = path.read_text()
  assert "python -m fairmoe_jax.main" in text or "python -m causal_attn_jax.main" in text


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "package, config_file, key",
    [
        ("fairmoe_jax", "quickstart.py", "moe.capacity_factor"),
        ("fairmoe_jax", "quickstart.py", "moe.eval_capacity_factor"),
        ("fairmoe_jax", "quickstart.py", "fair.alpha"),
        ("fairmoe_jax", "quickstart.py", "optimizer.learning_rate"),
        ("causal_attn_jax", "spurious_pairs.py", "data.spurious.distractor_prob"),
        ("causal_attn_jax", "spurious_pairs.py", "data.spurious.cue_agreement"),
        ("causal_attn_jax", "mnli_hans.py", "data.eval_fraction"),
        ("causal_attn_jax", "mnli_hans.py", "num_epochs"),
    ],
)
def test_a_non_finite_number_is_rejected_naming_the_key(package, config_file, key, value):
  # NaN passes every range check (each comparison with it is false); no key gives inf a meaning.
  validate = importlib.import_module(f"{package}.config").validate
  config = _load(REPO_ROOT / "configs" / config_file)
  node = config
  *parents, name = key.split(".")
  for part in parents:
    node = node[part]
  assert isinstance(node[name], (int, float)), key
  node[name] = value
  with pytest.raises(ConfigError) as e:
    validate(config, num_devices=8, check_data=False)
  assert e.value.key == key and "finite" in str(e.value)


@pytest.mark.parametrize(
    "package, config_file, key",
    [
        ("fairmoe_jax", "quickstart.py", "data.train_size"),
        ("fairmoe_jax", "quickstart.py", "data.test_size"),
        ("causal_attn_jax", "spurious_pairs.py", "data.spurious.num_train"),
        ("causal_attn_jax", "ood_pairs.py", "data.ood_pairs.num_challenge"),
    ],
)
def test_generated_data_larger_than_the_host_s_memory_is_refused_naming_the_key(
    package, config_file, key
):
  # It used to be generated for minutes with growing memory and no output.
  validate = importlib.import_module(f"{package}.config").validate
  config = _load(REPO_ROOT / "configs" / config_file)
  validate(config, num_devices=8, check_data=False)  # The file's own sizes fit.
  *parents, name = key.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[name] = 1_000_000_000
  with pytest.raises(ConfigError, match="more than half of this host's") as e:
    validate(config, num_devices=8, check_data=False)
  assert e.value.key == key


def test_a_run_of_one_process_may_leave_devices_idle_with_a_warning(caplog):
  # On purpose, e.g. a one-device reference run on a host of 8 (tests/fairmoe_jax/test_sharded_training.py):
  # it runs, and says what it leaves idle and which key fills the devices.
  from trainkit.mesh import make_mesh  # pylint: disable=import-outside-toplevel

  with caplog.at_level("WARNING"):
    mesh = make_mesh({"data": 2, "expert": 1})
  assert mesh.devices.size == 2
  assert "mesh.data=2 x mesh.expert=1 uses 2 of the 8 devices of this run, leaving 6 idle" in (
      caplog.text
  )
  assert "set mesh.data=-1" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    make_mesh({"data": -1, "expert": 2})
  assert not caplog.text


def test_a_run_of_several_processes_must_use_all_their_devices(monkeypatch):
  # Each process feeds its devices its block of the batch: a mesh over some of them would leave
  # a process without devices to feed, or hold rows another process reads.
  from trainkit import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mesh_lib.jax, "process_count", lambda: 2)
  pattern = r"uses 4 of the 8 devices of this run \(2 processes\), leaving 4 idle"
  with pytest.raises(ConfigError, match=pattern) as e:
    mesh_lib.make_mesh({"data": 4, "expert": 1})
  assert e.value.key == "mesh.data"
  assert mesh_lib.make_mesh({"data": -1, "expert": 4}).devices.size == 8


@pytest.mark.parametrize(
    "mesh, key",
    [({"data": 2, "expert": 1}, "mesh.data"), ({"data": 1, "expert": 3}, "mesh.expert")],
)
def test_the_idle_devices_error_names_the_key_that_fills_them(mesh, key):
  from trainkit.mesh import require_all_devices  # pylint: disable=import-outside-toplevel

  with pytest.raises(ConfigError) as e:
    require_all_devices(mesh, 8, "the 8 devices of h100x8")
  assert e.value.key == key
  assert require_all_devices({"data": -1, "expert": 2}, 8, "the 8 devices of h100x8") == (4, 2)
