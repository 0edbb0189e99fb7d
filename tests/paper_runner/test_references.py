"""Reference readers (what a results table is read against): each scores what its rule says it
scores on data whose answer is known by construction, and a table prints them as rows."""

import numpy as np
import pytest

from causal_attn_jax import config as causal_config
from conftest import REPO_ROOT
from fairmoe_jax.config import base_config
from fairmoe_jax.data import load_synthetic, synthetic
from paper_runner.causal import references as causal_references
from paper_runner.fairmoe import references as fair_references


def _fair_config(**sizes):
  config = base_config()
  config.data.train_size, config.data.val_size, config.data.test_size = 600, 300, 400
  return config.to_dict()


def test_the_majority_reader_scores_the_test_share_of_the_training_majority():
  config = _fair_config()
  reports = fair_references.reference_reports(config)
  _, splits = load_synthetic(
      image_size=config["data"]["image_size"],
      num_classes=4,
      seed=0,
      sizes={"train": 600, "val": 300, "test": 400},
  )
  majority = np.bincount(splits["train"]["label"], minlength=4).argmax()
  (name,) = [n for n in reports if n.startswith("majority class")]
  assert name.endswith(f"({synthetic.class_names(4)[majority]})")
  assert reports[name]["accuracy"] == pytest.approx(np.mean(splits["test"]["label"] == majority))
  assert reports[name]["validation"]["accuracy"] == pytest.approx(
      np.mean(splits["val"]["label"] == majority)
  )
  # A constant answer predicts the positive rate 0 or 1 in every group: no parity gap.
  assert reports[name]["mf"]["dp"] == pytest.approx(0.0)
  # Chance: seeded draws, 1 / 4 in expectation, each with every fairness number.
  draws = reports["chance (4 classes, a uniform guess)"]["draws"]
  assert len(draws) == fair_references.CHANCE_DRAWS
  assert np.mean([d["accuracy"] for d in draws]) == pytest.approx(0.25, abs=0.005)
  assert np.mean([d["validation"]["accuracy"] for d in draws]) == pytest.approx(0.25, abs=0.005)
  for report in (draws[0], draws[0]["validation"]):
    assert set(report["mf"]) == {"pqd", "dp", "eopp", "eodds"}
    assert all(0.0 <= value <= 1.0 for value in report["mf"].values())


def test_chance_is_counted_by_the_evaluation_s_own_code_and_seeded_by_its_split():
  """One draw of the chance reader, counted at once for many draws, is the report the
  evaluation's own counting (`report_of_predictions`, jnp) gives the same predictions; the draws
  depend on the split alone."""
  from fairmoe_jax.data.types import DatasetInfo
  from fairmoe_jax.metrics import report_of_predictions

  rng = np.random.default_rng(7)
  n, k = 300, 3
  split = {
      "label": rng.integers(0, k, n),
      # A missing attribute (-1) is skipped, as the evaluation skips it.
      "attributes": np.stack([rng.integers(0, 2, n), rng.integers(-1, 4, n)], axis=1),
  }
  info = DatasetInfo(
      name="toy",
      num_classes=k,
      class_names=("a", "b", "c"),
      attribute_names=("sex", "site"),
      group_names=(("f", "m"), ("s0", "s1", "s2", "s3")),
      image_size=8,
  )
  draws = fair_references.chance_draws(split, info, draws=5)
  again = fair_references.chance_draws(split, info, draws=5)
  assert draws == again  # Seeded: the same split gives the same draws.
  labels = np.asarray(split["label"], np.int64)
  attributes = np.asarray(split["attributes"], np.int64)
  seed = fair_references.zlib.crc32(labels.tobytes() + attributes.tobytes())
  predictions = np.random.default_rng([fair_references.CHANCE_SEED, seed]).integers(0, k, (5, n))
  for d in range(5):
    expected = report_of_predictions(
        split["label"],
        predictions[d].astype(np.int32),
        split["attributes"],
        info.attribute_names,
        info.group_names,
        k,
    )
    assert draws[d] == expected  # Counts are integers: the same numbers exactly.
  other = {**split, "label": (split["label"] + 1) % k}
  assert fair_references.chance_draws(other, info, draws=5) != draws


def test_the_marker_reader_reads_the_class_a_painted_marker_shows():
  _, splits = load_synthetic(image_size=32, num_classes=4, seed=1, sizes={"test": 64})
  images = splits["test"]["image"].copy()
  painted = np.arange(64) % 4
  palette = synthetic.marker_palette(4).astype(np.uint8)
  side = synthetic.MARKER_PX
  for i, c in enumerate(painted):
    # The reader reads the interior (rows and columns 2 .. side - 1) of the square the
    # generator draws at 1 .. side, which the blur leaves alone: paint it class c's colour and
    # everything around it, the square's own edge included, the next class's, so a reader that
    # strays onto the edge misreads it.
    images[i, : side + 2, : side + 2] = palette[(c + 1) % 4]
    images[i, 2:side, 2:side] = palette[c]
  np.testing.assert_array_equal(synthetic.read_marker(images, 4), painted)
  # On the generated images it agrees with the label about as often as the generator's
  # reliabilities make it (docs/dataset.md: 0.634 on seed 0's test split), far above chance.
  reports = fair_references.reference_reports(_fair_config())
  assert 0.55 < reports["corner-marker reader"]["accuracy"] < 0.72


