"""The findings box that opens the report: best and worst cells, SP vs IP, cliffs, failures, band warnings.

Each function turns the aggregate tables (and the runs' metrics where a finding needs them) into short lines of
HTML; `findings_section` assembles the box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from marlflow.analysis.claims import FAMILY_ALPHA
from marlflow.analysis.curves import eval_curves, eval_sizes, peak_se, wide
from marlflow.analysis.seeds import CELL, ONE_SEED_BANNER, n_replicates, one_seed
from marlflow.analysis.tables import (
    PEAK_ESTIMATES,
    peak_estimate,
)
from marlflow.core.config import TOY_SCALES
from marlflow.core.definitions import CI_LEVEL, FORMAT_RISE, TOY_BASE_BAND, supervisor
from marlflow.core.stats import t_quantile
from marlflow.report.html import cell_label, cell_order, code_spans, esc, is_missing

# ---------------------------------------------------------------------------- findings

SHOWN = 3  # most runs named per finding (cliffs, failures); the full lists are in the sections below
SHOWN_CELLS = 6  # most SP - IP cells, the largest peak differences first (the box must fit the first screen)
# Short names of the headline peak estimates (tables.PEAK_ESTIMATES) in the findings box.
PEAK_NAMES = {"peak_heldout": "held-out peak", "peak_confirmed": "cross-fitted peak"}


def with_peak_se(summary: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """summary plus `peak_se`: the standard error of the test evaluation at the held-out peak step
    (peak_heldout_step; accuracy_se as logged, else sqrt(p (1 - p) / n)), NaN where the run has none. The
    in-sample peak's `se` is never used for it: its step was selected on the test problems."""
    recs = []
    for rid, g in eval_curves(metrics).groupby("run_id", sort=False):
        g, n = g.reset_index(drop=True), eval_sizes(g)
        recs += [(rid, int(g["step"].iloc[i]), peak_se(g, i, float(n[i]))) for i in range(len(g))]
    at = pd.DataFrame(recs, columns=["run_id", "peak_heldout_step", "peak_se"])
    at["peak_heldout_step"] = at["peak_heldout_step"].astype("Int64")
    out = summary.drop(columns=["peak_se"], errors="ignore").copy()
    out["peak_heldout_step"] = out["peak_heldout_step"].astype("Int64")
    return out.merge(at, on=["run_id", "peak_heldout_step"], how="left")


def _spread(values: pd.Series) -> str:
    """'0.600' for one seed, else 'mean (min-max)' over the seeds (a range: with 2-3 seeds a t-interval is
    wider than the accuracy scale; the CIs are in Summary by cell)."""
    v = values.astype(float).dropna()
    if v.empty:
        return "not logged"
    if len(v) == 1:
        return f"{v.iloc[0]:.3f}"
    return f"{v.mean():.3f} ({v.min():.3f}-{v.max():.3f})"


def replicate_word(df: pd.DataFrame) -> str:
    """What one replicate of `df`'s cells is called: "seeds", or "replicates (seeds x builds)" where the
    rows carry more than one toy build (marlflow.analysis.seeds.replicate_keys: a replicate is a (seed, build)
    pair, so counting them as seeds would overstate the seeds)."""
    builds = df["build"].nunique() if "build" in df.columns else 1
    return "replicates (seeds x builds)" if builds > 1 else "seeds"


def _seeds(g: pd.DataFrame) -> str:
    """'one seed', or 'range over N seeds' / 'range over N replicates (seeds x builds)' for a cell's rows."""
    n, word = n_replicates(g), replicate_word(g)
    if n == 1:
        return "one seed" if word == "seeds" else "one replicate"
    return f"range over {n} {word}"


