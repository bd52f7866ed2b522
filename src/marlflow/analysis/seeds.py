"""Seeds as an axis: per-cell means with 95% CIs over seeds, and seed-matched contrasts.

    cells = summary_by_cell(summary)   # one row per cell: n_seeds, <stat>_mean/_lo/_hi (CELL_STATS)
    con = contrasts(summary)           # long: contrast (sp-ip | ma-sa | itv-none), cell keys, stat, n_pairs,
                                       # mean, lo, hi
    md = ci_markdown(cells)            # the same as text, "mean [lo, hi]", "n/a" where a CI needs 2 seeds
    one_seed(cells)                    # no cell has 2 seeds: the .md files and the report say ONE_SEED_BANNER

A cell is (workflow, sharing, scale, task, intervention); a replicate is one run of it, named by its seed and,
when the runs carry a `build` column (the toy model's build seed, matrix axis `build`), by the pair (seed,
build): REPLICATE / replicate_keys. "n_seeds" and "seeds" count and list replicates ("1-b2": seed 1 on toy
build 2). Runs of the same replicate see the same problems at every step (the step's problems are a function
of seed and step) and, with a build, start from the same model, so SP - IP, MA - SA and intervention - none
differences are paired by replicate. Intervals: stats.mean_ci (t-interval over
seeds) for accuracies and gains; stats.rate_ci (Wilson score interval) for the cliff / collapse / stagnation
rates; a paired difference of 0/1 flags (the `cliff` contrast) has its t-interval cut to the range [-1, 1].
"""

from __future__ import annotations

import math

import pandas as pd

from marlflow.analysis.tables import SCALE_ORDER, SHARING_ORDER, TASK_ORDER, WORKFLOW_ORDER, order_key
from marlflow.core.definitions import parallel_role
from marlflow.core.stats import mean_ci, rate_ci, tango_ci
from marlflow.core.workflow_spec import baseline

CELL = ["workflow", "sharing", "scale", "task", "intervention"]
REPLICATE = ["seed", "build"]  # one replicate of a cell; `build` only where the runs carry it


def replicate_keys(df: pd.DataFrame) -> list[str]:
    """The columns of `df` naming one replicate: ["seed", "build"] when it has a build column, else ["seed"]."""
    return [c for c in REPLICATE if c in df.columns]


def n_replicates(df: pd.DataFrame) -> int:
    """How many distinct replicates (seed, or (seed, build) pairs) the rows of `df` cover."""
    return int(len(df[replicate_keys(df)].drop_duplicates()))


def replicate_names(df: pd.DataFrame) -> list[str]:
    """Sorted replicate names of `df`'s rows: "1" for seed 1 (build 0 or no build column), "1-b2" on build 2."""
    keys = df[replicate_keys(df)].drop_duplicates().sort_values(replicate_keys(df))
    return [
        f"{int(r['seed'])}" + (f"-b{int(r['build'])}" if r.get("build", 0) else "")
        for r in keys.to_dict("records")
    ]


# summary column -> name in the cell tables (booleans become rates)
# Peaks and gains: the held-out and the cross-fitted estimates (tables.PEAK_ESTIMATES), never the in-sample
# `peak` / `gain_peak` (max over the test evaluations), which stay per run in summary.csv only.
CELL_STATS = {
    "base": "base",
    "peak_heldout": "peak_heldout",
    "peak_confirmed": "peak_confirmed",
    "terminal": "terminal",
    "terminal_mean3": "terminal_mean3",
    "gain_heldout": "gain_heldout",
    "gain_confirmed": "gain_confirmed",
    "gain_terminal": "gain_terminal",
    "gain_terminal3": "gain_terminal3",
    "cliff": "cliff_rate",
    "collapse": "collapse_rate",
    "stagnation": "stagnation_rate",
}
RATES = {c for c, name in CELL_STATS.items() if name.endswith("_rate")}  # 0/1 per run: Wilson interval
CONTRAST_STATS = ["base", "peak_heldout", "peak_confirmed", "terminal_mean3", "gain_heldout", "gain_confirmed",
                  "gain_terminal3", "cliff"]  # fmt: skip
CONTRAST_COLUMNS = ["contrast", *CELL, "stat", "n_pairs", "mean", "lo", "hi"]


def cell_columns() -> list[str]:
    cols = [*CELL, "n_seeds", "seeds"]
    for name in CELL_STATS.values():
        cols += [f"{name}_mean", f"{name}_lo", f"{name}_hi"]
    return cols


