"""Per-problem paired tables from the runs' outcomes.parquet: SP vs IP, intervention vs none, peak vs terminal.

    pairs = paired_contrasts(outcomes, summary, declared)   # PAIRED_COLUMNS, one row per contrast x cell x at
    cliffs = paired_cliffs(outcomes, summary)              # PAIRED_CLIFF_COLUMNS, one row per run

Every evaluation scores the same test problems, so two arms are compared problem by problem within each
replicate (seed, build) and combined over replicates (marlflow.core.paired.paired_diff: the crossed
problem x replicate variance, stratified exact McNemar). `at` is where each run is read: "heldout" (the step
its validation accuracy chose, summary.peak_heldout_step: nothing selects on test outcomes) or "terminal"
(its last evaluation). Rows per (workflow, scale, task, intervention) cell and pooled over workflows per
(scale, task) ("all": the workflows' differences averaged per problem within each replicate, so the
workflows are fixed, not replicates; p pools every workflow's pairs). The intervals are corrected for the number of rows of the declared primary `at`
(Bonferroni, or as declared: matrix.yaml `analysis: {paired: ...}`, checked by `check_declared`); `verdict`
says "a higher", "b higher" or "no difference shown" (a is the contrast's first arm: sp in sp-ip), and
"descriptive" on rows of the other `at`.

The paired cliff test of one run: its test outcomes at the validation-chosen step against its terminal
evaluation on the same problems, one-sided exact McNemar; a cliff when the drop is at least MIN_GAP and p <
ALPHA. The peak is chosen on validation, so there is no maximum over steps to correct for, and pairing uses
the measured correlation between the two evaluations (`corr`) instead of assuming independent binomials.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from marlflow.analysis.seeds import replicate_keys
from marlflow.core.definitions import ALPHA, CI_LEVEL, MIN_GAP, TOL
from marlflow.core.paired import mcnemar_exact, paired_diff

PAIRED_COLUMNS = ["contrast", "a", "b", "at", "workflow", "scale", "task", "intervention", "n_rep", "n_prob",
                  "acc_a", "acc_b", "diff", "lo", "hi", "p", "corr", "ci_level", "verdict"]  # fmt: skip
PAIRED_CLIFF_COLUMNS = ["run_id", "workflow", "sharing", "scale", "task", "seed", "build", "intervention",
                        "peak_step", "terminal_step", "acc_peak", "acc_terminal", "drop", "p", "corr",
                        "cliff_paired"]  # fmt: skip
AT = ("heldout", "terminal")
CORRECTIONS = ("bonferroni", "none")
# matrix.yaml `analysis: {paired: {...}}`: what may be declared, and the defaults when nothing is.
PAIRED_DEFAULTS = {"contrasts": ["sp-ip", "sp-agent", "ip-agent", "itv-none"], "primary": "heldout", "correction": "bonferroni",
                   "alpha": 1 - CI_LEVEL, "mde": None}  # fmt: skip
CONTRASTS = ("sp-ip", "sp-agent", "ip-agent", "itv-none")
# The sharing contrasts: a-b compares sharing a with sharing b within each cell (no rows without both arms).
SHARING_CONTRASTS = ("sp-ip", "sp-agent", "ip-agent")


def check_declared(d: object) -> None:
    """Raise ValueError naming what is wrong unless `d` is a valid `paired` declaration (PAIRED_DEFAULTS'
    keys: contrasts among CONTRASTS, primary among AT, correction among CORRECTIONS, 0 < alpha < 1, mde a
    number in (0, 1] or null: the smallest difference the preset was sized to detect)."""
    if not isinstance(d, dict):
        raise ValueError(f"paired must be a mapping, got {d!r}")
    unknown = set(d) - set(PAIRED_DEFAULTS)
    if unknown:
        raise ValueError(f"paired takes only {', '.join(PAIRED_DEFAULTS)}; unknown {sorted(unknown)}")
    bad = [c for c in d.get("contrasts", []) if c not in CONTRASTS]
    if bad or not isinstance(d.get("contrasts", []), list):
        raise ValueError(
            f"paired.contrasts must list some of {', '.join(CONTRASTS)}; got {d.get('contrasts')!r}"
        )
    if d.get("primary", "heldout") not in AT:
        raise ValueError(f"paired.primary must be one of {', '.join(AT)}, got {d['primary']!r}")
    if d.get("correction", "bonferroni") not in CORRECTIONS:
        raise ValueError(
            f"paired.correction must be one of {', '.join(CORRECTIONS)}, got {d['correction']!r}"
        )
    alpha = d.get("alpha", 0.05)
    if not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"paired.alpha must be a number in (0, 1), got {alpha!r}")
    mde = d.get("mde")
    if mde is not None and (not isinstance(mde, int | float) or not 0 < mde <= 1):
        raise ValueError(f"paired.mde must be a number in (0, 1] or null, got {mde!r}")


def _read_at(outcomes: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Test-split outcomes of every run at its validation-chosen step ("heldout") and at its last evaluation
    ("terminal"): outcomes rows with a column `at` (a run whose summary has no held-out step has no heldout
    rows)."""
    test = outcomes[outcomes["split"] == "eval"]
    last = test.groupby("run_id")["step"].max().rename("terminal_step")
    steps = summary[["run_id", "peak_heldout_step"]].merge(last, on="run_id")
    out = []
    for at, col in (("heldout", "peak_heldout_step"), ("terminal", "terminal_step")):
        chosen = steps.dropna(subset=[col]).astype({col: "int64"})
        rows = test.merge(chosen[["run_id", col]], left_on=["run_id", "step"], right_on=["run_id", col])
        out.append(rows.drop(columns=[col]).assign(at=at))
    return pd.concat(out, ignore_index=True) if out else test.assign(at=pd.Series(dtype=str))