def _more(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _cell_text(cell: dict, g: pd.DataFrame, peak: str) -> str:
    step = ""
    if peak == "peak_heldout":
        steps = ", ".join(str(int(x)) for x in sorted(g["peak_heldout_step"].dropna()))
        step = f" (step {steps or '?'})"
    return (
        f"{cell_label(cell)}: base {_spread(g['base'])}, {PEAK_NAMES[peak]} {_spread(g[peak])}{step}, "
        f"terminal {_spread(g['terminal'])} ({_seeds(g)})"
    )


def best_worst(summary: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, text): the cell with the largest mean peak - base and the one with the smallest terminal - base
    (mean over its replicates), each with its base, peak, peak step and terminal (last eval). The peak is the
    headline estimate (tables.peak_estimate: held-out, else cross-fitted), never the in-sample max."""
    s = summary[summary["n_evals"] > 0]
    groups = [(dict(zip(CELL, k)), g) for k, g in s.groupby(CELL, sort=True)]
    if not groups:
        return [("Cells", "no run has an eval accuracy")]
    peak = peak_estimate(s)
    gain = PEAK_ESTIMATES[peak][0]
    best = max(groups, key=lambda kg: (kg[1][gain].mean(), cell_label(kg[0])))
    worst = min(groups, key=lambda kg: (kg[1]["gain_terminal"].mean(), cell_label(kg[0])))
    out = [(f"Largest gain ({PEAK_NAMES[peak]} - base)", _cell_text(*best, peak))]
    if worst[0] != best[0]:
        out.append(("Smallest terminal gain (terminal - base)", _cell_text(*worst, peak)))
    return out


def corrected_level(con: pd.DataFrame, stat: str) -> tuple[float, int]:
    """(level, m): the Bonferroni level 1 - FAMILY_ALPHA / m over the m SP - IP cells whose `stat` has an
    interval (>= 2 replicate pairs) in contrasts.csv, the family whose sides the findings box names."""
    c = con[(con["contrast"] == "sp-ip") & (con["stat"] == stat) & (con["n_pairs"] >= 2) & con["lo"].notna()]
    m = max(len(c), 1)
    return 1 - FAMILY_ALPHA / m, m


def at_level(r: dict, level: float) -> tuple[float, float]:
    """contrasts.csv's t-interval of a row (stats.mean_ci at CI_LEVEL: mean +- t quantile x SE) at `level`: the
    same mean and SE with the t quantile of `level` over its n_pairs - 1 degrees of freedom."""
    n, m = int(r["n_pairs"]), float(r["mean"])
    half = (float(r["hi"]) - float(r["lo"])) / 2
    half *= t_quantile(0.5 + level / 2, n - 1) / t_quantile(0.5 + CI_LEVEL / 2, n - 1)
    return m - half, m + half


def per_task_line(claims: pd.DataFrame | None) -> str | None:
    """claims.csv's per-task C3 rows (IP - SP peak over a task's cells, with the interval at C3's corrected
    level and the effect it detects with 80% power) as one line; None without them (one task, or no CI)."""
    if claims is None or not {"claim", "value", "ci_lo", "ci_hi", "mde", "ci_level"} <= set(claims.columns):
        return None
    rows = claims[claims["claim"].astype(str).str.startswith("C3 ")]
    rows = rows[rows["ci_lo"].notna()]
    if rows.empty:
        return None
    parts = [f"{str(r['claim'])[3:]} {float(r['value']):+.3f} [{float(r['ci_lo']):+.3f}, {float(r['ci_hi']):+.3f}], "
             f"detectable with 80% power: {float(r['mde']):.3f}" for r in rows.to_dict("records")]  # fmt: skip
    level = float(rows["ci_level"].iloc[0])
    names = " / ".join(str(c) for c in rows["claim"])
    head = f"IP - SP peak per task over its cells (claims.csv rows {names}, at {level:.4g}): "
    return esc(head + "; ".join(parts))


def sp_ip_lines(con: pd.DataFrame | None, summary: pd.DataFrame) -> list[str]:
    """Per workflow x scale x task (x intervention) with both SP and IP runs: the replicate-paired SP - IP
    difference of the headline peak (tables.peak_estimate: held-out, else cross-fitted; never the in-sample
    max) and of terminal_mean3 (contrasts.csv). Over >= 2 pairs with its CI Bonferroni-corrected over the cells
    that have one (corrected_level), and which side the peak's favours (the terminal's is descriptive); over
    one pair with the evaluation noise of such a difference, 2 x sqrt(se_SP^2 + se_IP^2) (se: the standard
    error of the test evaluation at each run's held-out peak step, `peak_se` from with_peak_se; unknown without
    it), a difference beyond it marked descriptive (uncorrected)."""
    if con is None:
        return ["contrasts.csv is missing: rerun <code>python -m marlflow aggregate</code>"]
    peak = peak_estimate(summary)
    c = con[(con["contrast"] == "sp-ip") & con["stat"].isin([peak, "terminal_mean3"])]
    level, _ = corrected_level(c, peak)
    out = []
    for key, g in cell_order(c).groupby(CELL, sort=False, dropna=False):
        cell = dict(zip(CELL, key))
        by = {r["stat"]: r for r in g.to_dict("records")}
        if peak not in by or is_missing(by[peak]["mean"]):
            continue
        pairs = int(by[peak]["n_pairs"])
        parts = []
        for stat, name in ((peak, PEAK_NAMES[peak]), ("terminal_mean3", "terminal")):
            r = by.get(stat)
            if r is None or is_missing(r["mean"]):
                continue
            text = f"{name} {float(r['mean']):+.3f}"
            if pairs >= 2 and not is_missing(r["lo"]):
                lo, hi = at_level(r, level)
                side = "SP higher" if lo > 0 else "IP higher" if hi < 0 else "no clear difference"
                text += f" [{lo:+.3f}, {hi:+.3f}]" + (f": {side}" if stat == peak else "")
            parts.append(text)
        label = cell_label(cell, sharing=False)
        if pairs >= 2:
            out.append(
                (
                    abs(float(by[peak]["mean"])),
                    f"{esc(label)}: {esc('; '.join(parts))} ({pairs} seed pairs)",
                )
            )
            continue
        same = (
            summary[["workflow", "scale", "task", "intervention"]] == [key[0], key[2], key[3], key[4]]
        ).all(1)
        se = summary.loc[same, "peak_se"].astype(float) if "peak_se" in summary.columns else pd.Series([])
        noise = 2 * math.sqrt(float((se**2).sum())) if len(se) == 2 and se.notna().all() else math.nan
        side = float(by[peak]["mean"])
        if math.isfinite(noise):
            verdict = (
                f"peaks within eval noise ({noise:.3f})"
                if abs(side) <= noise
                else f"{'SP' if side > 0 else 'IP'} peak higher by more than the eval noise ({noise:.3f}; "
                "descriptive: one pair, uncorrected)"
            )
        else:
            verdict = "eval noise unknown (no SE at the held-out peak for exactly one SP and one IP run)"
        out.append((abs(side), f"{esc(label)}: {esc(', '.join(parts))}: {esc(verdict)}"))
    if not out:
        return ["no cell has both an SP and an IP run"]
    shown = [text for _, text in sorted(out, key=lambda x: -x[0])[:SHOWN_CELLS]]
    if len(out) > SHOWN_CELLS:
        shown.append(
            f"{len(out) - SHOWN_CELLS} more cells with smaller peak differences: Paired SP - IP below"
        )
    return shown


def cliff_lines(summary: pd.DataFrame) -> str:
    """How many runs end in a terminal cliff, and the largest drops: the cliff test's drop with its SE
    (definitions: a calibrated test over the candidate peaks, not a selected peak) and the held-out peak with
    its step (never the in-sample max), then terminal_mean3."""
    s = summary[summary["n_evals"] > 0]
    cl = s[s["cliff"].astype(bool)].sort_values(["drop", "run_id"], ascending=[False, True])
    if cl.empty:
        return f"no terminal cliff in {len(s)} runs"

    def held(r) -> str:
        if is_missing(r.get("peak_heldout")):
            return "no held-out peak"
        return f"held-out peak {float(r['peak_heldout']):.3f} at step {int(r['peak_heldout_step'])}"

    shown = [
        f"{r['run_id']} (drop {float(r['drop']):.3f}, SE {float(r['drop_se']):.3f}; {held(r)} -> "
        f"{float(r['terminal_mean3']):.3f} over the last 3 evals)"
        for r in cl.head(SHOWN).to_dict("records")
    ]
    more = f" and {len(cl) - SHOWN} more" if len(cl) > SHOWN else ""
    return f"{len(cl)} of {len(s)} runs: " + "; ".join(shown) + more


def format_rises(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per run x role with eval format_failure_rate: the first and the last logged value and their steps,
    rows whose rise (last - first) is >= FORMAT_RISE (the capture rule's size), largest rise first."""
    cols = ["run_id", "role", "first_step", "first", "last_step", "last", "rise"]
    f = wide(metrics, "eval", None, ["format_failure_rate"])
    f = f[(f["role"] != "all") & f["format_failure_rate"].notna()].sort_values("step")
    recs = []
    for (rid, role), g in f.groupby(["run_id", "role"], sort=True):
        a, b = g.iloc[0], g.iloc[-1]
        rise = float(b["format_failure_rate"]) - float(a["format_failure_rate"])
        recs.append([rid, role, int(a["step"]), float(a["format_failure_rate"]), int(b["step"]),
                     float(b["format_failure_rate"]), rise])  # fmt: skip
    out = pd.DataFrame(recs, columns=cols)
    out = out[out["rise"] >= FORMAT_RISE - 1e-9]
    return out.sort_values(["rise", "run_id"], ascending=[False, True], kind="stable").reset_index(drop=True)


