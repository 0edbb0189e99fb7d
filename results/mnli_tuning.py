r"""Tuning table (validation only): one attention's search on MNLI, four settings, three paired
seeds, chosen by the highest mean validation accuracy (MNLI's eval split: at size=small a tenth
of the sample, at the paper's scale dev-matched; HANS, the claim's split, is never read).
`:attention=causal` (the default) searches the dual-ascent schedule, `vanilla` the learning rate
with the same budget, as the testbed's tables do (results/spurious_tuning_*.py); each scale's
rows start from its config's own setting (docs/reproducing.md).

  python -m paper_runner.sweep --sweep=results/mnli_tuning.py:attention=vanilla --workdir=/tmp/t
"""

from paper_runner import table_parts as parts


def _schedules(step: float, half: float, double: float, ramp: int, other_ramp: int) -> dict:
  """The config's dual step and ramp, half and twice the step, and the step with another ramp."""
  row = lambda s, r: f"{s}@constraints.dual_start_step=0@constraints.dual_ramp_steps={r}"  # noqa
  text = lambda s, r: f"{s}, ramped over {r:,} steps" if r else f"{s} throughout"  # noqa: E731
  rows = ((step, ramp), (half, ramp), (double, ramp), (step, other_ramp))
  return {row(s, r): text(s, r) + " (the config's)" * (i == 0) for i, (s, r) in enumerate(rows)}


def _rates(*rates: float) -> dict[str, str]:
  return {repr(r): f"{r:g}" + " (the config's)" * (i == 0) for i, r in enumerate(rates)}


SCHEDULE, RATE = "constraints.step_size", "optimizer.learning_rate"
# Per attention and scale: the rows key and its settings, configs/mnli_hans.py's first.
SEARCHES = {
    ("causal", "small"): (SCHEDULE, _schedules(0.02, 0.01, 0.04, 500, 0)),
    ("causal", "paper"): (SCHEDULE, _schedules(0.01, 0.005, 0.02, 0, 12_800)),  # Its warm-up.
    ("vanilla", "small"): (RATE, _rates(1e-3, 5e-4, 2e-3, 3e-3)),
    ("vanilla", "paper"): (RATE, _rates(1e-4, 5e-5, 2e-4, 3e-4)),
}
ATTENTION = {"causal": parts.CAUSAL, "vanilla": parts.VANILLA}


def TABLE(arg=None):  # noqa: N802 (a spec's TABLE, here following its argument)
  arg = parts.spec_arg(arg, "attention", ATTENTION)
  rows, settings = SEARCHES[arg.attention, arg.scale]
  data = "MNLI at paper scale" if arg.scale == "paper" else "the MNLI sample"
  return dict(
      references=parts.CAUSAL_REFERENCES,
      title=f"The {'dual-ascent schedule' if rows == SCHEDULE else 'learning rate'} of "
      f"{arg.attention} attention on {data}, validation split",
      rows=rows,
      row_names=settings,
      split="validation",
      select="accuracy",
      columns=(parts.VALIDATION_ACCURACY, parts.EFFECTIVE_KEYS, parts.NODES_WITHIN),
      claims=parts.against_first(settings, "accuracy"),
  )


def get_config(arg=None):
  arg = parts.spec_arg(arg, "attention", ATTENTION)
  rows, settings = SEARCHES.get((arg.attention, arg.scale), (SCHEDULE, {}))
  grid = {"seed": (0, 1, 2), "model.attention": (ATTENTION[arg.attention],), rows: tuple(settings)}
  sweep = parts.causal_sweep(
      grid,
      {
          "data.train_file": "../shared/data/nli/mnli_dev_matched.tsv",
          "data.challenge_file": "../shared/data/nli/hans_regenerated_sample.txt",
      },
      config="configs/mnli_hans.py:size=small",
      metrics=("accuracy",),
  )
  return parts.at_scale(arg, sweep)