def _sort_cells(df: pd.DataFrame) -> pd.DataFrame:
    keys = {"workflow": WORKFLOW_ORDER, "sharing": SHARING_ORDER, "scale": SCALE_ORDER, "task": TASK_ORDER}
    tmp = df.copy()
    for col, order in keys.items():
        tmp[f"_{col}"] = tmp[col].map(lambda v, o=order: order_key(o)(v))
    tmp = tmp.sort_values([f"_{c}" for c in keys] + ["intervention"], kind="stable")
    return tmp.drop(columns=[f"_{c}" for c in keys]).reset_index(drop=True)


def summary_by_cell(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per cell of runs with an eval: number of replicates (n_seeds: seeds, or (seed, build) pairs),
    their names (seeds) and mean / 95% CI of CELL_STATS over them."""
    s = summary[summary["n_evals"] > 0]
    records = []
    for key, g in s.groupby(CELL, sort=False):
        rec = dict(zip(CELL, key))
        rec["n_seeds"] = n_replicates(g)
        rec["seeds"] = ",".join(replicate_names(g))
        for col, name in CELL_STATS.items():
            m, lo, hi, _ = (rate_ci if col in RATES else mean_ci)(g[col].astype(float))
            rec.update({f"{name}_mean": m, f"{name}_lo": lo, f"{name}_hi": hi})
        records.append(rec)
    out = pd.DataFrame.from_records(records, columns=cell_columns())
    out["n_seeds"] = out["n_seeds"].astype("int64")
    return _sort_cells(out)


def _paired(left: pd.DataFrame, right: pd.DataFrame, on: list[str]) -> pd.DataFrame:
    return left.merge(right, on=on, suffixes=("", "_ref"))


def _diff_ci(diff: pd.Series, stat: str) -> tuple[float, float, float, int]:
    """mean_ci of paired differences; for a 0/1 flag the bounds are cut to the possible range [-1, 1]."""
    m, lo, hi, k = mean_ci(diff)
    if stat in RATES and k >= 2:
        lo, hi = max(-1.0, lo), min(1.0, hi)
    return m, lo, hi, k


def _differences(name: str, left: pd.DataFrame, right: pd.DataFrame, on: list[str]) -> list[list]:
    """CONTRAST_COLUMNS records: per CELL of `left`, its runs minus their `right` partners matched on `on`
    (which includes the replicate keys)."""
    pairs = _paired(left[[*CELL, *replicate_keys(left), *CONTRAST_STATS]], right[[*on, *CONTRAST_STATS]], on)
    records = []
    for key, g in pairs.groupby(CELL, sort=False):
        for st in CONTRAST_STATS:
            m, lo, hi, k = _diff_ci(g[st] - g[f"{st}_ref"], st)
            records.append([name, *key, st, k, m, lo, hi])
    return records


POOLED_COLUMNS = ["intervention", "baseline", "stat", "primary", "n_pairs", "n_cells", "mean", "lo", "hi",
                  "ci_level", "correction", "verdict"]  # fmt: skip
# The pooled intervention analysis's primary statistic when the preset declares none: terminal accuracy (mean
# of the last 3 evals, on test problems nothing selected on), what an intervention against cliffs must keep.
INTERVENTION_PRIMARY = "terminal_mean3"
# The statistics it reports (matrix_schema.json's analysis.interventions.statistic lists the same).
INTERVENTION_STATS = ("terminal_mean3", "gain_heldout", "cliff")
CORRECTIONS = ("bonferroni", "none")  # over the compared interventions


def pooled_interventions(summary: pd.DataFrame, primary: str = INTERVENTION_PRIMARY,
                         interventions: list[str] | None = None, family_alpha: float = 0.05,
                         baseline: str = "none", pair_by: list[str] | None = None,
                         correction: str = "bonferroni") -> pd.DataFrame:  # fmt: skip
    """Each intervention minus the baseline, pooled over every cell and replicate it ran in (POOLED_COLUMNS).

    The arguments are the preset's declaration (matrix.yaml `analysis: {interventions: ...}`: compare =
    `interventions`, statistic = `primary`, baseline, pair_by, correction), made before the runs.
    Pairs: an intervention's run and the `baseline` run that agree on every `pair_by` column (default: workflow,
    sharing, scale, task and the replicate, seed and build where the runs carry one). The mean paired
    difference of each stat (INTERVENTION_STATS, `primary` first) gets a t-interval over the pairs, or
    Tango's paired score interval for the 0/1 cliff flag (stats.tango_ci), at level 1 - family_alpha / m
    with correction "bonferroni", m = the number of interventions compared (all of the table's intervals
    together cover with >= 95%), or 1 - family_alpha with "none". verdict, on the primary stat only:
    "positive" / "negative" when the interval excludes 0, else "inconclusive" (also with < 2 pairs or zero
    width); "" elsewhere. interventions: the names to compare (default: every one present but the baseline,
    which is then no pre-declared family). An intervention declared but absent gets n_pairs 0, still counted
    in m."""
    if primary not in INTERVENTION_STATS:
        raise ValueError(f"primary statistic {primary!r} is not one of {', '.join(INTERVENTION_STATS)}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction {correction!r} is not one of {', '.join(CORRECTIONS)}")
    s = summary[summary["n_evals"] > 0]
    names = interventions or sorted(set(s["intervention"]) - {baseline})
    level = 1 - family_alpha / (max(len(names), 1) if correction == "bonferroni" else 1)
    stats = [primary, *(st for st in INTERVENTION_STATS if st != primary)]
    default = ["workflow", "sharing", "scale", "task", *replicate_keys(s)]
    on = [c for c in (pair_by or default) if c in s.columns]
    ref = s[s["intervention"] == baseline]
    records = []
    for name in names:
        pairs = _paired(s[s["intervention"] == name], ref, on)
        cells = int(pairs[["workflow", "sharing", "scale", "task"]].drop_duplicates().shape[0])
        for st in stats:
            if st == "cliff":  # Tango's paired score interval: Newcombe's paired one errs above its level
                x, y = pairs[st].astype(bool).to_numpy(), pairs[f"{st}_ref"].astype(bool).to_numpy()
                k = len(x)
                m = float(x.mean() - y.mean()) if k else math.nan
                lo, hi = (float(v) for v in tango_ci(int((x & ~y).sum()), int((~x & y).sum()), k, level))
            else:
                m, lo, hi, k = mean_ci(pairs[st].astype(float) - pairs[f"{st}_ref"].astype(float), level)
            v = ""
            if st == primary:
                ok = k >= 2 and math.isfinite(lo) and math.isfinite(hi) and hi - lo > 1e-12
                v = "positive" if ok and lo > 0 else "negative" if ok and hi < 0 else "inconclusive"
            records.append([name, baseline, st, st == primary, k, cells, m, lo, hi, level, correction, v])
    out = pd.DataFrame.from_records(records, columns=POOLED_COLUMNS)
    out["n_pairs"] = out["n_pairs"].astype("int64")
    return out


def contrasts(summary: pd.DataFrame) -> pd.DataFrame:
    """Replicate-matched differences with CIs over replicates (CONTRAST_COLUMNS; a replicate is a seed, or a
    (seed, build) pair when the runs carry a build column; n_pairs counts them).

    sp-ip: per (workflow, scale, task, intervention), SP run minus IP run of the same replicate; sharing
    "sp-ip". sp-agent, ip-agent: the same against the run with one adapter per agent (sharing agent). ma-sa: per (workflow, sharing, scale, task, intervention) of a multi-agent workflow, that run
    minus the `single` run (sharing sp) of the same scale, task, intervention and replicate.
    itv-none: per cell with an intervention, that run minus the run without one (intervention none) of the
    same workflow, sharing, scale, task and replicate: what the intervention changed.
    """
    s = summary[summary["n_evals"] > 0].copy()
    for c in CONTRAST_STATS:
        s[c] = s[c].astype(float)
    sa = baseline()  # the single-agent workflow (WorkflowSpec.baseline)
    multi, single = s[s["workflow"] != sa], s[(s["workflow"] == sa) & (s["sharing"] == "sp")]
    rep = replicate_keys(s)
    same_cell = ["workflow", "sharing", "scale", "task", *rep]
    records = [
        *(r for a, b in (("sp", "ip"), ("sp", "agent"), ("ip", "agent"))
          for r in _differences(f"{a}-{b}", s[s["sharing"] == a].assign(sharing=f"{a}-{b}"), s[s["sharing"] == b],
                                ["workflow", "scale", "task", "intervention", *rep])),
        *_differences("ma-sa", multi, single, ["scale", "task", "intervention", *rep]),
        *_differences("itv-none", s[s["intervention"] != "none"], s[s["intervention"] == "none"], same_cell),
    ]  # fmt: skip
    out = pd.DataFrame.from_records(records, columns=CONTRAST_COLUMNS)
    out["n_pairs"] = out["n_pairs"].astype("int64")
    if out.empty:
        return out
    out = _sort_cells(out)
    out["_c"] = out["contrast"].map({"sp-ip": 0, "sp-agent": 1, "ip-agent": 2, "ma-sa": 3, "itv-none": 4})
    out = out.sort_values(["_c"], kind="stable").drop(columns=["_c"]).reset_index(drop=True)
    return out


# Said once (tables' .md files and report.html) where no cell has two seeds, instead of a column of "n/a".
ONE_SEED_BANNER = (
    "One seed per cell: no confidence interval or verdict (both need >= 2 seeds per cell); each number is one "
    "run. For CIs rerun with seeds: `snakemake --profile profiles/local --config seeds=[0,1,2]` (the default "
    "toy2 matrix: 42 runs, 28 new, on its shipped model); toy world v1's `--config preset=toy_seeds` "
    "trains its 42 and 42 more on a second toy model it builds first (84 runs), so intervals cover the build too."
)


def one_seed(table: pd.DataFrame) -> bool:
    """True when no cell of `table` (summary: runs; summary_by_cell: n_seeds; contrasts: n_pairs) has 2
    replicates (seeds, or (seed, build) pairs)."""
    if "n_seeds" in table.columns:
        return not (table["n_seeds"] >= 2).any()
    if "n_pairs" in table.columns:
        return not (table["n_pairs"] >= 2).any()
    return not (table[[*CELL, *replicate_keys(table)]].drop_duplicates().groupby(CELL).size() >= 2).any()


def fmt_ci(m: float, lo: float, hi: float, digits: int = 3) -> str:
    """'0.612 [0.580, 0.644]'; 'n/a' for a missing CI; '' for a missing mean."""
    if m is None or not math.isfinite(m):
        return ""
    ci = "n/a" if not (math.isfinite(lo) and math.isfinite(hi)) else f"{lo:.{digits}f}, {hi:.{digits}f}"
    return f"{m:.{digits}f} [{ci}]" if ci != "n/a" else f"{m:.{digits}f} [n/a]"


def ci_markdown(cells: pd.DataFrame) -> pd.DataFrame:
    """summary_by_cell as text columns '<mean> [<lo>, <hi>]' (for the .md file); with one seed everywhere
    (`one_seed`) the mean alone, and columns missing in every row left out."""
    out = cells[[*CELL, "n_seeds"]].copy()
    single = one_seed(cells)  # no CI anywhere: the mean alone, and no column that is empty in every row
    for name in CELL_STATS.values():
        vals = cells[[f"{name}_mean", f"{name}_lo", f"{name}_hi"]].to_numpy(float)
        if single and not pd.notna(vals[:, 0]).any():
            continue
        out[name] = [(f"{r[0]:.3f}" if math.isfinite(r[0]) else "") if single else fmt_ci(*r) for r in vals]
    return out


def contrasts_markdown(con: pd.DataFrame) -> pd.DataFrame:
    """contrasts with mean and CI as one text column, a row per (contrast, cell, stat).

    With one seed everywhere (`one_seed`: no CI exists) a row per (contrast, cell) instead, a column per stat
    holding the single difference, and stats that are missing in every row (e.g. peak_confirmed, which
    needs the cross-fitted halves) left out: 18 rows for the toy matrix instead of 144 ending in "n/a".
    """
    if one_seed(con) and len(con):
        stats = [st for st in dict.fromkeys(con["stat"]) if con.loc[con["stat"] == st, "mean"].notna().any()]
        keys, recs = ["contrast", *CELL], []
        for key, g in con.groupby(keys, sort=False, dropna=False):
            by = dict(zip(g["stat"], g["mean"].astype(float)))
            recs.append(
                [*key, *(f"{by[st]:+.3f}" if math.isfinite(by.get(st, math.nan)) else "" for st in stats)]
            )
        return pd.DataFrame(recs, columns=[*keys, *stats])
    out = con[["contrast", *CELL, "stat", "n_pairs"]].copy()
    out["difference"] = [fmt_ci(*r) for r in con[["mean", "lo", "hi"]].to_numpy()]
    return out


SLOT_COLUMNS = [*CELL, "role", "n_runs", "slot_amplification", "slot_cos"]


def slots_by_cell(grads: pd.DataFrame) -> pd.DataFrame:
    """Per cell with a parallel role (Voting's generators, Orch-Workers' workers): that role's run-mean
    slot_amplification and slot_cos (grad_dynamics' `*_mean` columns), as mean [95% CI] over the cell's runs
    (seeds x builds). Under sharing `agent` each slot has its own adapter, so amplification is 1 and slot
    cosine 0 by construction (docs/reference.md, "Sharing units"); SP and IP measure the pile-up.

    grads: grad_dynamics rows (one per run x role). Returns SLOT_COLUMNS, text cells '<mean> [<lo>, <hi>]'."""
    if grads.empty:
        return pd.DataFrame(columns=SLOT_COLUMNS)
    par = grads[[parallel_role(w) == r for w, r in zip(grads["workflow"], grads["role"])]]
    records = []
    for key, g in par.groupby(CELL, sort=False):
        row = [*key, g["role"].iloc[0], int(g["run_id"].nunique())]
        for col in ("slot_amplification_mean", "slot_cos_mean"):
            m, lo, hi, _ = mean_ci(g[col].dropna().astype(float))
            row.append(fmt_ci(m, lo, hi))
        records.append(row)
    return _sort_cells(pd.DataFrame.from_records(records, columns=SLOT_COLUMNS))
