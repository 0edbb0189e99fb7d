r"""Table: FairSMoE, its ablations and the baselines on the CelebA sample's three paper attributes
(Male, Chubby, Goatee), by identity-grouped 5-fold cross-validation (docs/protocol.md section 6;
docs/results.md, "The paper's three attributes on the CelebA sample, by identity folds"). Runs
pair by (fold, seed) with the corrected resampled interval; the budget and the lambdas read test
faces (docs/protocol.md section 9), declared as selection leaks. `:target=` and `:epochs=` serve
the Smiling tables (results/fair_cv_celeba_smiling*.py).
"""

from paper_runner import table_parts as parts
from paper_runner.spec import dotted
from trainkit.config import parse_arg

FOLD = "data.identity_folds.fold"
ATTRIBUTES = ("Male", "Chubby", "Goatee")
# The rows that train with L_Psi's lambdas (those `results/lambda_tuning.py` chose).
WITH_LAMBDAS = ("fairsmoe", "fairsmoe_no_fgr", "fairsmoe_no_fem", "vanilla_smoe_psi")


def budget_and_leaks(epochs: int, curve: str) -> dict:
  """The TABLE entries that depend on the budget and where it was read: the tuning budgets
  and the two selection leaks (docs/protocol.md sections 7 and 9). `curve` names the target
  whose validation curve chose `epochs`."""
  return dict(
      # Only vanilla SMoE's curve was read: the other rows train at its choice, none tried.
      tuning=parts.fair_tuning(
          parts.FAIR_COMPARISON,
          vanilla_smoe=(
              3,
              f"the epochs, 3, 6 and 12, on its validation curve for {curve} on fold 1 (fold 0's "
              f"validation fold), which chose {epochs} for every row: docs/protocol.md section 7",
          ),
      ),
      selection_leaks=(
          dict(
              rows=None,
              why=(
                  f"the budget, {epochs} epochs, was read from vanilla SMoE's validation curve "
                  f"for {curve} on fold 1, which is the test fold of the runs with fold=1: one "
                  "of the five pairs under every claim is tested on faces that chose its budget."
              ),
          ),
          dict(
              rows=WITH_LAMBDAS,
              why=(
                  "the lambdas of L_Psi these rows train with were chosen on the sample's "
                  "official validation split (`results/lambda_tuning.py`), and every face of it "
                  "is a test face of one of the five folds. Fixing either leak needs new runs; "
                  "they are estimated in docs/protocol.md section 9, kept as run and marked."
              ),
          ),
      ),
  )


PAPER_TABLE = dict(title="FairSMoE, its ablations and the baselines, CelebA at paper scale")
TABLE = parts.paper_claims_table(
    "FairSMoE, its ablations and the baselines, CelebA sample, Male, Chubby and Goatee, 5 identity folds",
    ATTRIBUTES,
    parts.SA_VARIANCE_SHARE,
    cross_validation=(FOLD, "paper_runner.fairmoe.references:split_sizes"),
    **budget_and_leaks(3, "Attractive"),
)


def get_config(arg=None):
  arg = parse_arg(arg, target="Attractive", epochs=3, **parts.SCALE)
  overrides = {**parts.ON_CELEBA, **parts.RECORDED_LAMBDAS, "data.target": arg.target}
  sweep = dict(
      module="fairmoe_jax.main",
      config=f"configs/celeba.py:size=small,epochs={arg.epochs},split=identity_folds",
      grid=dotted({FOLD: (0, 1, 2, 3, 4), "seed": (0,), "method": parts.FAIR_COMPARISON}),
      overrides=dotted({**overrides, "analysis_batches": 16}),
      metrics=("accuracy", "mf.pqd", "validation.accuracy", "experts_active.choices"),
  )
  return parts.at_scale(arg, sweep, tuned="method")
