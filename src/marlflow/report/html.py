"""HTML building blocks of the report: escaping, number formats, tables, figures, the page shell and its style.

Pure functions from values to HTML strings; nothing here reads a file.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from marlflow.analysis.tables import (
    SCALE_ORDER,
    SHARING_ORDER,
    TASK_ORDER,
    WORKFLOW_ORDER,
    order_key,
)

FINDINGS_BG = "#fff3cd"  # the findings box's background, used by no other element: tests find the box by it
STYLE = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;padding:1em 2em;
  max-width:1200px;color:#222;line-height:1.4;background:#fff}
h1{font-size:1.6em;margin:.3em 0}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
h3{font-size:1.05em;margin-top:1.2em}
nav{margin:.5em 0 1em;font-size:.9em}nav a{margin-right:1em}
a{color:#1a5fb4}
.note{color:#555;font-size:.9em;margin:.3em 0}
.tw{overflow-x:auto;max-width:100%;margin:.4em 0 1.2em}
table{border-collapse:collapse;font-size:13px;max-width:100%}
th,td{border:1px solid #d0d0d0;padding:3px 7px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f0f0f0;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
.flag{color:#b00020;font-weight:600}
img{max-width:100%;height:auto;display:block;margin:.4em 0}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;border:1px solid #e4e4e4;
  padding:.4em .6em;margin:.2em 0 .6em;font-size:12px}
details{margin:.3em 0}summary{cursor:pointer}
.call{border-left:3px solid #ccc;padding-left:.7em;margin:.5em 0 .8em}
.ok{color:#1b7f3b}.bad{color:#b00020}
.kv td:first-child{font-weight:600;background:#f6f6f6;white-space:nowrap}
.kv td:last-child{overflow-wrap:anywhere}
.ci{color:#666;font-size:11px;white-space:nowrap}
.supported{color:#1b7f3b;font-weight:600}.contradicted{color:#b00020;font-weight:600}
.findings{background:FINDINGS_BG;border:2px solid #d9a520;border-radius:6px;padding:.4em 1.2em .5em;
  margin:.6em 0 1.2em;font-size:.92em;line-height:1.35}
.findings h2{margin:.1em 0 .2em;border:0}.findings ul{margin:.1em 0;padding-left:1.2em}.findings li{margin:.15em 0}
.banner{font-weight:600;color:#6b4700;margin:.2em 0 .4em}.warn{color:#b00020;font-weight:600}
""".replace("FINDINGS_BG", FINDINGS_BG)


# ---------------------------------------------------------------------------- HTML helpers


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def is_missing(v: object) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float | np.floating) and math.isnan(v))


def number_format(values) -> str:
    """One format for a group of numbers (a column, or a row of a metric x step table), so they line up:
    'd' for integers, and for whole floats when one reaches 2 (counts such as n_eval, not accuracies of 0 or
    1); '.1f' when any reaches 100; else '.3f'."""
    nums = [v for v in values if _is_num(v) and not is_missing(v) and math.isfinite(float(v))]
    if nums and all(isinstance(v, int | np.integer) for v in nums):
        return "d"
    if nums and all(float(v).is_integer() for v in nums) and any(abs(float(v)) >= 2 for v in nums):
        return "d"
    return ".1f" if any(abs(float(v)) >= 100 for v in nums) else ".3f"


def fmt(v: object, spec: str | None = None) -> str:
    """A table cell's text: '' for missing, yes/'' for bools, numbers in `spec` (number_format([v]) if None)."""
    if is_missing(v):
        return ""
    if isinstance(v, bool | np.bool_):
        return "yes" if v else ""
    if _is_num(v):
        x = float(v)
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        spec = spec or number_format([v])
        return str(int(x)) if spec == "d" else format(x, spec)
    return str(v)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


def code_spans(text: str) -> str:
    """Escaped text with its `backtick` spans as <code> (the tables' .md banners, shown as HTML)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))


def header(name: str) -> str:
    """An escaped header that may wrap after '_' (long metric names otherwise force wide columns)."""
    return esc(name).replace("_", "_<wbr>")


def table(
    df: pd.DataFrame,
    links: dict[str, str] | None = None,
    raw_columns: Sequence[str] = (),
    numbers_by: str = "column",
) -> str:
    """A real HTML table inside a horizontally scrolling container; cells escaped, numbers right-aligned.

    links: run_id -> href; cells of a run_id column become links. raw_columns hold trusted HTML (built here).
    numbers_by: "column" or "row": the group of cells that share one number format (rows for tables whose
    rows are metrics).
    """
    links = links or {}
    head = "".join(f"<th>{header(str(c))}</th>" for c in df.columns)
    specs = {c: number_format(df[c].tolist()) for c in df.columns}
    body = []
    for rec in df.itertuples(index=False):
        row_spec = number_format(rec) if numbers_by == "row" else None
        cells = []
        for col, v in zip(df.columns, rec):
            text = fmt(v, row_spec or specs[col])
            if col in raw_columns:
                cells.append(f"<td>{v}</td>")
            elif col == "run_id" and text in links:
                cells.append(f'<td><a href="{esc(links[text])}">{esc(text)}</a></td>')
            else:
                cells.append(f'<td class="n">{esc(text)}</td>' if _is_num(v) else f"<td>{esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="tw"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def kv_table(pairs: Sequence[tuple[str, object]]) -> str:
    """A two-column key / value table."""
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(fmt(v))}</td></tr>" for k, v in pairs)
    return f'<div class="tw"><table class="kv"><tbody>{rows}</tbody></table></div>'


def figure(data: bytes, alt: str) -> str:
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def page(title: str, body: Sequence[str]) -> str:
    head = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>"
    )
    return head + "\n" + "\n".join(body) + "\n</body></html>\n"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "not logged"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def cell_label(rec: dict, sharing: bool = True) -> str:
    """'voting-ip toy math' (+intervention) for a cell's key columns."""
    head = f"{rec['workflow']}-{rec['sharing']}" if sharing else str(rec["workflow"])
    label = f"{head} {rec['scale']} {rec['task']}"
    itv = rec.get("intervention")
    return label if itv in ("none", "", None) or is_missing(itv) else f"{label} +{itv}"


def cell_order(df: pd.DataFrame) -> pd.DataFrame:
    wf, sh, sc, tk = (order_key(o) for o in (WORKFLOW_ORDER, SHARING_ORDER, SCALE_ORDER, TASK_ORDER))
    keys = df.apply(lambda r: (wf(r["workflow"]), sc(r["scale"]), tk(r["task"]), str(r["intervention"]),
                               sh(r["sharing"])), axis=1)  # fmt: skip
    return df.assign(_k=keys).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)
