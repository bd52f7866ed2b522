"""Figures for the report (matplotlib, Agg backend). Each plot function returns a Figure; nothing is shown.

Overview figures (all runs):

    fig = plot_curves(metrics)          # eval accuracy +- 1 SE vs step; panel per workflow x task, y shared per task
    fig = plot_grad_norm(metrics)       # per-role grad_norm vs step, SP panel next to its IP panel; one log y
                                        # axis for all panels, zero-gradient steps left out (not drawn at ~0)
    fig = plot_role_share(metrics)      # per-role grad_share vs step, stacked to 1, missing share grey "no data"
    fig = plot_solution_metrics(metrics, names)  # each task's own solution metrics (names: e.g.
                                        # marlflow.tasks.solution_metrics.names_of) vs step, a panel row per
                                        # metric x task, a column per workflow, <= 4 lines a panel
    fig = plot_interventions(metrics)   # per-role grad_norm / proj_share / slot_amplification, a line per
                                        # intervention (none included); placeholder without interventions

Per-run figures (one run's rows):

    fig = plot_run(metrics_of_one_run, names) # accuracy +- SE, other eval metrics and the solution metrics
                                              # `names`, reward, per-role gradients
    fig = plot_step_time(metrics_of_one_run)  # stacked time_generate / time_score / time_backward / time_other

    save_png(fig, "results/figures/curves.png")   # atomic; returns the PNG bytes

Colours are fixed: SP blue, IP red, single-agent baseline green; each run's base accuracy is a dashed
horizontal line in its run's colour; the shaded band is +- one standard error of the evaluation (the logged
accuracy_se, else sqrt(p(1-p)/n_eval)). Scales are told apart by marker. Panels of one task share their y
axis so that gains are visually comparable across workflows; an SP panel and its IP partner share theirs.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from marlflow.analysis.curves import eval_curves, wide  # noqa: E402
from marlflow.analysis.tables import (  # noqa: E402
    SCALE_ORDER,
    SHARING_ORDER,
    TASK_ORDER,
    WORKFLOW_ORDER,
    order_key,
)
from marlflow.core.workflow_spec import baseline  # noqa: E402
from marlflow.store.atomic import atomic_write_bytes
from marlflow.store.schema import FACTOR_COLUMNS  # noqa: E402

SHARING_COLOURS = {"sp": "#1f77b4", "ip": "#d62728", "agent": "#9467bd", "single": "#2ca02c"}
SHARING_LABELS = {"sp": "SP", "ip": "IP", "agent": "AS (per agent)", "single": "single-agent"}
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
ROLE_COLOURS = {
    "generator": "#1f77b4",
    "evaluator": "#ff7f0e",
    "aggregator": "#9467bd",
    "orchestrator": "#8c564b",
    "worker": "#17becf",
    "synthesizer": "#bcbd22",
}
TIME_PARTS = ["time_generate", "time_score", "time_backward", "time_other"]
TIME_COLOURS = dict(zip(TIME_PARTS, ["#1f77b4", "#ff7f0e", "#d62728", "#7f7f7f"]))
# workflow eval metrics (role "all") drawn next to accuracy on a run's page when logged; a task's solution
# metrics (marlflow.tasks.solution_metrics) are drawn there too, dashed
EXTRA_EVAL = ["any_correct", "generator_accuracy", "worker_accuracy"]
EXTRA_STYLES = dict(zip(EXTRA_EVAL, [":", "-.", "-."]))
SOLUTION_STYLE = "--"
# the cell a run belongs to, sharing left out: an SP run and its IP partner share this key
PAIR_KEY = ["workflow", "scale", "task", "seed", "build", "intervention"]
MIN_YSPAN = 0.1  # smallest accuracy range on a curves y axis


def colour(workflow: str, sharing: str) -> str:
    """Fixed colour of a run: the single baseline gets its own, otherwise by sharing (grey if unknown)."""
    return SHARING_COLOURS["single"] if workflow == baseline() else SHARING_COLOURS.get(sharing, "#7f7f7f")


def role_colour(role: str) -> str:
    return ROLE_COLOURS.get(role, "#7f7f7f")


def with_se(curves: pd.DataFrame) -> pd.Series:
    """Standard error per curve row: accuracy_se where logged, else sqrt(p(1-p)/n_eval), else NaN."""
    p = curves["accuracy"].astype(float)
    n = curves["n_eval"].astype(float)
    fallback = np.sqrt((p * (1.0 - p)).clip(lower=0.0) / n.where(n > 0))
    return curves["accuracy_se"].astype(float).fillna(fallback)


def _placeholder(text: str, w: float = 6.0, h: float = 1.5) -> Figure:
    fig = Figure(figsize=(w, h), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.text(0.5, 0.5, text, ha="center", va="center")
    ax.set_axis_off()
    return fig


def _task_ylim(panel: pd.DataFrame) -> tuple[float, float]:
    """y range covering every accuracy +- SE of one task, padded, clipped to [0, 1]."""
    lo = float((panel["accuracy"] - panel["se"].fillna(0)).min())
    hi = float((panel["accuracy"] + panel["se"].fillna(0)).max())
    pad = max(0.02, 0.05 * (hi - lo))
    lo, hi = lo - pad, hi + pad
    if hi - lo < MIN_YSPAN:  # a flat task (e.g. all zero) would otherwise magnify nothing into a full axis
        mid = (lo + hi) / 2
        lo, hi = mid - MIN_YSPAN / 2, mid + MIN_YSPAN / 2
    shift = max(0.0, -lo) - max(0.0, hi - 1.0)  # keep the span, moved inside [0, 1]
    return max(0.0, lo + shift), min(1.0, hi + shift)


def plot_curves(metrics: pd.DataFrame) -> Figure:
    """Eval accuracy +- SE vs step; one panel per workflow x task (rows workflow, columns task).

    All panels of one task share one y axis, so equal gains look equal.
    """
    curves = eval_curves(metrics)
    if curves.empty:
        return _placeholder("no eval accuracy logged")
    curves = curves.assign(se=with_se(curves))
    workflows = sorted(curves["workflow"].unique(), key=order_key(WORKFLOW_ORDER))
    tasks = sorted(curves["task"].unique(), key=order_key(TASK_ORDER))
    scales = sorted(curves["scale"].unique(), key=order_key(SCALE_ORDER))
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(scales)}
    nrows, ncols = len(workflows), len(tasks)
    fig = Figure(figsize=(4.5 * ncols, 2.9 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey="col", squeeze=False)
    for j, t in enumerate(tasks):
        axes[0][j].set_ylim(*_task_ylim(curves[curves["task"] == t]))
        for i, w in enumerate(workflows):
            ax = axes[i][j]
            ax.set_title(f"{w} / {t}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("eval accuracy")
            ax.tick_params(labelleft=True)
            ax.grid(alpha=0.3, lw=0.5)
            panel = curves[(curves["workflow"] == w) & (curves["task"] == t)]
            for _, c in panel.groupby("run_id", sort=True):
                c = c.sort_values("step")
                col = colour(w, c["sharing"].iloc[0])
                x, y, se = c["step"].to_numpy(), c["accuracy"].to_numpy(float), c["se"].to_numpy(float)
                if np.isfinite(se).any():
                    ax.fill_between(x, y - se, y + se, color=col, alpha=0.15, lw=0)
                ax.plot(x, y, color=col, marker=marker[c["scale"].iloc[0]], ms=3, lw=1.2)
                base = c[c["step"] == 0]["accuracy"]
                if len(base):
                    ax.axhline(float(base.iloc[0]), color=col, ls="--", lw=0.8, alpha=0.6)
            if panel.empty:
                ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes, color="#777")
    handles = [Line2D([], [], color=v, label=SHARING_LABELS[k]) for k, v in SHARING_COLOURS.items()]
    handles += [Line2D([], [], color="k", marker=marker[s], ls="", label=s) for s in scales]
    handles.append(Line2D([], [], color="k", ls="--", lw=0.8, label="base (step 0)"))
    handles.append(Patch(color="#999", alpha=0.3, label="+- 1 SE"))
    _legend(fig, handles)
    return fig


def run_pairs(factors: pd.DataFrame) -> list[dict[str, str]]:
    """Runs grouped by cell (PAIR_KEY): [{'sp': run_id, 'ip': run_id}, ...] in paper order (one side may be
    missing, e.g. the single-agent baseline has SP only)."""
    wf, sc, tk = order_key(WORKFLOW_ORDER), order_key(SCALE_ORDER), order_key(TASK_ORDER)
    groups: dict[tuple, dict[str, str]] = {}
    for rec in factors.drop_duplicates("run_id").to_dict("records"):
        key = tuple(rec.get(k, 0) for k in PAIR_KEY)  # runs without a build column are build 0
        groups.setdefault(key, {})[rec["sharing"]] = rec["run_id"]
    keys = sorted(groups, key=lambda k: (wf(k[0]), sc(k[1]), tk(k[2]), k[3], k[4], k[5] != "none", k[5]))
    return [groups[k] for k in keys]


def _pair_panels(series: pd.DataFrame, ylabel: str, pairs_per_row: int = 2):
    """A grid with each cell's SP panel left of its IP panel (the two share y); yields (ax, run_id, rows)."""
    by_run = dict(tuple(series.groupby("run_id", sort=True)))
    pairs = run_pairs(series)
    sharings = [s for s in SHARING_ORDER if any(s in p for p in pairs)]
    sharings += sorted({s for p in pairs for s in p} - set(sharings))
    per = max(1, len(sharings))
    ppr = max(1, min(pairs_per_row, len(pairs)))
    nrows = max(1, math.ceil(len(pairs) / ppr))
    fig = Figure(figsize=(3.6 * per * ppr, 2.7 * nrows + 0.5), layout="constrained")
    panels = []
    for k, pair in enumerate(pairs):
        row, slot = divmod(k, ppr)
        first = None
        for m, sharing in enumerate(sharings):
            rid = pair.get(sharing)
            if rid is None:
                continue  # no partner (single-agent baseline): leave the slot empty
            ax = fig.add_subplot(nrows, per * ppr, row * per * ppr + slot * per + m + 1)
            if first is None:
                first = ax
            else:
                ax.sharey(first)
            ax.set_title(rid, fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            panels.append((ax, rid, by_run[rid]))
    return fig, panels


def _legend(fig: Figure, handles: list) -> None:
    """A legend below the panels, in as many rows as the figure's width needs (about 1.1 inch per entry)."""
    if handles:
        per_row = max(1, int(fig.get_figwidth() / 1.1))
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), per_row), fontsize=8)