def _arms(read: pd.DataFrame, keys: list[str], a: pd.Series, b: pd.Series, pool: list[str] = ()):
    """(R, P) outcome matrices of arms a and b (row masks of `read`), paired on `keys` + uid, and the
    stratified exact McNemar p over every pair; None when no replicate has both arms. pool: columns of `keys`
    averaged out per problem within each replicate (a pooled row's workflows, an intervention row's sharing
    modes: fixed levels, not replicates)."""
    cols = [*keys, "uid"]
    left = read[a][[*cols, "correct"]].astype({"correct": float})
    right = read[b][[*cols, "correct"]].astype({"correct": float})
    both = left.merge(right, on=cols, suffixes=("_a", "_b"))
    if both.empty:
        return None
    rep = both.set_index(keys).index
    wide_a = both.assign(rep=list(rep)).pivot_table(
        index="rep", columns="uid", values="correct_a", aggfunc="first"
    )
    wide_b = both.assign(rep=list(rep)).pivot_table(
        index="rep", columns="uid", values="correct_b", aggfunc="first"
    )
    keep = wide_a.notna().all(axis=0) & wide_b.notna().all(axis=0)  # problems every replicate scored in both
    wide_a, wide_b = wide_a.loc[:, keep], wide_b.loc[:, keep]
    x, y = wide_a.to_numpy(float), wide_b.to_numpy(float)
    p = mcnemar_exact(int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum()))
    if pool:  # mean over the pooled columns' levels, per replicate and problem
        rest = [i for i, k in enumerate(keys) if k not in pool]
        by = pd.Series([repr(tuple(k[i] for i in rest)) for k in wide_a.index], index=wide_a.index)
        wide_a = wide_a.groupby(by, sort=True).mean()
        wide_b = wide_b.groupby(by, sort=True).mean()
    return wide_a.to_numpy(float), wide_b.to_numpy(float), p


def _contrast_groups(read: pd.DataFrame, contrast: str):
    """(label a, label b, group keys, mask a, mask b, extra pairing keys) for each comparison of `contrast`."""
    if contrast in SHARING_CONTRASTS:
        a, b = contrast.split("-")
        yield a, b, ["intervention"], read["sharing"].eq(a), read["sharing"].eq(b), []
    else:  # itv-none: each intervention against none, within sharing
        for itv in sorted(set(read["intervention"]) - {"none"}):
            yield itv, "none", [], read["intervention"].eq(itv), read["intervention"].eq("none"), ["sharing"]


def paired_contrasts(
    outcomes: pd.DataFrame, summary: pd.DataFrame, declared: dict | None = None
) -> pd.DataFrame:
    """PAIRED_COLUMNS rows (the module docstring); empty without outcomes. declared: matrix.yaml's
    `analysis.paired` (PAIRED_DEFAULTS fill what it leaves out)."""
    d = {**PAIRED_DEFAULTS, **(declared or {})}
    if outcomes is None or outcomes.empty or summary.empty:
        return pd.DataFrame(columns=PAIRED_COLUMNS)
    read = _read_at(outcomes, summary)
    reps = replicate_keys(read)
    records = []
    for contrast in d["contrasts"]:
        for la, lb, fixed, ma, mb, extra in _contrast_groups(read, contrast):
            for at in AT:
                for pooled in (False, True):
                    by = ["scale", "task", *fixed] + ([] if pooled else ["workflow"])
                    sub_at = read["at"].eq(at)
                    for key, g in read[sub_at & (ma | mb)].groupby(by, sort=True):
                        cell = dict(zip(by, key if isinstance(key, tuple) else (key,)))
                        pair_on = [*reps, *extra] + (["workflow"] if pooled else [])
                        if contrast in SHARING_CONTRASTS:
                            pair_on = [c for c in pair_on if c != "sharing"]
                        fixed_levels = [c for c in pair_on if c not in reps]
                        got = _arms(g, pair_on, ma[g.index], mb[g.index], fixed_levels)
                        if got is None:
                            continue
                        records.append({"contrast": contrast, "a": la, "b": lb, "at": at,
                                        "workflow": "all" if pooled else cell["workflow"], "scale": cell["scale"],
                                        "task": cell["task"],
                                        "intervention": cell.get("intervention", "" if contrast in SHARING_CONTRASTS else la),
                                        "arrays": got})  # fmt: skip
    if not records:
        return pd.DataFrame(columns=PAIRED_COLUMNS)
    # Correction over the rows of the declared primary `at` (the rows verdicts are read from).
    m = sum(r["at"] == d["primary"] for r in records)
    alpha = d["alpha"] / m if d["correction"] == "bonferroni" and m else d["alpha"]
    out = []
    for r in records:
        a, b, p_value = r.pop("arrays")
        primary = r["at"] == d["primary"]
        level = 1 - (alpha if primary else d["alpha"])
        s = {**paired_diff(a, b, level), "p": p_value}
        out.append({**r, "n_rep": s["n_rep"], "n_prob": s["n_prob"], "acc_a": float(a.mean()),
                    "acc_b": float(b.mean()), "diff": s["diff"], "lo": s["lo"], "hi": s["hi"], "p": s["p"],
                    "corr": s["corr"], "ci_level": level,
                    "verdict": _verdict(s, r["a"], r["b"]) if primary else "descriptive"})  # fmt: skip
    df = pd.DataFrame(out, columns=PAIRED_COLUMNS)
    return df.sort_values(["contrast", "a", "at", "scale", "task", "workflow", "intervention"], kind="stable",
                          ignore_index=True)  # fmt: skip