def test_the_untrained_control_is_one_step_at_learning_rate_0_whatever_the_epochs(
    monkeypatch, tmp_path
):
  from fairmoe_jax import train  # pylint: disable=g-import-not-at-top

  trained, train_and_evaluate = [], train.train_and_evaluate

  def spy(config, workdir):
    report = train_and_evaluate(config, workdir)
    trained.append((report["step"], config.optimizer.learning_rate))
    return report

  monkeypatch.setattr(train, "train_and_evaluate", spy)
  monkeypatch.setattr(fair_references, "UNTRAINED_SEEDS", (0,))
  config = base_config()
  # The CelebA sample by the relative root a sweep's runs read from the repository root.
  config.data.update(name="celeba", root="../shared/data/celeba", target="Attractive")
  config.data.update(sensitive="Male", num_classes=2, image_size=32, max_examples_per_split=48)
  config.model.update(dim=16, depth=2, num_heads=2, mlp_dim=16, patch_size=8)
  config.update(num_epochs=2, batch_size=16, eval_batch_size=32, analysis_batches=1)
  monkeypatch.chdir(tmp_path)  # Not where the runs started: the controls read base_dir's data.
  reports = fair_references.with_controls(config.to_dict(), str(REPO_ROOT))
  assert trained == [(1, 0.0)]  # Not the config's 2 epochs (6 steps).
  (untrained,) = [r for name, r in reports.items() if name.startswith("vanilla SMoE untrained")]
  assert untrained["role"] == "control" and untrained["draws"][0]["experts_active"]


def _pairs_config(generator):
  config = causal_config.base_config()
  config.data.generator = generator
  section = config.data["spurious" if generator == "spurious_pairs" else generator]
  section.num_train, section.num_eval, section.num_challenge = 400, 400, 200
  return config


def test_the_overlap_cue_reader_scores_the_cue_agreement_and_zero_on_the_challenge():
  config = _pairs_config("spurious_pairs")
  config.data.spurious.cue_agreement = 0.75
  reports = causal_references.reference_reports(config.to_dict())
  cue = reports["cue reader (full overlap = entailment)"]
  # In distribution the cue agrees with the label on a cue_agreement share of the pairs (drawn
  # per pair); the challenge split holds only pairs whose cue disagrees.
  assert abs(cue["accuracy"] - 0.75) < 0.06
  assert cue["challenge"]["accuracy"] == 0.0
  majority = reports["majority class of the training split (entailment)"]
  assert majority["challenge"]["accuracy"] == pytest.approx(0.5)  # Balanced labels.
  by_label = majority["challenge"]["by_heuristic"]["lexical_overlap"]
  assert by_label == {"entailment": 1.0, "non-entailment": 0.0}


def test_the_filler_cue_reader_is_perfect_in_distribution_and_wrong_out_of_it():
  reports = causal_references.reference_reports(_pairs_config("ood_pairs").to_dict())
  cue = reports["cue reader (the filler majority's label)"]
  assert cue["accuracy"] == 1.0 and cue["challenge"]["accuracy"] == 0.0
  assert reports["chance (2 classes, a uniform guess)"]["challenge"]["accuracy"] == 0.5


def test_uniform_attention_has_a_key_per_token_and_is_within_the_band_up_to_three_keys():
  # Uniform over k keys puts k * expm1(1 / k) in each row and column: in the encoder's band
  # [3 expm1(1/3), expm1(1/3) + expm1(2/3)] for k = 2, 3, below it beyond (k = 5 gives 1.107).
  ids = np.zeros((2, 7), np.int32)
  ids[0, :3], ids[1, :5] = 7, 9  # 3 and 5 real tokens, the rest padding (PAD_ID 0).
  measures = causal_references.uniform_attention(causal_config.base_config(), ids)
  assert measures["constraints"]["nodes_within"] == pytest.approx(3 / 8)  # 3 of 8 nodes.
  assert measures["attention"]["effective_keys"] == pytest.approx((3 * 3 + 5 * 5) / 8)


def test_the_causal_controls_are_one_step_at_learning_rate_0_and_near_uniform(
    monkeypatch, tmp_path
):
  from causal_attn_jax import train  # pylint: disable=g-import-not-at-top

  trained, train_and_evaluate = [], train.train_and_evaluate

  def spy(config, workdir):
    report = train_and_evaluate(config, workdir)
    trained.append((report["step"], config.optimizer.learning_rate, config.model.attention))
    return report

  monkeypatch.setattr(train, "train_and_evaluate", spy)
  monkeypatch.setattr(causal_references, "UNTRAINED_SEEDS", (0,))
  config = causal_config.base_config()
  # The MNLI sample by the relative paths a sweep's runs read from the repository root.
  config.data.update(pair_task="nli", train_file="../shared/data/nli/mnli_dev_matched.tsv")
  config.data.update(challenge_file="../shared/data/nli/hans_format_sample.txt", vocab_size=200)
  config.model.update(attention="vanilla", dim=16, num_layers=1, num_heads=2, mlp_dim=16)
  config.update(num_epochs=2.0, batch_size=32, eval_batch_size=200)
  config.plots.num_examples = 0
  monkeypatch.chdir(tmp_path)  # Not where the runs started: the controls read base_dir's data.
  reports = causal_references.with_controls(config.to_dict(), str(REPO_ROOT))
  assert trained == [(1, 0.0, "causal")]  # Not the config's 2 epochs, nor its attention.
  untrained = reports["causal attention untrained (1 step at learning rate 0)"]
  uniform = reports["uniform attention (every real token alike)"]
  assert untrained["role"] == uniform["role"] == "control"
  # Freshly initialised attention is close to uniform: its exp(entropy) near the token count.
  keys = untrained["draws"][0]["attention"]["effective_keys"]
  assert 0.9 < np.mean(list(keys.values())) / uniform["attention"]["effective_keys"] <= 1.0
