"""One HTML page per run: per-role training curves, per-step evaluation, step time split, transcripts, config.

`render_run_page` is called by marlflow.report.build for every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from marlflow.analysis.curves import eval_curves
from marlflow.analysis.plots import (
    TIME_PARTS,
    plot_run,
    plot_step_time,
    png_bytes,
    step_time_table,
    with_se,
)
from marlflow.report.html import duration, esc, figure, kv_table, page, table
from marlflow.store.schema import FACTOR_COLUMNS

# ---------------------------------------------------------------------------- run pages


def per_role_train(metrics: pd.DataFrame) -> pd.DataFrame:
    """role x metric over train steps: first, early (first third mean), late (last third mean), last."""
    tr = metrics[metrics["split"] == "train"]
    recs = []
    roles = sorted(tr["role"].unique(), key=lambda r: (r == "all", r))
    for role in roles:
        for name, g in tr[tr["role"] == role].groupby("metric", sort=True):
            v = g.sort_values("step")["value"].dropna().to_numpy(float)
            if not len(v):
                continue
            k = math.ceil(len(v) / 3)
            recs.append({"role": role, "metric": name, "first": v[0], "early_mean": v[:k].mean(),
                         "late_mean": v[-k:].mean(), "last": v[-1]})  # fmt: skip
    return pd.DataFrame(recs, columns=["role", "metric", "first", "early_mean", "late_mean", "last"])


def per_step_eval(metrics: pd.DataFrame) -> pd.DataFrame:
    """Eval metrics as rows (role, metric) and one column per eval step."""
    ev = metrics[metrics["split"] == "eval"]
    if ev.empty:
        return pd.DataFrame()
    t = ev.pivot_table(index=["role", "metric"], columns="step", values="value", aggfunc="last")
    t.columns = [f"step {c}" for c in t.columns]
    t = t.reset_index()
    t["_o"] = t["role"] != "all"
    return t.sort_values(["_o", "role", "metric"]).drop(columns="_o").reset_index(drop=True)


def step_time_split(metrics: pd.DataFrame) -> pd.DataFrame:
    t = step_time_table(metrics)
    total = float(t["step_time"].sum())
    recs = [{"part": "step_time (all)", "total_s": total, "share": 1.0 if total > 0 else math.nan,
             "mean_per_step_s": float(t["step_time"].mean())}]  # fmt: skip
    for part in TIME_PARTS:
        s = float(t[part].sum())
        recs.append({"part": part, "total_s": s, "share": s / total if total > 0 else math.nan,
                     "mean_per_step_s": float(t[part].mean())})  # fmt: skip
    return pd.DataFrame(recs)


def transcripts(samples: pd.DataFrame | None) -> list[str]:
    if samples is None:
        return ["<p class='note'>No samples.parquet beside this run's metrics.</p>"]
    if samples.empty:
        return ["<p class='note'>samples.parquet has no rows for this run.</p>"]
    out = ["<p class='note'>Eval episodes logged at each evaluation (samples.parquet), every role call in "
           f"order. Prompts are folded; texts over {TRANSCRIPT_CHARS} characters are cut.</p>"]  # fmt: skip
    steps = sorted(samples["step"].unique())
    for step in steps:
        s = samples[samples["step"] == step]
        eps = s.groupby("episode", sort=True)
        rewards = [float(g["reward"].iloc[0]) for _, g in eps]
        opened = " open" if step == steps[-1] else ""
        out.append(
            f"<details{opened}><summary><b>step {int(step)}</b>: {len(rewards)} episodes, mean reward "
            f"{np.mean(rewards):.2f}</summary>"
        )
        for ep, g in eps:
            reward = float(g["reward"].iloc[0])
            cls = "ok" if reward > 0 else "bad"
            out.append(f"<h3>episode {int(ep)} · problem {esc(g['uid'].iloc[0])} · "
                       f"<span class='{cls}'>reward {reward:.2f}</span></h3>")  # fmt: skip
            for rec in g.to_dict("records"):
                ff = " · <span class='bad'>format failure</span>" if bool(rec["format_failure"]) else ""
                out.append(
                    f"<div class='call'><b>{esc(rec['slot'])}</b> ({esc(rec['role'])}){ff}"
                    f"<details><summary>prompt</summary><pre>{esc(_cut(rec['prompt']))}</pre></details>"
                    f"<pre>{esc(_cut(rec['output']))}</pre></div>"
                )
        out.append("</details>")
    return out


def _cut(text: object) -> str:
    t = "" if text is None else str(text)
    return (
        t
        if len(t) <= TRANSCRIPT_CHARS
        else t[:TRANSCRIPT_CHARS] + f" [... {len(t) - TRANSCRIPT_CHARS} chars cut]"
    )


def flat_config(cfg: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k in sorted(cfg):
        v = cfg[k]
        if isinstance(v, dict):
            out += flat_config(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", json.dumps(v) if isinstance(v, list | bool) or v is None else v))
    return out


def render_run_page(
    rid: str,
    m: pd.DataFrame,
    info: dict,
    summary_row: dict | None,
    failure: dict | None,
    overview_href: str,
    nav: tuple[str | None, str | None],
    solution: Sequence[str] = (),
) -> str:
    """One run's page; `m` holds that run's metrics rows only; `solution`: its task's solution metrics."""
    fac = m[FACTOR_COLUMNS].iloc[0].to_dict()
    prev_href, next_href = nav
    links = [f"<a href='{esc(overview_href)}'>overview</a>"]
    if prev_href:
        links.append(f"<a href='{esc(prev_href)}'>previous run</a>")
    if next_href:
        links.append(f"<a href='{esc(next_href)}'>next run</a>")
    links += [f"<a href='#{a}'>{t}</a>" for a, t in (("curves", "curves"), ("roles", "per-role metrics"),
              ("time", "step time"), ("transcripts", "transcripts"))]  # fmt: skip
    t = step_time_table(m)
    facts = [(k, fac[k]) for k in FACTOR_COLUMNS[1:]]
    if summary_row:
        facts += [
            (k, summary_row[k])
            for k in ("base", "peak_heldout", "peak_heldout_step", "terminal", "gain_heldout")
        ]
        facts += [
            ("peak_confirmed (cross-fitted)", summary_row["peak_confirmed"]),
            ("peak (in-sample: the max over the test evals, optimistic)", summary_row["peak"]),
            ("peak_step (in-sample)", summary_row["peak_step"]),
        ]
    facts.append(("train steps logged", len(t)))
    facts.append(("training wall time (sum of step_time)", duration(float(t["step_time"].sum())) if len(t)
                  else "not logged"))  # fmt: skip
    if failure:
        facts.append(("failure evidence", failure.get("evidence") or "none"))
    if info["done"]:
        facts.append(("DONE", json.dumps(info["done"], sort_keys=True)))
    curves = eval_curves(m)
    body = [
        f"<h1>{esc(rid)}</h1>",
        "<nav>" + "".join(links) + "</nav>",
        "<h2 id='facts'>Run</h2>",
        kv_table(facts),
    ]
    if info["config"]:
        body += [
            "<details><summary>config.json</summary>",
            kv_table(flat_config(info["config"])),
            "</details>",
        ]
    body += [
        "<h2 id='curves'>Curves</h2>",
        "<p class='note'>Shaded: +- 1 standard error of the evaluation.</p>",
        figure(png_bytes(plot_run(m, solution)), f"{rid} curves"),
    ]
    if not curves.empty:
        c = curves.sort_values("step").assign(se=lambda d: with_se(d))
        body.append(table(c[["step", "accuracy", "se", "n_eval"]]))
    body += [
        "<h2 id='roles'>Per-role metrics</h2>",
        "<h3>Eval, per evaluation step</h3>",
        table(per_step_eval(m), numbers_by="row"),
        "<h3>Train, over the run's steps</h3>",
        f"<p class='note'>Over the {len(t)} logged train steps; early_mean / late_mean: mean over the first / "
        "last third of the steps at which the metric is logged.</p>",
        table(per_role_train(m), numbers_by="row"),
        "<h2 id='time'>Step-time split</h2>",
    ]
    if len(t):
        body += [figure(png_bytes(plot_step_time(m)), f"{rid} step time"), table(step_time_split(m))]
    else:
        body.append("<p class='note'>No step_time rows logged.</p>")
    body += ["<h2 id='transcripts'>Sample transcripts by step</h2>", *transcripts(info["samples"])]
    return page(f"marlflow run {rid}", body)


TRANSCRIPT_CHARS = 4000  # longer prompts/outputs are cut (the full text stays in samples.parquet)
