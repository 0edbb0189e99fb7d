"""Experiment runner: a grid of trainings of any package's main, then its tables and plots.

One concept per module: `spec` (the sweep file and what each run is), `supervise` (running the
runs as subprocesses), `commands` (a launcher script instead), `collect` (reading the runs back
and the generic tables), `plots`, `sweep` (the command line, `python -m paper_runner.sweep`),
`stats` (intervals, paired differences and verdicts) and `tables` (the results tables of
docs/results.md from specs under results/ and their stored records,
`python -m paper_runner.tables`), whose work lies in `table_spec`, `table_record`,
`table_summary`, `table_render`, `table_docs` and `table_reproduce`, each importing only the ones
before it.
"""

from trainkit._version import __version__

__all__ = ["__version__"]