def capture_by_sharing(flags: dict[str, list[str]], metrics: pd.DataFrame) -> str:
    """'SP 6 of 30, IP 4 of 30': capture flags per sharing mode, of the runs whose workflow has a supervisory
    role that can be captured (definitions.supervisor); '' where the metrics name no sharing."""
    if not {"run_id", "workflow", "sharing"} <= set(metrics.columns):
        return ""
    runs = metrics[["run_id", "workflow", "sharing"]].drop_duplicates("run_id")
    supervised = runs["workflow"].map(lambda w: supervisor(w) is not None)
    runs = runs[runs["run_id"].astype(str).isin(flags) & supervised]
    parts = []
    for sharing in sorted(runs["sharing"].unique(), key=lambda x: (x != "sp", x)):
        ids = runs[runs["sharing"] == sharing]["run_id"].astype(str)
        parts.append(f"{sharing.upper()} {sum('capture' in flags[r] for r in ids)} of {len(ids)}")
    return ", ".join(parts)


def failure_lines(failures: pd.DataFrame, metrics: pd.DataFrame) -> list[str]:
    """Counts of collapse / stagnation / capture (failures.csv) with the runs, capture also per sharing mode
    (capture_by_sharing: a finding about SP's shared policy needs the IP count beside it), and the largest rises
    of a role's format-failure rate (the metrics), with values and steps."""
    flags = failure_flags(failures)
    out = []
    for sig in ("collapse", "stagnation", "capture"):
        runs = [rid for rid, f in flags.items() if sig in f]
        if runs:
            by = capture_by_sharing(flags, metrics) if sig == "capture" else ""
            by = f"; by sharing mode, of the runs with a supervisory role: {by}" if by else ""
            out.append(esc(f"{sig}: {len(runs)} of {len(flags)} runs ({_more(runs)}{by})"))
    rises = format_rises(metrics)
    for r in rises.head(SHOWN).to_dict("records"):
        out.append(esc(f"{r['run_id']}: the {r['role']}'s format-failure rate rises {r['first']:.2f} (step "
                       f"{r['first_step']}) -> {r['last']:.2f} (step {r['last_step']})"))  # fmt: skip
    if len(rises) > SHOWN:
        out.append(
            esc(f"and {len(rises) - SHOWN} more roles whose format-failure rate rises by >= {FORMAT_RISE}")
        )
    return out or [esc(f"no collapse, stagnation, capture or format-failure rise in {len(flags)} runs")]


