"""What a finished causal_attn_jax run prints and draws: the summary table of its report, and a
heatmap of every head of every self-attention layer."""

import copy
import json
import types

import ml_collections
import numpy as np
import pytest
from PIL import Image

from causal_attn_jax import plots
from causal_attn_jax import report as report_lib

CLASSIFICATION = {
    "task": "classification",
    "attention": {
        "kind": "causal",
        "effective_keys": {"enc0": 8.80298, "enc1": 5.85438},
        "top1_mass": {"enc0": 0.30884, "enc1": 0.41372},
    },
    "step": 2000,
    "eval_loss": 0.36023,
    "accuracy": 0.89,
    "macro_f1": 0.88982,
    "num_examples": 1000,
    "challenge": {
        "accuracy": 0.636,
        "by_heuristic": {
            "constituent": {"entailment": 0.72, "non-entailment": None},
            "lexical_overlap": {"entailment": 0.388, "non-entailment": 0.884},
        },
        "num_examples": 1000,
    },
    "constraints": {
        "rows_within": 0.18,
        "cols_within": 0.36,
        "nodes_within": 0.35,
        "per_layer": {
            "enc0": {
                "rows_within": 0.13783,
                "cols_within": 0.36792,
                "nodes_within": 0.29575,
                "violation": 0.05310,
                "multiplier": 0.73102,
                "met": False,
            },
            "enc1": {
                "rows_within": 0.97,
                "cols_within": 0.95,
                "nodes_within": 0.96,
                "violation": 0.0,
                "multiplier": 0.54297,
                "met": True,
            },
        },
        "mean_multiplier": {"enc0": 0.73102, "enc1": 0.54297},
        "met": False,
        "summary": "Markov-blanket constraint NOT met: ... not met in enc0",
    },
    "plots": ["plots/attention_enc0_ex0.png"],
}
TRANSLATION = {
    "task": "translation",
    "attention": {
        "kind": "vanilla",
        "effective_keys": {"enc0": 16.83, "dec0": 3.77},
        "top1_mass": {"enc0": 0.165, "dec0": 0.602},
    },
    "step": 1500,
    "eval_loss": 4.684,
    "bleu": 12.3456,
    "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "detokenized": "moses",
    "num_sentences": 500,
    "constraints": {
        "per_layer": {
            "enc0": {"nodes_within": 0.09, "rows_within": 0.01, "cols_within": 0.2},
            "dec0": {"nodes_within": 0.26, "rows_within": 0.38, "cols_within": 0.17},
        },
        "mean_multiplier": {"enc0": 0.0, "dec0": 0.0},
    },
}


def _row(text, first):
  """The cells of the table row whose first cell is `first`."""
  [line] = [l for l in text.splitlines() if l.split() and l.split()[0] == first]
  return line.split()


def test_summary_of_a_classification_report():
  report = copy.deepcopy(CLASSIFICATION)
  text = report_lib.format_summary(report)
  assert report == CLASSIFICATION  # Formatting leaves the report as it is.
  lines = text.splitlines()
  assert lines[0] == (
      "Causal Transformer report: classification, causal attention, step 2000 (eval split)"
  )
  assert lines[1].split() == ("accuracy 89.00% macro-F1 0.8898 examples 1000 loss 0.3602".split())
  assert "Challenge split: accuracy 63.60%   examples 1000" in lines
  assert _row(text, "heuristic") == ["heuristic", "entailment", "non-entailment"]
  assert _row(text, "constituent") == ["constituent", "72.00%", "-"]  # No example: "-".
  assert _row(text, "lexical_overlap") == ["lexical_overlap", "38.80%", "88.40%"]
  header = "layer  effective keys  top-1 mass  nodes in band  rows in band  cols in band"
  assert any(l.strip().startswith(header + "  violation  multiplier  met") for l in lines)
  assert _row(text, "enc0") == [
      "enc0",
      "8.80",
      "0.309",
      "0.296",
      "0.138",
      "0.368",
      "0.0531",
      "0.7310",
      "no",
  ]
  assert _row(text, "enc1") == [
      "enc1",
      "5.85",
      "0.414",
      "0.960",
      "0.970",
      "0.950",
      "0.0000",
      "0.5430",
      "yes",
  ]
  assert lines[-1] == CLASSIFICATION["constraints"]["summary"]
  # The table's columns line up: each layer row is as long as the header.
  widths = {len(l) for l in lines if l.lstrip().startswith(("layer ", "enc0 ", "enc1 "))}
  assert len(widths) == 1


def test_summary_of_a_translation_report_from_an_older_run():
  """BLEU instead of accuracy, no challenge split; per-layer entries that older runs did not
  write (violation, multiplier, met) are "-" or taken from mean_multiplier."""
  text = report_lib.format_summary(TRANSLATION)
  lines = text.splitlines()
  assert lines[0].startswith("Causal Transformer report: translation, vanilla attention")
  assert lines[1].split() == "BLEU 12.35 sentences 500 detokenized moses loss 4.6840".split()
  assert f"sacrebleu {TRANSLATION['bleu_signature']}" in text
  assert "Challenge" not in text and "accuracy" not in text
  assert _row(text, "dec0") == [
      "dec0",
      "3.77",
      "0.602",
      "0.260",
      "0.380",
      "0.170",
      "-",
      "0.0000",
      "-",
  ]