def _role_legend(fig: Figure, roles: set[str]) -> None:
    _legend(fig, [Line2D([], [], color=role_colour(r), label=r, lw=3) for r in sorted(roles)])


def _role_series(metrics: pd.DataFrame, metric: str) -> pd.DataFrame:
    series = wide(metrics, "train", None, [metric])
    return series[(series["role"] != "all") & series[metric].notna()].reset_index(drop=True)


def plot_grad_norm(metrics: pd.DataFrame, pairs_per_row: int = 2) -> Figure:
    """Per-role gradient norm (train split) vs step; each SP panel next to its IP partner.

    One log y axis for every panel (so panels compare by eye), spanning the positive norms of all runs. A
    step with norm 0 (no gradient: every group's rewards equal) cannot be drawn on a log axis; it is left out,
    breaking the line, and each panel says how many such steps it had."""
    series = _role_series(metrics, "grad_norm")
    if series.empty:
        return _placeholder("no per-role grad_norm logged")
    fig, panels = _pair_panels(series, "grad_norm (log)", pairs_per_row)
    positive = series.loc[series["grad_norm"] > 0, "grad_norm"].astype(float)
    roles = set()
    for ax, _, s in panels:
        zero = 0
        for role, r in s.groupby("role", sort=True):
            roles.add(role)
            y = r["grad_norm"].astype(float).where(r["grad_norm"] > 0)  # NaN breaks the line at masked steps
            zero += int((r["grad_norm"] <= 0).sum())
            ax.plot(r["step"], y, color=role_colour(role), lw=1.0)
        ax.set_yscale("log")
        ax.tick_params(axis="y", which="both", labelsize=7)  # log minor labels would default to 10 pt
        if zero:
            ax.text(0.99, 0.02, f"{zero} zero-gradient role-steps not drawn", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=6, color="#555")  # fmt: skip
        ax.grid(alpha=0.3, lw=0.5)
    if len(positive):
        lo, hi = float(positive.min()), float(positive.max())
        for ax, _, _ in panels:
            ax.set_ylim(lo / 1.5, hi * 1.5)
    _role_legend(fig, roles)
    return fig


