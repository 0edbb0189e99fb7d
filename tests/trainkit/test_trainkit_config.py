"""Config arguments and keys read by the training kit (`trainkit.config`)."""

import ml_collections
import pytest

from trainkit import config as cfg
from trainkit.errors import ConfigError


def test_parse_arg_converts_to_default_types():
  arg = cfg.parse_arg(
      "steps=10,lr=0.5,name=x,flag,blocks=(1, 2)",
      steps=1,
      lr=1.0,
      name="a",
      flag=False,
      blocks=(0,),
  )
  assert (arg.steps, arg.lr, arg.name, arg.flag, arg.blocks) == (10, 0.5, "x", True, (1, 2))
  assert cfg.parse_arg(None, steps=3).steps == 3


@pytest.mark.parametrize(
    "arg,key", [("nope=1", "nope"), ("steps=ten", "steps"), ("flag=maybe", "flag")]
)
def test_parse_arg_errors_name_the_key(arg, key):
  with pytest.raises(ConfigError, match=f"'{key}'"):
    cfg.parse_arg(arg, steps=1, flag=False)


def test_profile_steps_config_is_parsed_and_checked():
  config = ml_collections.ConfigDict(dict(profile_steps=""))
  assert cfg.parse_profile_steps(config) is None
  config.profile_steps = "3:5"
  assert cfg.parse_profile_steps(config) == (3, 5)
  for bad in ("5", "5:3", "a:b", "-1:2", "2:2"):
    config.profile_steps = bad
    with pytest.raises(ConfigError, match="profile_steps"):
      cfg.parse_profile_steps(config)