def _verdict(s: dict, a: str, b: str) -> str:
    if not (math.isfinite(s["lo"]) and math.isfinite(s["hi"])):
        return "no difference shown"
    if s["lo"] > 0:
        return f"{a} higher"
    if s["hi"] < 0:
        return f"{b} higher"
    return "no difference shown"


def paired_cliffs(outcomes: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """PAIRED_CLIFF_COLUMNS, one row per run with a held-out step (the module docstring)."""
    if outcomes is None or outcomes.empty or summary.empty:
        return pd.DataFrame(columns=PAIRED_CLIFF_COLUMNS)
    read = _read_at(outcomes, summary)
    out = []
    for rid, g in read.groupby("run_id", sort=True):
        peak, term = g[g["at"] == "heldout"], g[g["at"] == "terminal"]
        if peak.empty or term.empty:
            continue
        both = peak[["uid", "correct"]].merge(term[["uid", "correct"]], on="uid", suffixes=("_p", "_t"))
        x, y = both["correct_p"].to_numpy(bool), both["correct_t"].to_numpy(bool)
        n10, n01 = int((x & ~y).sum()), int((~x & y).sum())
        drop = float(x.mean() - y.mean())
        p = mcnemar_exact(n10, n01, "greater")
        corr = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else math.nan
        first = g.iloc[0]
        out.append({"run_id": rid, **{c: first[c] for c in PAIRED_CLIFF_COLUMNS[1:8]},
                    "peak_step": int(peak["step"].iloc[0]), "terminal_step": int(term["step"].iloc[0]),
                    "acc_peak": float(x.mean()), "acc_terminal": float(y.mean()), "drop": drop, "p": p,
                    "corr": corr, "cliff_paired": bool(drop >= MIN_GAP - TOL and p < ALPHA)})  # fmt: skip
    return pd.DataFrame(out, columns=PAIRED_CLIFF_COLUMNS)


def paired_markdown(pairs: pd.DataFrame, declared: dict | None = None) -> str:
    """paired.md: what was compared and how, then the table (the primary rows first)."""
    from marlflow.analysis.tables import markdown_table

    d = {**PAIRED_DEFAULTS, **(declared or {})}
    how = ("Declared in the preset before the runs (matrix.yaml analysis.paired)" if declared else
           "Not declared in the preset: the defaults (marlflow.analysis.paired.PAIRED_DEFAULTS)")  # fmt: skip
    head = (
        f"Per-problem paired differences a - b on the test problems, paired by problem within each replicate "
        f"and combined over replicates (marlflow.core.paired.paired_diff: problem and replicate variance; p: "
        f"stratified exact McNemar). {how}: primary `at` {d['primary']} (the step validation chose), "
        f"correction {d['correction']} over its rows; the other `at` is descriptive. "
    )
    several = not pairs.empty and int(pairs["n_rep"].max()) > 1
    head += (
        "Several replicates: the interval covers problem and replicate (seed, build) variance."
        if several
        else "One replicate: the interval covers the problems only, not seed variance."
    )
    if d.get("mde"):
        head += f" The preset was sized to detect a difference of {d['mde']:.3g}."
    if pairs.empty:
        return head + "\n\nNo paired outcomes (runs without outcomes.parquet, or no pairs).\n"
    shown = pairs.assign(primary=pairs["at"].ne(d["primary"])).sort_values("primary", kind="stable")
    return f"{head}\n\n{markdown_table(shown.drop(columns=['primary']), index=False)}"