NO_DATA = "#d9d9d9"  # role_share: the part of a step with no logged share (grey, hatched)
# A step whose shares sum below 1: every role's gradient was 0 (algos.grad_shares gives 0 to all; a step where
# every group's rewards are equal), or a role's share was not logged.
NO_DATA_LABEL = "no data (zero gradient or not logged)"


def plot_role_share(metrics: pd.DataFrame, pairs_per_row: int = 2) -> Figure:
    """Per-role share of the step's gradient mass vs step, stacked areas on a 0..1 axis; each SP panel next to
    its IP one. Where the logged shares of a step sum to less than 1 (a step with no gradient at all, where
    every share is 0, or a role not logged), the rest is a grey hatched "no data" band, not left white."""
    series = _role_series(metrics, "grad_share")
    if series.empty:
        return _placeholder("no per-role grad_share logged")
    fig, panels = _pair_panels(series, "grad_share", pairs_per_row)
    roles, gaps = set(), False
    for ax, _, s in panels:
        table = s.pivot(index="step", columns="role", values="grad_share").fillna(0.0).sort_index()
        table = table[sorted(table.columns)]
        roles.update(table.columns)
        rest = (1.0 - table.sum(axis=1)).clip(lower=0.0)
        rest = rest.where(rest > 1e-6, 0.0)
        gaps |= bool((rest > 0).any())
        polys = ax.stackplot(table.index, *(table[c] for c in table.columns), rest,
                             colors=[*(role_colour(c) for c in table), NO_DATA])  # fmt: skip
        polys[-1].set_hatch("///")
        polys[-1].set_edgecolor("#9a9a9a")
        ax.set_ylim(0, max(1.0, float(table.sum(axis=1).max())))
        ax.set_xlim(float(table.index.min()), float(table.index.max()))
    handles = [Line2D([], [], color=role_colour(r), label=r, lw=3) for r in sorted(roles)]
    if gaps:
        handles.append(Patch(facecolor=NO_DATA, edgecolor="#9a9a9a", hatch="///", label=NO_DATA_LABEL))
    _legend(fig, handles)
    return fig


