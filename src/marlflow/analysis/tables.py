"""Paper-style tables and plain-text renderers (Markdown, LaTeX) with no extra dependencies.

    table = peak_terminal_table(summary)     # rows workflow x sharing, columns (scale, task), "peak / terminal"
    md = markdown_table(table)                # also used for summary.md, failures, gradient dynamics
    tex = peak_terminal_latex(table)          # captioned with caption(table.attrs["peak"])

Cells are in points (accuracy x 100, one decimal), means over the replicates of a cell; a dagger marks a cell in
which at least one replicate has a terminal cliff. Runs with an intervention get their own row ("voting-ip+kl").
The peak is the one headline estimate `peak_estimate` picks (held-out, else cross-fitted), never the
in-sample maximum over the test evaluations.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from marlflow.core.workflow_spec import BUILTIN

# The shipped workflows in their table order (marlflow.core.workflow_spec); others sort after them by name.
WORKFLOW_ORDER = list(BUILTIN)
SHARING_ORDER = ["sp", "ip", "agent"]
SCALE_ORDER = ["toy", "toy2s", "toy2", "smol", "0.6b", "1.7b", "4b"]
TASK_ORDER = ["math", "code"]
CLIFF_MARK = "†"
# The peak estimates a headline view (peak / terminal table, SP - IP contrasts, the report's findings, the
# claims) may show, first choice first, each with its gain column and a label (definitions.DEFINITIONS):
# selected on the validation problems and read on the test problems; else cross-fitted on the two halves of
# the test problems (the half that selects a step never scores it). Never `peak`, the maximum over the test
# evaluations: the max over K noisy evaluations biases it upward (in-sample, optimistic), so it appears only
# in the per-run tables, labelled so.
PEAK_ESTIMATES = {
    "peak_heldout": ("gain_heldout", "held-out peak (step selected on validation problems, accuracy on test)"),
    "peak_confirmed": ("gain_confirmed", "cross-fitted peak (step selected on one half of the test problems, "
                                         "accuracy on the other)"),
}  # fmt: skip


def peak_estimate(summary: pd.DataFrame) -> str:
    """The first PEAK_ESTIMATES column that every run with an eval has a value for; "peak_heldout" when none
    does (its missing cells then show as missing: the test-selected peak is never a fallback)."""
    s = summary[summary["n_evals"] > 0]
    for col in PEAK_ESTIMATES:
        if col in s.columns and len(s) and s[col].notna().all():
            return col
    return "peak_heldout"


def caption(peak: str) -> str:
    """The peak / terminal table's caption for the peak estimate `peak` (a PEAK_ESTIMATES key)."""
    return (
        f"Peak / terminal eval accuracy (points; mean over replicates). Peak: the {PEAK_ESTIMATES[peak][1]}; "
        f"terminal: the last eval. {CLIFF_MARK} = at least one replicate has a terminal cliff (the calibrated "
        "cliff test: Definitions)."
    )


def order_key(order: list[str]):
    """Sort key: known values in `order` first, in that order, then others alphabetically."""
    return lambda v: (order.index(v), "") if v in order else (len(order), str(v))


def row_label(workflow: str, sharing: str, intervention: str) -> str:
    """'voting-ip', plus '+<intervention>' when it is not 'none'."""
    label = f"{workflow}-{sharing}"
    return label if intervention in ("none", "", None) else f"{label}+{intervention}"


def _fmt_points(x: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def peak_terminal_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Cells 'peak / terminal' indexed by row label, columns MultiIndex (scale, task), both in paper order.

    The peak is the column `peak_estimate(summary)` names, recorded in the result's attrs["peak"] (for its
    caption). Empty cells are '–'. Runs without eval accuracy are left out.
    """
    s = summary[summary["n_evals"] > 0]
    peak = peak_estimate(summary)
    cells: dict[tuple, dict[tuple, str]] = {}
    wf, sh, sc, tk = (order_key(o) for o in (WORKFLOW_ORDER, SHARING_ORDER, SCALE_ORDER, TASK_ORDER))
    for (w, shr, itv, scale, task), g in s.groupby(["workflow", "sharing", "intervention", "scale", "task"]):
        text = f"{_fmt_points(g[peak].mean())} / {_fmt_points(g['terminal'].mean())}"
        if g["cliff"].any():
            text += f" {CLIFF_MARK}"
        cells.setdefault((w, shr, itv), {})[(scale, task)] = text
    rows = sorted(cells, key=lambda r: (wf(r[0]), sh(r[1]), r[2] != "none", r[2]))
    cols = sorted({c for r in cells.values() for c in r}, key=lambda c: (sc(c[0]), tk(c[1])))
    data = [[cells[r].get(c, "–") for c in cols] for r in rows]
    index = pd.Index([row_label(*r) for r in rows], name="workflow-sharing")
    columns = pd.MultiIndex.from_tuples(cols, names=["scale", "task"])
    out = pd.DataFrame(data, index=index, columns=columns)
    out.attrs["peak"] = peak
    return out


def _cell(v, floatfmt: str) -> str:
    if isinstance(v, bool | np.bool_):
        return "yes" if v else ""
    if isinstance(v, float):
        return "" if math.isnan(v) else format(v, floatfmt)
    if v is None or v is pd.NA:
        return ""
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame, floatfmt: str = ".3f", index: bool = True) -> str:
    """A GitHub Markdown table; MultiIndex columns are joined with ' '; bools as 'yes'/''; NaN as ''."""
    cols = [" ".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in df.columns]
    body = df.reset_index() if index else df
    if index:
        name = df.index.name or ""
        cols = [name, *cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for rec in body.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v, floatfmt) for v in rec) + " |")
    return "\n".join(lines) + "\n"


def _tex(s: str) -> str:
    return s.replace("_", "\\_").replace("%", "\\%").replace("&", "\\&").replace(CLIFF_MARK, "$^\\dagger$")


def peak_terminal_latex(table: pd.DataFrame) -> str:
    """A booktabs LaTeX table: a scale header row spanning tasks, a task header row, one row per label;
    captioned for the table's peak estimate (attrs["peak"], set by peak_terminal_table)."""
    cols = list(table.columns)
    scales: list[tuple[str, int]] = []
    for scale, _ in cols:
        if scales and scales[-1][0] == scale:
            scales[-1] = (scale, scales[-1][1] + 1)
        else:
            scales.append((scale, 1))
    lines = [
        "\\begin{table}[t]",
        "\\centering",
        f"\\caption{{{_tex(caption(table.attrs.get('peak', 'peak_heldout')))}}}",
        "\\begin{tabular}{l" + "c" * len(cols) + "}",
        "\\toprule",
        " & " + " & ".join(f"\\multicolumn{{{n}}}{{c}}{{{_tex(s)}}}" for s, n in scales) + " \\\\",
        " & ".join(["Workflow", *(_tex(t) for _, t in cols)]) + " \\\\",
        "\\midrule",
    ]
    for label, row in table.iterrows():
        cells = [_tex(str(label)), *(_tex(v).replace("–", "--") for v in row)]
        lines.append(" & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    return "\n".join(lines) + "\n"
