"""Analysis of run metrics: pure DataFrame -> DataFrame functions and plots.

Used by `python -m marlflow.aggregate` (tables) and `python -m marlflow.report` (figures, HTML). The exact
definitions (base, peak, terminal, cliff, failure signatures, gradient dynamics) are in
`marlflow.analysis.definitions.DEFINITIONS`.

    from marlflow.analysis import load_runs, summarize_runs, failure_signatures, grad_dynamics
    metrics, samples = load_runs(paths)
    summary = summarize_runs(metrics)
    failures = failure_signatures(metrics, summary, samples)
    grads = grad_dynamics(metrics)
"""

from marlflow.analysis.curves import CURVE_COLUMNS, SUMMARY_COLUMNS, eval_curves, summarize_runs
from marlflow.analysis.definitions import DEFINITIONS, threshold
from marlflow.analysis.failures import FAILURE_COLUMNS, failure_signatures
from marlflow.analysis.gradients import GRAD_COLUMNS, grad_dynamics
from marlflow.analysis.io import SAMPLE_COLUMNS, load_runs
from marlflow.analysis.tables import markdown_table, peak_terminal_latex, peak_terminal_table

__all__ = [
    "CURVE_COLUMNS",
    "DEFINITIONS",
    "FAILURE_COLUMNS",
    "GRAD_COLUMNS",
    "SAMPLE_COLUMNS",
    "SUMMARY_COLUMNS",
    "eval_curves",
    "failure_signatures",
    "grad_dynamics",
    "load_runs",
    "markdown_table",
    "peak_terminal_latex",
    "peak_terminal_table",
    "summarize_runs",
    "threshold",
]
