"""run_info.json: each package's metadata writes itself and reads itself back
(`trainkit.run_info.RunMetadataFile`); another package's file, a malformed field or another
preprocessing is a UserError naming the file."""

import json

import pytest

from causal_attn_jax import run_info as causal_run_info
from fairmoe_jax import run_info as fair_run_info
from trainkit.errors import UserError
from trainkit.workdir import save_run_info

FAIR = fair_run_info.RunMetadata(
    dataset="synthetic",
    class_names=("cat", "dog"),
    attribute_names=("sex", "age"),
    group_names=(("f", "m"), ("young", "old")),
    preprocessing=fair_run_info.Preprocessing(image_size=32),
)
CAUSAL = causal_run_info.RunMetadata(task="classification", label_names=("yes", "no"))


@pytest.mark.parametrize("module, metadata", [(fair_run_info, FAIR), (causal_run_info, CAUSAL)])
def test_metadata_round_trips_through_run_info_json(tmp_path, module, metadata):
  # Missing (deleted, or a run trained before the file was written): one line naming it.
  with pytest.raises(UserError, match=f"{tmp_path / 'run_info.json'} does not exist: training"):
    module.RunMetadata.load(str(tmp_path))
  save_run_info(metadata.to_json(), str(tmp_path))  # As training writes it.
  saved = json.loads((tmp_path / "run_info.json").read_text())
  assert list(saved)[0] == "package" and saved["package"] == module.PACKAGE
  loaded = module.RunMetadata.load(str(tmp_path))
  assert loaded == metadata and type(loaded) is module.RunMetadata


def test_another_package_s_run_info_is_refused(tmp_path):
  save_run_info(CAUSAL.to_json(), str(tmp_path))
  with pytest.raises(UserError, match="run_info.json is a causal_attn_jax run's, not a fairmoe"):
    fair_run_info.RunMetadata.load(str(tmp_path))


@pytest.mark.parametrize(
    "module, metadata, field, value, error",
    [
        (fair_run_info, FAIR, "class_names", None, "KeyError"),
        (causal_run_info, CAUSAL, "label_names", 3, "TypeError"),
    ],
)
def test_a_malformed_field_names_the_file(tmp_path, module, metadata, field, value, error):
  saved = metadata.to_json()
  if value is None:
    del saved[field]
  else:
    saved[field] = value
  (tmp_path / "run_info.json").write_text(json.dumps(saved))
  message = f"run_info.json: not a {module.PACKAGE} run's metadata \\({error}"
  with pytest.raises(UserError, match=message):
    module.RunMetadata.load(str(tmp_path))


def test_another_preprocessing_is_refused(tmp_path):
  saved = FAIR.to_json()
  saved["preprocessing"]["mean"] = [0.485, 0.456, 0.406]
  (tmp_path / "run_info.json").write_text(json.dumps(saved))
  with pytest.raises(UserError, match="run_info.json: the run's preprocessing .* not this version"):
    fair_run_info.RunMetadata.load(str(tmp_path))