def band_warning(summary: pd.DataFrame) -> str | None:
    """The toy runs (TOY_SCALES) whose base (step-0 accuracy) is outside TOY_BASE_BAND, as a sentence; None if
    all inside."""
    lo, hi = TOY_BASE_BAND
    toy = summary[summary["scale"].isin(TOY_SCALES) & summary["base"].notna()]
    out = toy[(toy["base"] < lo - 1e-9) | (toy["base"] > hi + 1e-9)].sort_values("run_id")
    if out.empty:
        return None
    runs = [f"{r['run_id']} {float(r['base']):.3f}" for r in out.to_dict("records")]
    return (
        f"{len(out)} of {len(toy)} toy bases are outside the designed band [{lo:.2f}, {hi:.2f}] ({_more(runs)}): "
        "the toy model or machine is not the one the README's numbers come from (weights hash and CPU under "
        "Provenance); expect other numbers."
    )


def per_problem_line(pairs: pd.DataFrame | None) -> str | None:
    """The per-problem SP - IP verdicts (paired.csv, analysis.paired: the declared primary rows) in one line:
    which cells show a difference at the declared corrected level, else that none does, with the largest
    difference; None without per-problem outcomes."""
    if pairs is None or pairs.empty:
        return None
    rows = pairs[(pairs["contrast"] == "sp-ip") & (pairs["verdict"] != "descriptive")]
    if rows.empty:
        return None
    shown = rows[rows["verdict"] != "no difference shown"]
    level = float(rows["ci_level"].iloc[0])
    where = lambda r: f"{r['workflow']} {r['task']}"  # noqa: E731
    if len(shown):
        found = "; ".join(f"{where(r)}: {r['verdict']} ({r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}])"
                          for r in shown.to_dict("records"))  # fmt: skip
    else:
        big = rows.loc[rows["diff"].abs().idxmax()]
        found = f"no difference shown in any (largest: {where(big)} {big['diff']:+.3f} [{big['lo']:+.3f}, {big['hi']:+.3f}])"
    return esc(
        f"Per problem (paired.md, as declared; {len(rows)} rows at {level:.4g} each, at the step validation chose): {found}"
    )


