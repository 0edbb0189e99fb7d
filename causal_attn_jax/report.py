"""What a finished run reports: report.json, its one-line headline, eval scalars and heatmaps.

The report is built from one eval pass (`train.run_eval`'s result) that this module asks for
through an `evaluate` callable, so that it does not depend on the training module; the task
object adds its own part (accuracy and HANS, or BLEU) and says which layers to draw. Schema of
report.json: module docstring of `causal_attn_jax.main`.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os
from typing import TYPE_CHECKING, Any

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import plots
from causal_attn_jax.data import batching, nli
from causal_attn_jax.data.loading import TaskData
from causal_attn_jax.metrics import accuracy
from trainkit.train_state import TrainState

if TYPE_CHECKING:  # tasks.py imports this module for challenge_report.
  from causal_attn_jax.tasks import Task

# evaluate(arrays, keep_attention=0) -> train.run_eval's result for the state being reported.
Evaluate = Callable[..., dict[str, Any]]


def _group_accuracy(labels: np.ndarray, predictions: np.ndarray, keep: np.ndarray) -> float | None:
  return float(np.mean(labels[keep] == predictions[keep])) if keep.any() else None


def challenge_report(data: TaskData, predictions: np.ndarray) -> dict[str, Any]:
  """Challenge accuracy; for HANS, 3-way predictions collapsed and split by heuristic/label."""
  labels = data.challenge["label"]
  if data.challenge_hans:
    predictions = nli.nli_to_hans(predictions)
  report = {"accuracy": accuracy(labels, predictions), "by_heuristic": {}}
  if data.challenge_heuristics:
    heuristics = np.asarray(data.challenge_heuristics)
    for heuristic in sorted(set(data.challenge_heuristics)):
      in_group = heuristics == heuristic
      report["by_heuristic"][heuristic] = {
          name: _group_accuracy(labels, predictions, in_group & (labels == i))
          for i, name in enumerate(nli.HANS_LABELS)
      }
  return report


_WITHIN = ("rows_within", "cols_within", "nodes_within")
# A layer meets the Markov-blanket constraint when at least this fraction of its nodes (tokens,
# over heads and evaluation examples) ends inside the band.
MET_FRACTION = 0.9


def _constraint_report(
    result: dict[str, Any], names: list[str], multipliers: np.ndarray, trained: bool
) -> dict[str, Any]:
  """Whether the constraint is met, per layer and overall, and the numbers that say so.

  Per layer: the fractions of rows, columns and nodes inside the band, `violation` (the mean of
  the Lagrangian's terms over heads: with loss="hinge" the mean distance outside the band, 0
  when every node is inside) and the mean final multiplier; `met` is nodes_within >=
  MET_FRACTION in every layer, and `summary` says it in words (also for a run that did not train
  with the constraint, where it only measures).
  """
  report: dict[str, Any] = {key: float(np.mean(result[key])) for key in _WITHIN}
  report["per_layer"] = {
      name: {
          **{key: float(result[key][l]) for key in _WITHIN},
          "violation": float(result["violation"][l]),
          "multiplier": float(multipliers[l].mean()),
          "met": bool(result["nodes_within"][l] >= MET_FRACTION),
      }
      for l, name in enumerate(names)
  }
  report["mean_multiplier"] = {name: float(multipliers[l].mean()) for l, name in enumerate(names)}
  missed = [name for name, layer in report["per_layer"].items() if not layer["met"]]
  report["met"] = not missed
  if not trained:
    how = "not trained with the constraint (measured only)"
  elif missed:
    how = "NOT met"
  else:
    how = "met"
  layers = ", ".join(
      f"{name} {layer['nodes_within']:.2f}" for name, layer in report["per_layer"].items()
  )
  report["summary"] = (
      f"Markov-blanket constraint {how}: fraction of nodes inside the band per layer {layers} "
      f"(met: >= {MET_FRACTION} in every layer)"
      + (f"; not met in {', '.join(missed)}" if trained and missed else "")
  )
  return report


def _attention_report(result: dict[str, Any], names: list[str], kind: str) -> dict[str, Any]:
  """The attention kind and, per self-attention layer, how concentrated it is (metrics.sparsity)."""
  return {
      "kind": kind,
      **{
          key: {name: float(result[key][l]) for l, name in enumerate(names)}
          for key in ("effective_keys", "top1_mass")
      },
  }


def summary_scalars(result: dict[str, Any], data: TaskData, prefix: str) -> dict[str, float]:
  """The scalars of an eval pass that metrics.jsonl logs under `prefix/`."""
  scalars = {f"{prefix}/loss": result["loss"]}
  if result["predictions"] is not None:
    labels = data.eval["label"]
    scalars[f"{prefix}/accuracy"] = accuracy(labels, result["predictions"])
  for key in _WITHIN + ("effective_keys", "top1_mass"):
    scalars[f"{prefix}/{key}"] = float(np.mean(result[key]))
  return scalars


def _heatmaps(
    result: dict[str, Any],
    data: TaskData,
    config: ml_collections.ConfigDict,
    task: Task,
    workdir: str,
) -> list[str]:
  """PNG heatmaps of head 0 of every self-attention layer (those the report measures)."""
  pieces = data.tokenizer.pieces()
  names = task.layer_names(config)
  paths = []
  for i, (maps, inputs) in enumerate(zip(result["attention"], result["inputs"])):
    for layer, key in task.heatmap_inputs(config):
      ids = inputs[key]
      n = int(batching.sequence_lengths(ids[None])[0])
      labels = [pieces[t] for t in ids[:n]]
      paths.append(
          plots.save_attention_heatmap(
              os.path.join(workdir, "plots", f"attention_{names[layer]}_head0_ex{i}.png"),
              maps[layer][:n, :n],
              labels,
              title=f"{config.model.attention}: {names[layer]} head 0, eval example {i}",
          )
      )
  return paths


def final_report(
    task: Task,
    state: TrainState,
    data: TaskData,
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    evaluate: Evaluate,
    graphdef: nnx.GraphDef,
    mesh: Mesh,
) -> dict[str, Any]:
  """report.json's content (module docstring of main) and the heatmaps."""
  result = evaluate(data.eval, keep_attention=config.plots.num_examples)
  report: dict[str, Any] = {
      "task": config.task,
      "attention": _attention_report(result, task.layer_names(config), config.model.attention),
      "step": int(state.step),
      "eval_loss": result["loss"],
  }
  report.update(
      task.report(config, data, state, result, evaluate=evaluate, graphdef=graphdef, mesh=mesh)
  )
  if data.glove_matched is not None:
    report["glove_matched_pieces"] = data.glove_matched
  names = task.layer_names(config)
  multipliers = np.asarray(jax.device_get(state.extra["multipliers"]))
  report["constraints"] = _constraint_report(
      result, names, multipliers, config_lib.constraint_applied(config)
  )
  if jax.process_index() == 0:
    report["plots"] = [
        os.path.relpath(p, workdir) for p in _heatmaps(result, data, config, task, workdir)
    ]
  return report


def write_report(report: dict[str, Any], workdir: str) -> None:
  """Writes report.json and prints its headline numbers on one line."""
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  headline = {
      k: report[k] for k in ("accuracy", "macro_f1", "bleu", "num_sentences") if k in report
  }
  if "challenge" in report:
    headline["challenge_accuracy"] = report["challenge"]["accuracy"]
  headline.update({f"constraints_{k}": report["constraints"][k] for k in _WITHIN})
  headline["effective_keys"] = float(np.mean(list(report["attention"]["effective_keys"].values())))
  print(
      "report: "
      + ", ".join(
          f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()
      ),
      flush=True,
  )
  print(report["constraints"]["summary"], flush=True)
  print(f"Wrote {os.path.join(workdir, 'report.json')}", flush=True)
