"""Analysis of run metrics: pure DataFrame -> DataFrame functions and plots.

Used by `python -m marlflow aggregate` (tables) and `python -m marlflow report` (figures, HTML). The exact
definitions (base, peak, terminal, cliff, failure signatures, gradient dynamics) are in
`marlflow.core.definitions.DEFINITIONS`.

    from marlflow.analysis import load_runs, summarize_runs, failure_signatures, grad_dynamics
    metrics, samples = load_runs(paths)
    summary = summarize_runs(metrics)            # calibrated cliff / collapse / stagnation (stats.curve_tests)
    failures = failure_signatures(metrics, summary)
    grads = grad_dynamics(metrics)
    cells = summary_by_cell(summary)             # mean and 95% CI over seeds per cell
    con = contrasts(summary)                     # seed-paired SP - IP and MA - SA
    claims = claims_table(summary, grads)        # C1..C7 with verdicts
"""

from marlflow.analysis.claims import CLAIM_COLUMNS, claims_table
from marlflow.analysis.curves import CURVE_COLUMNS, SUMMARY_COLUMNS, eval_curves, summarize_runs
from marlflow.analysis.failures import FAILURE_COLUMNS, failure_signatures
from marlflow.analysis.gradients import GRAD_COLUMNS, grad_dynamics
from marlflow.analysis.io import SAMPLE_COLUMNS, load_runs
from marlflow.analysis.seeds import CONTRAST_COLUMNS, contrasts, summary_by_cell
from marlflow.analysis.tables import markdown_table, peak_terminal_latex, peak_terminal_table
from marlflow.core.definitions import DEFINITIONS, solution_marker, threshold
from marlflow.core.stats import curve_tests, mean_ci

__all__ = [
    "CLAIM_COLUMNS",
    "CONTRAST_COLUMNS",
    "CURVE_COLUMNS",
    "DEFINITIONS",
    "FAILURE_COLUMNS",
    "GRAD_COLUMNS",
    "SAMPLE_COLUMNS",
    "SUMMARY_COLUMNS",
    "claims_table",
    "contrasts",
    "curve_tests",
    "eval_curves",
    "failure_signatures",
    "grad_dynamics",
    "load_runs",
    "markdown_table",
    "mean_ci",
    "peak_terminal_latex",
    "peak_terminal_table",
    "solution_marker",
    "summarize_runs",
    "summary_by_cell",
    "threshold",
]
