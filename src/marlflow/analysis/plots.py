"""Figures for the report (matplotlib, Agg backend). Each plot function returns a Figure; nothing is shown.

    fig = plot_curves(metrics)        # eval accuracy vs step, one panel per workflow x task
    fig = plot_grad_norm(metrics)     # per-role grad_norm vs step, one panel per run (log scale)
    fig = plot_role_share(metrics)    # per-role grad_share vs step, stacked, one panel per run
    save_png(fig, "results/figures/curves.png")   # atomic; returns the PNG bytes

Colours are fixed: SP blue, IP red, single-agent baseline green; each run's base accuracy is a dashed
horizontal line in its run's colour. Scales are told apart by marker.
"""

from __future__ import annotations

import io
import math
import os

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from marlflow.analysis.curves import eval_curves, wide  # noqa: E402
from marlflow.analysis.tables import SCALE_ORDER, TASK_ORDER, WORKFLOW_ORDER, order_key  # noqa: E402
from marlflow.metrics import atomic_write_bytes  # noqa: E402

SHARING_COLOURS = {"sp": "#1f77b4", "ip": "#d62728", "single": "#2ca02c"}
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
ROLE_COLOURS = {
    "generator": "#1f77b4",
    "evaluator": "#ff7f0e",
    "aggregator": "#9467bd",
    "orchestrator": "#8c564b",
    "worker": "#17becf",
    "synthesizer": "#bcbd22",
}


def colour(workflow: str, sharing: str) -> str:
    """Fixed colour of a run: the single baseline gets its own, otherwise by sharing (grey if unknown)."""
    return SHARING_COLOURS["single"] if workflow == "single" else SHARING_COLOURS.get(sharing, "#7f7f7f")


def _grid(n: int, ncols: int, w: float = 4.0, h: float = 3.0) -> tuple[Figure, list]:
    ncols = max(1, min(ncols, n))
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(max(n, 1))]
    return fig, axes


def plot_curves(metrics: pd.DataFrame) -> Figure:
    """Eval accuracy vs step; one panel per workflow x task present (rows workflow, columns task)."""
    curves = eval_curves(metrics)
    workflows = sorted(curves["workflow"].unique(), key=order_key(WORKFLOW_ORDER))
    tasks = sorted(curves["task"].unique(), key=order_key(TASK_ORDER))
    scales = sorted(curves["scale"].unique(), key=order_key(SCALE_ORDER))
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(scales)}
    nrows, ncols = max(1, len(workflows)), max(1, len(tasks))
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    for i, w in enumerate(workflows):
        for j, t in enumerate(tasks):
            ax = fig.add_subplot(nrows, ncols, i * ncols + j + 1)
            ax.set_title(f"{w} / {t}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("eval accuracy")
            panel = curves[(curves["workflow"] == w) & (curves["task"] == t)]
            for _, c in panel.groupby("run_id", sort=True):
                c = c.sort_values("step")
                col = colour(w, c["sharing"].iloc[0])
                ax.plot(c["step"], c["accuracy"], color=col, marker=marker[c["scale"].iloc[0]], ms=3, lw=1.2)
                base = c[c["step"] == 0]["accuracy"]
                if len(base):
                    ax.axhline(float(base.iloc[0]), color=col, ls="--", lw=0.8, alpha=0.6)
    if not workflows:
        fig.add_subplot(1, 1, 1).text(0.5, 0.5, "no eval accuracy", ha="center", va="center")
    handles = [Line2D([], [], color=v, label=k) for k, v in SHARING_COLOURS.items()]
    handles += [Line2D([], [], color="k", marker=marker[s], ls="", label=s) for s in scales]
    handles.append(Line2D([], [], color="k", ls="--", lw=0.8, label="base (step 0)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), fontsize=8)
    return fig


def _role_panels(metrics: pd.DataFrame, metric: str, title: str, ncols: int = 4) -> tuple[Figure, list, dict]:
    series = wide(metrics, "train", None, [metric])
    series = series[(series["role"] != "all") & series[metric].notna()]
    runs = dict(tuple(series.groupby("run_id", sort=True)))
    fig, axes = _grid(len(runs), ncols)
    if not runs:
        axes[0].text(0.5, 0.5, f"no per-role {metric}", ha="center", va="center")
    for ax, rid in zip(axes, runs):
        ax.set_title(rid, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
    return fig, axes, runs


def _role_legend(fig: Figure, roles: set[str]) -> None:
    handles = [Line2D([], [], color=ROLE_COLOURS.get(r, "#7f7f7f"), label=r) for r in sorted(roles)]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)


def plot_grad_norm(metrics: pd.DataFrame, ncols: int = 4) -> Figure:
    """Per-role gradient norm (train split) vs step, log scale, one panel per run."""
    fig, axes, runs = _role_panels(metrics, "grad_norm", "grad_norm", ncols)
    roles = set()
    for ax, (_, s) in zip(axes, runs.items()):
        for role, r in s.groupby("role", sort=True):
            roles.add(role)
            ax.plot(r["step"], r["grad_norm"], color=ROLE_COLOURS.get(role, "#7f7f7f"), lw=1.0)
        if (s["grad_norm"] > 0).all():
            ax.set_yscale("log")
    _role_legend(fig, roles)
    return fig


def plot_role_share(metrics: pd.DataFrame, ncols: int = 4) -> Figure:
    """Per-role share of the step's gradient mass vs step, stacked areas, one panel per run."""
    fig, axes, runs = _role_panels(metrics, "grad_share", "grad_share", ncols)
    roles = set()
    for ax, (_, s) in zip(axes, runs.items()):
        table = s.pivot(index="step", columns="role", values="grad_share").fillna(0.0).sort_index()
        table = table[sorted(table.columns)]
        roles.update(table.columns)
        ax.stackplot(
            table.index,
            *(table[c] for c in table.columns),
            colors=[ROLE_COLOURS.get(c, "#7f7f7f") for c in table.columns],
        )
        ax.set_ylim(0, max(1.0, float(table.sum(axis=1).max())))
    _role_legend(fig, roles)
    return fig


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes without the (version-dependent) Software metadata."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def save_png(fig: Figure, path: str | os.PathLike, dpi: int = 100) -> bytes:
    """Write the figure atomically as PNG; return the bytes (for embedding)."""
    data = png_bytes(fig, dpi)
    atomic_write_bytes(path, data)
    return data
