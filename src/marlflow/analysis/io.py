"""Loading run outputs for analysis: metrics.parquet files plus the samples.parquet and outcomes.parquet beside each.

    metrics, samples = load_runs(["results/runs/voting-ip-toy-math-s0/metrics.parquet", ...])
    outcomes = load_outcomes([...the same paths...])

Errors name the offending file. Duplicate metric rows (a resumed run re-logging a step) keep the last one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pyarrow as pa

from marlflow.store.schema import (
    FACTOR_COLUMNS,
    METRIC_COLUMNS,
    SAMPLE_COLUMNS,
    outcomes_frame,
    read_metrics,
    with_build,
)

METRIC_KEY = ["run_id", "step", "split", "role", "metric"]


def empty_samples() -> pd.DataFrame:
    """A samples table with the expected columns and no rows."""
    return pd.DataFrame({c: pd.Series(dtype=object) for c in SAMPLE_COLUMNS})


def read_samples(path: str | os.PathLike) -> pd.DataFrame:
    """Read one samples.parquet; ValueError naming the file and the missing columns if it does not fit."""
    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read samples table: {e}") from e
    df = with_build(df)
    missing = [c for c in SAMPLE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: samples table lacks columns {missing}; expected {SAMPLE_COLUMNS}")
    out = df[SAMPLE_COLUMNS].copy()
    out["step"] = out["step"].astype("int64")
    out["output"] = out["output"].fillna("").astype(str)
    out["role"] = out["role"].astype(str)
    out["run_id"] = out["run_id"].astype(str)
    return out


def check_metrics(metrics: pd.DataFrame) -> pd.DataFrame:
    """Deduplicate (keep last) and sort a validated metrics table; ValueError if a run's factors disagree."""
    factors = metrics[FACTOR_COLUMNS].drop_duplicates()
    dup = factors["run_id"][factors["run_id"].duplicated()]
    if len(dup):
        raise ValueError(
            f"run(s) {sorted(set(dup))} have rows with different factor values {FACTOR_COLUMNS[1:]}"
        )
    out = metrics.drop_duplicates(METRIC_KEY, keep="last")
    return out.sort_values(METRIC_KEY, kind="stable").reset_index(drop=True)[METRIC_COLUMNS]


def _one_run_per_cell_and_seed(metrics: pd.DataFrame) -> None:
    """Raise ValueError if two runs have the same factors (cell and seed): the tables would count them as one
    cell's seeds twice. It happens when runs of two presets with different `tag:`s are passed together (toy's
    `voting-ip-toy-math-s0` and toy_long's `voting-ip-toy-math-s0-long`)."""
    factors = [c for c in FACTOR_COLUMNS if c != "run_id"]
    runs = metrics[FACTOR_COLUMNS].drop_duplicates()
    clash = runs[runs.duplicated(factors, keep=False)]
    if not clash.empty:
        first = clash.iloc[0]
        same = clash[(clash[factors] == first[factors]).all(axis=1)]["run_id"].tolist()
        cell = ", ".join(f"{c} {first[c]}" for c in factors)
        raise ValueError(
            f"runs {same} are the same cell and seed ({cell}); they come from presets with different tags and "
            "would be counted as one cell's seeds twice. Aggregate one preset's runs at a time (e.g. only "
            "results/runs/*-long*/metrics.parquet for toy_long)"
        )


def load_outcomes(paths: Iterable[str | os.PathLike]) -> pd.DataFrame:
    """The outcomes.parquet beside each metrics.parquet path, concatenated (OUTCOME_COLUMNS; runs trained
    before outcomes were kept have none and are left out; an empty frame when no run has them)."""
    frames = [pd.read_parquet(q) for p in paths if (q := Path(p).with_name("outcomes.parquet")).is_file()]
    return outcomes_frame(pd.concat(frames, ignore_index=True) if frames else [])


def load_runs(paths: Iterable[str | os.PathLike]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read metrics.parquet files (and samples.parquet beside each, if present) into two tables.

    Raises ValueError for an empty list, a file that is not a metrics table, an empty table, a run id that
    appears in two files or two runs of the same cell and seed; FileNotFoundError for a missing path.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no runs given: pass at least one metrics.parquet path")
    frames, sample_frames, seen = [], [], {}
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"metrics file not found: {p}")
        try:
            df = read_metrics([p])
        except (OSError, ValueError, pa.ArrowException) as e:
            raise ValueError(f"{p}: not a valid metrics table: {e}") from e
        if df.empty:
            raise ValueError(f"{p}: metrics table has no rows")
        for run_id in sorted(df["run_id"].unique()):
            if run_id in seen:
                raise ValueError(f"run {run_id!r} appears in both {seen[run_id]} and {p}")
            seen[run_id] = p
        frames.append(df)
        sp = p.with_name("samples.parquet")
        if sp.is_file():
            sample_frames.append(read_samples(sp))
    metrics = check_metrics(pd.concat(frames, ignore_index=True))
    _one_run_per_cell_and_seed(metrics)
    if sample_frames:
        samples = pd.concat(sample_frames, ignore_index=True)
        samples = samples.sort_values(["run_id", "step", "episode", "slot"], kind="stable").reset_index(
            drop=True
        )
    else:
        samples = empty_samples()
    return metrics, samples
