"""What a finished run reports: report.json, its printed summary, eval scalars and heatmaps,
from one eval pass (report.json's schema: `causal_attn_jax.main`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from causal_attn_jax import config as config_lib
from causal_attn_jax import evaluation, plots, tasks
from causal_attn_jax.data import batching
from causal_attn_jax.data.loading import TaskData
from causal_attn_jax.metrics import accuracy
from trainkit import storage
from trainkit.metric_writers import log_exists, read_metrics
from trainkit.storage import write_atomically
from trainkit.train_state import TrainState

# The number formats of `format_summary`'s layer columns after the name, but for "met".
_LAYER_FORMATS = (".2f", ".3f", ".3f", ".3f", ".3f", ".4f", ".4f")
# A layer meets the Markov-blanket constraint when at least this fraction of its nodes (tokens,
# over heads and evaluation examples) ends inside the band.
MET_FRACTION = 0.9


def _constraint_report(
    result: dict[str, Any], names: list[str], multipliers: np.ndarray, trained: bool
) -> dict[str, Any]:
  """Whether the constraint is met, per layer and overall, and the numbers that say so.

  Per layer: the fractions of rows, columns and nodes inside the band, `violation` (the mean of
  the Lagrangian's terms over heads) and the mean final multiplier; `met` is nodes_within >=
  MET_FRACTION in every layer, and `summary` says it in words.
  """
  report: dict[str, Any] = {key: float(np.mean(result[key])) for key in evaluation.WITHIN}
  report["per_layer"] = {
      name: {
          **{key: float(result[key][l]) for key in evaluation.WITHIN},
          "violation": float(result["violation"][l]),
          "multiplier": float(multipliers[l].mean()),
          "met": bool(result["nodes_within"][l] >= MET_FRACTION),
      }
      for l, name in enumerate(names)
  }
  report["mean_multiplier"] = {name: float(multipliers[l].mean()) for l, name in enumerate(names)}
  missed = [name for name, layer in report["per_layer"].items() if not layer["met"]]
  report["met"] = not missed
  how = "NOT met" if missed else "met"
  if not trained:
    how = "not trained with the constraint (measured only)"
  layers = ", ".join(
      f"{name} {layer['nodes_within']:.2f}" for name, layer in report["per_layer"].items()
  )
  report["summary"] = (
      f"Markov-blanket constraint {how}: fraction of nodes inside the band per layer {layers} "
      f"(met: >= {MET_FRACTION} in every layer)"
      + (f"; not met in {', '.join(missed)}" if trained and missed else "")
  )
  return report


def constraint_notes(
    records: list[dict[str, Any]], names: list[str], config: ml_collections.ConfigDict, met: bool
) -> list[str]:
  """From a constrained run's logged training steps (metrics.jsonl): why the constraint is not
  met at this budget, when it is not, and why the total loss rose, when it did."""
  logged = [r for r in records if "task_loss" in r and f"constraints/{names[0]}/multiplier" in r]
  if len(logged) < 2:
    return []
  first, before, last = logged[0], logged[-2], logged[-1]
  gamma = lambda r: float(np.mean([r[f"constraints/{name}/multiplier"] for name in names]))
  at = lambda r: f"{gamma(r):.3g} at step {r['step']}"
  notes = []
  if not met and gamma(last) > gamma(before):
    notes.append(
        f"Not met at this budget: the multipliers were still rising at the last logged step (mean "
        f"{at(before)} -> {at(last)}), so dual ascent had not yet weighted the violations enough "
        f"to hold the attention in the band; more steps than num_train_steps="
        f"{config.num_train_steps} (or a larger constraints.step_size) continue it."
    )
  elif not met:
    notes.append(
        f"Not met at this budget: the multipliers stopped rising (mean {at(last)}: the training "
        "batches' violations were near zero, or constraints.multiplier_cap held them), so more "
        "steps alone will not meet it on the eval split."
    )
  if last["loss"] > first["loss"]:
    notes.append(
        f"The total loss rose ({first['loss']:.3g} at step {first['step']} -> {last['loss']:.3g})"
        f" while the task loss went {first['task_loss']:.3g} -> {last['task_loss']:.3g}: the "
        "total adds Eq. 6's Lagrangian, gamma . violation (+ penalty/2 |violation|^2), and the "
        f"multipliers gamma grew ({gamma(first):.3g} -> {gamma(last):.3g}); it measures the "
        "constraint's pull, not the model getting worse."
    )
  return notes


def summary_scalars(result: dict[str, Any], data: TaskData, prefix: str) -> dict[str, float]:
  """The scalars of an eval pass that metrics.jsonl logs under `prefix/`."""
  scalars = {f"{prefix}/loss": result["loss"]}
  if result["predictions"] is not None:
    labels = data.eval["label"]
    scalars[f"{prefix}/accuracy"] = accuracy(labels, result["predictions"])
  for key in evaluation.WITHIN + ("effective_keys", "top1_mass"):
    scalars[f"{prefix}/{key}"] = float(np.mean(result[key]))
  return scalars


def _heatmaps(
    result: dict[str, Any],
    data: TaskData,
    config: ml_collections.ConfigDict,
    task: tasks.Task,
    workdir: str,
) -> list[str]:
  """Per kept eval example and self-attention layer (those the report measures), a PNG with a
  heatmap of every head (`plots.attention_heads_figure`)."""
  pieces = data.tokenizer.pieces()
  names = task.layer_names(config)
  paths = []
  for i, (maps, inputs) in enumerate(zip(result["attention"], result["inputs"])):
    for layer, key in task.heatmap_inputs(config):
      ids = inputs[key]
      n = int(batching.sequence_lengths(ids[None])[0])
      labels = [pieces[t] for t in ids[:n]]
      heads = maps[layer][:, :n, :n]  # [H, N, N]: the real tokens, padding cut off.
      paths.append(
          plots.save_attention_heads(
              storage.join(workdir, "plots", f"attention_{names[layer]}_ex{i}.png"),
              heads,
              labels,
              title=(
                  f"{config.model.attention} attention: {names[layer]}, its {len(heads)} heads, "
                  f"eval example {i}"
              ),
          )
      )
  return paths


def final_report(
    config: ml_collections.ConfigDict,
    graphdef: nnx.GraphDef,
    eval_step: evaluation.EvalStep,
    state: TrainState,
    data: TaskData,
    mesh: Mesh,
    workdir: str,
) -> dict[str, Any]:
  """report.json's content (module docstring of main) and the heatmaps."""
  task = tasks.get_task(config)
  evaluate = functools.partial(evaluation.run_eval, eval_step, state, config=config, mesh=mesh)
  result = evaluate(data.eval, keep_attention=config.plots.num_examples)
  names = task.layer_names(config)
  # Per self-attention layer, how concentrated it is (metrics.sparsity).
  attention = {
      key: {name: float(result[key][l]) for l, name in enumerate(names)}
      for key in ("effective_keys", "top1_mass")
  }
  report: dict[str, Any] = {
      "task": config.task,
      "attention": {"kind": config.model.attention, **attention},
      "step": int(state.step),
      "eval_loss": result["loss"],
  }
  report.update(
      task.report(config, data, state, result, evaluate=evaluate, graphdef=graphdef, mesh=mesh)
  )
  if data.glove_matched is not None:
    report["glove_matched_pieces"] = data.glove_matched
  multipliers = np.asarray(jax.device_get(state.extra["multipliers"]))
  report["constraints"] = _constraint_report(
      result, names, multipliers, config_lib.constraint_applied(config)
  )
  log = storage.join(workdir, "metrics.jsonl")  # Process 0's, which writes the report.
  if config_lib.constraint_applied(config) and log_exists(log):
    report["constraints"]["notes"] = constraint_notes(
        read_metrics(workdir), names, config, report["constraints"]["met"]
    )
  if jax.process_index() == 0:
    report["plots"] = [
        storage.relpath(p, workdir) for p in _heatmaps(result, data, config, task, workdir)
    ]
  return report


def _percent(value: float | None) -> str:
  return "-" if value is None else f"{100.0 * value:.2f}%"


def _number(value: Any, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
  """Lines of a text table: the first column left-aligned, the others right-aligned."""
  widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
  return [
      indent
      + "  ".join(
          cell.ljust(widths[c]) if c == 0 else cell.rjust(widths[c]) for c, cell in enumerate(row)
      ).rstrip()
      for row in [header, *rows]
  ]


def format_summary(report: dict[str, Any]) -> str:
  """Plain-text summary of a report.json dict: what a finished run prints.

  The task's numbers, the challenge split's when there is one, a table of the self-attention
  layers' sparsity and constraint, then the constraint's summary; absent entries show as "-".
  """
  attention = report.get("attention", {})
  lines = [
      f"Causal Transformer report: {report.get('task', '?')}, {attention.get('kind', '?')} "
      f"attention, step {report.get('step', '?')} (eval split)"
  ]
  if "accuracy" in report:
    lines.append(
        f"  accuracy {_percent(report['accuracy'])}   macro-F1 "
        f"{_number(report.get('macro_f1'), '.4f')}   examples {report.get('num_examples', '-')}"
        f"   loss {_number(report.get('eval_loss'), '.4f')}"
    )
  if "bleu" in report:
    lines.append(
        f"  BLEU {report['bleu']:.2f}   sentences {report.get('num_sentences', '-')}   "
        f"detokenized {report.get('detokenized', '-')}   loss "
        f"{_number(report.get('eval_loss'), '.4f')}"
    )
    if report.get("bleu_signature"):
      lines.append(f"  sacrebleu {report['bleu_signature']}")
  challenge = report.get("challenge")
  if challenge:
    lines += [
        "",
        f"Challenge split: accuracy {_percent(challenge.get('accuracy'))}   examples "
        f"{challenge.get('num_examples', '-')}",
    ]
    by_heuristic = challenge.get("by_heuristic") or {}
    if by_heuristic:
      labels = list(dict.fromkeys(k for v in by_heuristic.values() for k in v))
      rows = [[h, *(_percent(v.get(label)) for label in labels)] for h, v in by_heuristic.items()]
      lines += _table(["heuristic", *labels], rows)
  constraints = report.get("constraints", {})
  per_layer = constraints.get("per_layer", {})
  layers = list(dict.fromkeys([*attention.get("effective_keys", {}), *per_layer]))
  if layers:
    lines += ["", "Self-attention layers (eval split)"]
    header = ["layer", "effective keys", "top-1 mass", "nodes in band", "rows in band"]
    header += ["cols in band", "violation", "multiplier", "met"]
    rows, mean_multiplier = [], constraints.get("mean_multiplier", {})
    for name in layers:
      layer = per_layer.get(name, {})
      values = [attention.get(key, {}).get(name) for key in ("effective_keys", "top1_mass")]
      values += [layer.get(key) for key in ("nodes_within", "rows_within", "cols_within")]
      values += [layer.get("violation"), layer.get("multiplier", mean_multiplier.get(name))]
      cells = [_number(v, spec) for v, spec in zip(values, _LAYER_FORMATS)]
      met = layer.get("met")
      rows.append([name, *cells, "-" if met is None else ("yes" if met else "no")])
    lines += _table(header, rows)
  if constraints.get("summary"):
    lines.append(constraints["summary"])
  lines += constraints.get("notes", [])
  return "\n".join(lines)


def write_report(report: dict[str, Any], workdir: str) -> None:
  """Writes report.json and prints its summary (`format_summary`)."""
  # Written whole or not at all: a crash mid-write must not leave a torn report.
  write_atomically(storage.join(workdir, "report.json"), json.dumps(report, indent=2))
  print(format_summary(report), flush=True)
  print(f"Wrote {storage.join(workdir, 'report.json')}", flush=True)