def solution_series(metrics: pd.DataFrame, names: Sequence[str]) -> pd.DataFrame:
    """Eval solution metrics `names` (role "all") long: one row per run x step x metric with a value (factor
    columns, step, metric, value); empty if no run logs any of them."""
    keys = [*FACTOR_COLUMNS, "step"]
    if not names:
        return pd.DataFrame(columns=[*keys, "metric", "value"])
    s = wide(metrics, "eval", "all", list(names))
    long = s.melt(id_vars=keys, value_vars=list(names), var_name="metric", value_name="value")
    return long[long["value"].notna()].sort_values([*keys, "metric"]).reset_index(drop=True)


ITV_TRACES = ["grad_norm", "proj_share", "slot_amplification"]
ITV_SMOOTH = 5  # steps in the centred rolling mean of the per-step seed means


def plot_interventions(metrics: pd.DataFrame) -> Figure:
    """Per-role gradient traces with and without each intervention: a row per (cell, role) of every cell
    that has runs with an intervention, a column per ITV_TRACES metric; a line per intervention (none in
    black), the mean over seeds at each step, smoothed over ITV_SMOOTH steps."""
    series = wide(metrics, "train", None, ITV_TRACES)
    series = series[series["role"] != "all"]
    cell = ["workflow", "sharing", "scale", "task"]
    treated = series.loc[series["intervention"] != "none", cell].drop_duplicates()
    if treated.empty:
        return _placeholder("no runs with an intervention")
    series = series.merge(treated, on=cell)
    rows = series[[*cell, "role"]].drop_duplicates().sort_values([*cell, "role"]).to_records(index=False)
    itvs = ["none", *sorted(set(series["intervention"]) - {"none"})]
    palette = dict(zip(itvs, ["#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]))
    fig = Figure(figsize=(3.4 * len(ITV_TRACES), 2.3 * len(rows) + 0.6), layout="constrained")
    for i, (*key, role) in enumerate(rows):
        sel = series[(series[cell] == key).all(axis=1) & (series["role"] == role)]
        for j, metric in enumerate(ITV_TRACES):
            ax = fig.add_subplot(len(rows), len(ITV_TRACES), i * len(ITV_TRACES) + j + 1)
            for itv in itvs:  # none first, drawn under the others
                mean = sel[sel["intervention"] == itv].groupby("step")[metric].mean().dropna()
                if not mean.empty:
                    smooth = mean.rolling(ITV_SMOOTH, center=True, min_periods=1).mean()
                    ax.plot(smooth.index, smooth.values, color=palette.get(itv, "#7f7f7f"), lw=1.0)
            ax.set_title(f"{'-'.join(key[:2])} {key[3]} {role}", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel(metric, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3, lw=0.5)
            if not ax.lines:  # e.g. slot_amplification of a role with one call per episode
                ax.text(
                    0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="#777"
                )
    _legend(fig, [Line2D([], [], color=palette[i], label=i, lw=2) for i in itvs])
    return fig


MAX_LINES = 4  # most lines in one solution-metric panel


def plot_solution_metrics(metrics: pd.DataFrame, names: Sequence[str]) -> Figure:
    """Each task's own metrics of its solver outputs (marlflow.tasks.solution_metrics; `names`, e.g. the toy
    tasks' careless_share) vs step: a row of panels per metric x task that logs it, a column per workflow, a
    line per sharing x scale x intervention (colour by sharing, marker by scale), the mean over replicates.
    A panel with more than MAX_LINES such lines draws the MAX_LINES with the most runs and says how many it
    left out. A row shares its y axis: [0, 1] for a metric whose values all lie there. A placeholder
    figure (saying which names) when no run logs any of `names`: callers draw this figure only when the runs'
    tasks have solution metrics (marlflow.report.build)."""
    s = solution_series(metrics, names)
    if s.empty:
        return _placeholder(f"{', '.join(names) or 'no solution metric'}: not logged by these runs")
    rows = [
        (m, t)
        for m in names
        for t in sorted(s.loc[s["metric"] == m, "task"].unique(), key=order_key(TASK_ORDER))
    ]
    workflows = sorted(s["workflow"].unique(), key=order_key(WORKFLOW_ORDER))
    scales = sorted(s["scale"].unique(), key=order_key(SCALE_ORDER))
    marker = {sc: MARKERS[i % len(MARKERS)] for i, sc in enumerate(scales)}
    fig = Figure(figsize=(3.4 * len(workflows), 2.6 * len(rows) + 0.6), layout="constrained")
    axes = fig.subplots(len(rows), len(workflows), sharey="row", squeeze=False)
    line_key = ["sharing", "scale", "intervention"]
    for i, (metric, t) in enumerate(rows):
        for j, w in enumerate(workflows):
            ax = axes[i][j]
            ax.set_title(f"{w} / {t}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3, lw=0.5)
            panel = s[(s["metric"] == metric) & (s["task"] == t) & (s["workflow"] == w)]
            groups = sorted(panel.groupby(line_key, sort=True), key=lambda kg: -kg[1]["run_id"].nunique())
            for (sharing, scale, itv), g in groups[:MAX_LINES]:
                mean = g.groupby("step")["value"].mean()
                ax.plot(mean.index, mean.values, color=colour(w, sharing), marker=marker[scale], ms=3,
                        ls="-" if itv == "none" else "--", lw=1.2)  # fmt: skip
            if len(groups) > MAX_LINES:
                ax.text(0.99, 0.98, f"{len(groups) - MAX_LINES} more lines not drawn", transform=ax.transAxes,
                        ha="right", va="top", fontsize=6, color="#555")  # fmt: skip
            if panel.empty:
                ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes, color="#777")
        values = s.loc[s["metric"] == metric, "value"]
        if values.between(0.0, 1.0).all():
            axes[i][0].set_ylim(-0.02, 1.02)
        axes[i][0].set_ylabel(metric, fontsize=8)
    present = {("single" if w == baseline() else sh) for w, sh in zip(s["workflow"], s["sharing"])}
    handles = [
        Line2D([], [], color=v, label=SHARING_LABELS[k]) for k, v in SHARING_COLOURS.items() if k in present
    ]
    handles += [Line2D([], [], color="k", marker=marker[sc], ls="", label=sc) for sc in scales]
    if (s["intervention"] != "none").any():
        handles.append(Line2D([], [], color="k", ls="--", label="with an intervention"))
    _legend(fig, handles)
    return fig


def plot_run(metrics: pd.DataFrame, solution: Sequence[str] = ()) -> Figure:
    """One run's page figure, four panels: eval accuracy +- SE with the other workflow-level eval metrics
    (EXTRA_EVAL) and its task's solution metrics `solution` (marlflow.tasks.solution_metrics); train
    reward_mean (workflow and per role); per-role grad_norm; per-role grad_share."""
    if metrics["run_id"].nunique() != 1:
        raise ValueError(f"plot_run takes one run's metrics, got runs {sorted(metrics['run_id'].unique())}")
    fig = Figure(figsize=(11, 6.4), layout="constrained")
    (a_eval, a_rew), (a_norm, a_share) = fig.subplots(2, 2)
    curves = eval_curves(metrics)
    extra = {**EXTRA_STYLES, **{name: SOLUTION_STYLE for name in solution if name not in EXTRA_STYLES}}
    ev = wide(metrics, "eval", "all", list(extra))
    a_eval.set_title("eval (workflow)", fontsize=10)
    if not curves.empty:
        c = curves.sort_values("step")
        se = with_se(c).to_numpy(float)
        x, y = c["step"].to_numpy(), c["accuracy"].to_numpy(float)
        if np.isfinite(se).any():
            a_eval.fill_between(x, y - se, y + se, color="k", alpha=0.12, lw=0, label="+- 1 SE")
        a_eval.plot(x, y, color="k", marker="o", ms=3, lw=1.4, label="accuracy")
    shown = [ev[["step", name]].dropna().sort_values("step") for name in extra]
    for (name, style), e in zip(extra.items(), shown):
        if len(e):
            a_eval.plot(e["step"], e[name], ls=style, marker=".", lw=1.0, label=name)
    if all(e.iloc[:, 1].between(0.0, 1.0).all() for e in shown):  # a solution metric may be no share
        a_eval.set_ylim(-0.02, 1.02)
    _finish(a_eval, "value")
    rew = wide(metrics, "train", None, ["reward_mean"]).dropna(subset=["reward_mean"])
    a_rew.set_title("train reward_mean", fontsize=10)
    for role, r in rew.groupby("role", sort=True):
        kw = dict(color="k", lw=1.4) if role == "all" else dict(color=role_colour(role), lw=0.9, alpha=0.8)
        a_rew.plot(r["step"], r["reward_mean"], label=role, **kw)
    _finish(a_rew, "reward_mean")
    for ax, name in ((a_norm, "grad_norm"), (a_share, "grad_share")):
        s = _role_series(metrics, name)
        ax.set_title(f"per-role {name}", fontsize=10)
        log = name == "grad_norm" and bool((s[name] > 0).any())  # as in plot_grad_norm: zero steps left out
        for role, r in s.groupby("role", sort=True):
            y = r[name].astype(float).where(r[name] > 0) if log else r[name]
            ax.plot(r["step"], y, color=role_colour(role), lw=1.0, label=role)
        if log:
            ax.set_yscale("log")
        _finish(ax, name)
    return fig


def _finish(ax, ylabel: str) -> None:
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, lw=0.5)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="#777")


def step_time_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per train step of one or more runs: run_id, step, step_time and the TIME_PARTS (role "all" rows)."""
    t = wide(metrics, "train", "all", ["step_time", *TIME_PARTS])
    return t[["run_id", "step", "step_time", *TIME_PARTS]].dropna(subset=["step_time"]).reset_index(drop=True)


def plot_step_time(metrics: pd.DataFrame) -> Figure:
    """Seconds per train step of one run, stacked by part (generate, score, backward, other)."""
    t = step_time_table(metrics)
    if t.empty:
        return _placeholder("no step_time logged")
    fig = Figure(figsize=(11, 2.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    bottom = np.zeros(len(t))
    for part in TIME_PARTS:
        v = t[part].fillna(0.0).clip(lower=0.0).to_numpy(float)
        ax.bar(
            t["step"],
            v,
            bottom=bottom,
            width=0.85,
            color=TIME_COLOURS[part],
            label=part.removeprefix("time_"),
        )
        bottom += v
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel("seconds", fontsize=9)
    ax.tick_params(labelsize=8)
    fig.legend(fontsize=8, loc="outside right upper")
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
