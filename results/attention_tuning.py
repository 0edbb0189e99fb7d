r"""Tuning table (validation only): one attention's search on one task, four settings, three
paired seeds, chosen by the highest mean validation score (MNLI: accuracy on its eval split, at
size=small a tenth of the sample, at the paper's scale dev-matched, never HANS; WMT14: BLEU on
the sample's validation split, at the paper's scale newstest2013, never newstest2014).
`:attention=causal` (the default) searches the dual-ascent schedule, `vanilla` the learning rate
with the same budget, as the testbed's tables do (results/spurious_tuning_*.py); each task and
scale's rows start from its config's own setting (docs/reproducing.md).

  python -m paper_runner.sweep --sweep=results/attention_tuning.py:task=wmt14 --workdir=/tmp/t
"""

from paper_runner import table_parts as parts

BLEU = ("bleu", "BLEU", 1.0, 2)
WMT14_DEV = {f"data.eval_{side}": f"wmt14/newstest2013.{lang}" for side, lang in parts.SIDES}
# Per task: its config, the sample's files, the paper's validation files under ROOT (beside
# paper_scale.PAPER_DATA's: MNLI's eval split is dev-matched already), its score.
TASKS = {
    "mnli": ("configs/mnli_hans.py:size=small", parts.MNLI_SAMPLE, {}, parts.VALIDATION_ACCURACY),
    "wmt14": ("configs/wmt14_ende.py:size=small", parts.ENDE_SAMPLE, WMT14_DEV, BLEU),
}
NAMES = {"mnli": "MNLI", "wmt14": "WMT14 En-De"}


def _schedules(step: float, half: float, double: float, start: int, ramp: int, other: int):
  """The config's dual step, start and ramp; half and twice the step; the step, another ramp."""
  keys = f"@constraints.dual_start_step={start}@constraints.dual_ramp_steps="
  begins = f"from step {start:,}, " if start else ""
  rows = ((step, ramp), (half, ramp), (double, ramp), (step, other))
  return {
      f"{s}{keys}{r}": begins
      + (f"ramped over {r:,} steps to {s}" if r else f"{s} throughout")
      + " (the config's)" * (i == 0)
      for i, (s, r) in enumerate(rows)
  }


def _rates(*rates: float) -> dict[str, str]:
  return {repr(r): f"{r:g}" + " (the config's)" * (i == 0) for i, r in enumerate(rates)}


SCHEDULE, RATE = "constraints.step_size", "optimizer.learning_rate"
# Per task, attention and scale: the rows key and its settings, the config file's first.
SEARCHES = {
    ("mnli", "causal", "small"): (SCHEDULE, _schedules(0.02, 0.01, 0.04, 0, 500, 0)),
    ("mnli", "causal", "paper"): (SCHEDULE, _schedules(0.01, 0.005, 0.02, 0, 0, 12_800)),
    ("mnli", "vanilla", "small"): (RATE, _rates(1e-3, 5e-4, 2e-3, 3e-3)),
    ("mnli", "vanilla", "paper"): (RATE, _rates(1e-4, 5e-5, 2e-4, 3e-4)),
    ("wmt14", "causal", "small"): (SCHEDULE, _schedules(0.01, 0.005, 0.02, 500, 1000, 0)),
    ("wmt14", "causal", "paper"): (SCHEDULE, _schedules(0.01, 0.005, 0.02, 0, 0, 4_000)),
    ("wmt14", "vanilla", "small"): (RATE, _rates(1e-3, 5e-4, 2e-3, 3e-3)),
    ("wmt14", "vanilla", "paper"): (RATE, _rates(7e-4, 3.5e-4, 1.4e-3, 2.1e-3)),
}
ATTENTION = {"causal": parts.CAUSAL, "vanilla": parts.VANILLA}


def _arg(arg):
  return parts.spec_arg(arg, task=TASKS, attention=ATTENTION)


def TABLE(arg=None):  # noqa: N802 (a spec's TABLE, here following its argument)
  arg = _arg(arg)
  rows, settings = SEARCHES[arg.task, arg.attention, arg.scale]
  score = TASKS[arg.task][3]
  task = NAMES[arg.task]
  data = f"{task} at paper scale" if arg.scale == "paper" else f"the {task} sample"
  return dict(
      references=parts.CAUSAL_REFERENCES,
      title=f"The {'dual-ascent schedule' if rows == SCHEDULE else 'learning rate'} of "
      f"{arg.attention} attention on {data}, validation split",
      rows=rows,
      row_names=settings,
      split="validation",
      examples="num_sentences" if score == BLEU else "num_examples",
      select=score[0],
      columns=(score, parts.EFFECTIVE_KEYS, parts.NODES_WITHIN),
      claims=parts.against_first(settings, score[0]),
  )


def get_config(arg=None):
  arg = _arg(arg)
  config, sample, paper_data, score = TASKS[arg.task]
  rows, settings = SEARCHES.get((arg.task, arg.attention, arg.scale), (SCHEDULE, {}))
  grid = {"seed": (0, 1, 2), "model.attention": (ATTENTION[arg.attention],), rows: tuple(settings)}
  sweep = parts.causal_sweep(grid, sample, config=config, metrics=(score[0],))
  return parts.at_scale(arg, sweep, paper_data)