def test_an_unmet_constraint_says_why_at_its_budget_and_why_the_total_loss_rose():
  """Read from the run's logged steps: the multipliers still rising at the last one (or not),
  and the total loss's rise beside the task loss's fall and the multipliers' growth."""
  config = ml_collections.ConfigDict({"num_train_steps": 60})
  names = ["enc0", "enc1"]

  def logged(step, loss, task_loss, multiplier):
    layers = {"constraints/enc0/multiplier": multiplier, "constraints/enc1/multiplier": 0.2}
    return {"step": step, "loss": loss, "task_loss": task_loss, **layers}

  records = [logged(20, 1.12, 1.1, 0.0), {"step": 30, "eval/loss": 1.0}, logged(40, 3.0, 0.9, 0.6)]
  records.append(logged(60, 4.74, 0.8, 1.0))
  rising, loss = report_lib.constraint_notes(records, names, config, met=False)
  assert rising.startswith(
      "Not met at this budget: the multipliers were still rising at the last logged step (mean "
      "0.4 at step 40 -> 0.6 at step 60)"
  )
  assert "more steps than num_train_steps=60" in rising
  assert loss.startswith(
      "The total loss rose (1.12 at step 20 -> 4.74) while the task loss went 1.1 -> 0.8: the "
      "total adds Eq. 6's Lagrangian"
  )
  assert "multipliers gamma grew (0.1 -> 0.6)" in loss
  records[-1] = logged(60, 0.7, 0.6, 0.6)  # The multipliers stopped, the total fell.
  [stopped] = report_lib.constraint_notes(records, names, config, met=False)
  assert stopped.startswith("Not met at this budget: the multipliers stopped rising (mean 0.4 at")
  assert report_lib.constraint_notes(records, names, config, met=True) == []
  report = copy.deepcopy(CLASSIFICATION)
  report["constraints"]["notes"] = [rising, loss]
  lines = report_lib.format_summary(report).splitlines()
  assert lines[-3:] == [CLASSIFICATION["constraints"]["summary"], rising, loss]


def test_write_report_keeps_report_json_and_prints_the_summary(tmp_path, capsys):
  report_lib.write_report(copy.deepcopy(CLASSIFICATION), str(tmp_path))
  assert json.loads((tmp_path / "report.json").read_text()) == CLASSIFICATION
  out = capsys.readouterr().out
  assert report_lib.format_summary(CLASSIFICATION) in out
  assert out.rstrip().endswith(f"Wrote {tmp_path / 'report.json'}")


def test_heatmaps_draw_every_head_of_every_layer(tmp_path, monkeypatch):
  """`_heatmaps` hands each layer's [heads, n, n] maps (padding cut) to the grid, and the grid
  has one panel per head on one colour scale."""
  heads, length, real = 3, 6, 4
  rng = np.random.default_rng(0)
  maps = [rng.random((heads, length, length)).astype(np.float32) for _ in range(2)]
  ids = np.array([5, 6, 7, 8, 0, 0])  # Four real tokens, then padding.
  result = {"attention": [maps], "inputs": [{"ids": ids}]}
  data = types.SimpleNamespace(
      tokenizer=types.SimpleNamespace(pieces=lambda: [f"t{i}" for i in range(10)])
  )
  task = types.SimpleNamespace(
      layer_names=lambda config: ["enc0", "enc1"],
      heatmap_inputs=lambda config: [(0, "ids"), (1, "ids")],
  )
  config = ml_collections.ConfigDict({"model": {"attention": "causal"}})
  drawn = []
  save = plots.save_attention_heads
  monkeypatch.setattr(
      plots,
      "save_attention_heads",
      lambda path, m, labels, **kw: drawn.append((m, labels)) or save(path, m, labels, **kw),
  )
  paths = report_lib._heatmaps(result, data, config, task, str(tmp_path))
  assert [p.split("/")[-1] for p in paths] == ["attention_enc0_ex0.png", "attention_enc1_ex0.png"]
  for (m, labels), expected in zip(drawn, maps):
    np.testing.assert_array_equal(m, expected[:, :real, :real])
    assert labels == ["t5", "t6", "t7", "t8"]
  for path in paths:
    with Image.open(path) as image:
      assert image.format == "PNG" and image.size[0] > image.size[1]  # Heads side by side.

  figure = plots.attention_heads_figure(maps[0][:, :real, :real], ["a", "b", "c", "d"])
  panels = [ax for ax in figure.axes if ax.images]
  assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2"]
  for h, ax in enumerate(panels):
    np.testing.assert_array_equal(ax.images[0].get_array(), maps[0][h, :real, :real])
    assert ax.images[0].get_clim() == pytest.approx((0.0, maps[0][:, :real, :real].max()))
  assert len(figure.axes) == heads + 1  # And the colour bar.


def test_a_grid_of_more_heads_wraps_into_rows():
  figure = plots.attention_heads_figure(np.full((6, 3, 3), 1 / 3), ["a", "b", "c"])
  panels = [ax for ax in figure.axes if ax.images]
  assert len(panels) == 6
  rows = {round(ax.get_position().y0, 3) for ax in panels}
  assert len(rows) == 2  # Four heads, then two.
  with pytest.raises(ValueError, match="heads, queries, keys"):
    plots.attention_heads_figure(np.zeros((3, 3)), ["a", "b", "c"])