def findings_section(tables: dict[str, object], metrics: pd.DataFrame) -> list[str]:
    """The box at the top of the overview: seeds banner, best and worst cells, SP vs IP, cliffs, failures."""
    summary = with_peak_se(tables["summary"], metrics)
    s = summary[summary["n_evals"] > 0]
    per_cell = s.groupby(CELL).apply(n_replicates, include_groups=False) if len(s) else pd.Series([])
    items = []
    if len(per_cell) and one_seed(s):
        head = f"<p class='banner'>{code_spans(ONE_SEED_BANNER)}</p>"
    elif len(per_cell) and per_cell.min() < 5:
        k, n = int(per_cell.min()), int(per_cell.max())
        word = replicate_word(s)
        head = (f"<p class='banner'>{k if k == n else f'{k}-{n}'} {word} per cell: read differences as "
                f"indications; intervals over so few {word.split()[0]} are wide.</p>")  # fmt: skip
    else:
        head = ""
    warn = band_warning(summary)
    if warn:
        items.append(f"<li class='warn'>{esc(warn)}</li>")
    items += [f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in best_worst(summary)]
    sp_ip = sp_ip_lines(tables.get("contrasts.csv"), summary)
    task_line = per_task_line(tables.get("claims.csv"))
    sp_ip += [task_line] if task_line else []
    paired = per_problem_line(tables.get("paired.csv"))
    sp_ip += [paired] if paired else []
    con = tables.get("contrasts.csv")
    if one_seed(s):
        how = "one seed pair each, so no CI; eval noise = 2 x the SE of the two test evals at the held-out peaks"
    else:
        level, m = corrected_level(con, peak_estimate(s)) if con is not None else (1 - FAMILY_ALPHA, 1)
        how = (f"mean over replicate pairs [CI at {level:.4g}, Bonferroni over the {m} cells with a CI]; the side "
               "is named for the peak, the terminal is descriptive")  # fmt: skip
    peak = PEAK_NAMES[peak_estimate(s)] if len(s) else "peak"
    items.append(
        f"<li><b>SP - IP</b> ({peak}; terminal = mean of the last 3 evals; {how}):<ul>"
        + "".join(f"<li>{x}</li>" for x in sp_ip)
        + "</ul></li>"
    )
    items.append(f"<li><b>Terminal cliffs</b>: {esc(cliff_lines(summary))}</li>")
    fails = failure_lines(tables["failures"], metrics)
    items.append(
        "<li><b>Failure signatures</b>:<ul>" + "".join(f"<li>{x}</li>" for x in fails) + "</ul></li>"
    )
    return [
        "<section id='findings' class='findings'><h2>Findings</h2>",
        head,
        f"<ul>{''.join(items)}</ul>",
        "<p class='note'>From summary.parquet, contrasts.csv, paired.csv, failures.csv and the runs' metrics; details in the "
        "sections below.</p></section>",
    ]


# Instruction sets that decide which CPU kernels torch/oneDNN run, highest first (and so the toy model's
# rounding: marlflow.models.toybuild, "Determinism"), as /proc/cpuinfo flag -> name.


def failure_flags(failures: pd.DataFrame) -> dict[str, list[str]]:
    flags = {}
    for rec in failures.to_dict("records"):
        flags[str(rec["run_id"])] = [
            k for k in ("cliff", "collapse", "stagnation", "capture") if str(rec.get(k)).lower() == "true"
        ]
    return flags
