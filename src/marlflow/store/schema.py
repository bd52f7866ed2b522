"""The tidy metrics schema: columns, types, validation, and the metrics/samples readers and writers.

Every run writes one long table, `metrics.parquet`, whose columns carry the factors of its cell so that
aggregation never parses a path:

    run_id, workflow, sharing, scale, task, seed, intervention, step, split, role, metric, value

`split` is "train", "eval" (the test problems) or "val" (validation problems, marlflow.tasks.splits); `role`
is a role type ("generator", "evaluator", ...) or "all" for workflow-level numbers. New metrics are new rows, never new columns.

Files are written through `marlflow.store.atomic`, so a killed job leaves either the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import pandas as pd
import pyarrow as pa

from marlflow.store.atomic import atomic_write_parquet

# build: the toy model's build seed (matrix axis `build`); tables written before it existed read as build 0.
FACTOR_COLUMNS = ["run_id", "workflow", "sharing", "scale", "task", "seed", "build", "intervention"]
INT_COLUMNS = ("seed", "build", "step")
METRIC_COLUMNS = [*FACTOR_COLUMNS, "step", "split", "role", "metric", "value"]
SPLITS = ("train", "eval", "val")  # val: the validation evaluation (task.val_size, marlflow.tasks.splits)
# Metrics that depend on when and beside what a run ran, not on what it computed: wall-clock seconds, and
# eval_reused (1 when step 0's evaluation was read from another run of the cell, marlflow.training.base_eval). Resume
# and re-evaluation compare everything but these.
VOLATILE_METRICS = ("step_time", "time_generate", "time_score", "time_backward", "time_other", "time_eval",
                    "eval_reused")  # fmt: skip
# samples.parquet: a few full eval episodes per evaluation, one row per role call.
SAMPLE_COLUMNS = [*FACTOR_COLUMNS, "step", "episode", "uid", "slot", "role", "prompt", "output", "reward",
                  "format_failure"]  # fmt: skip
# outcomes.parquet: every evaluation's per-problem outcome, one row per (step, split, problem), what paired
# inference needs (marlflow.analysis.paired: SP vs IP on the same problems, peak vs terminal of one run).
# reward: the episode's reward; correct: full reward; completion_tokens: summed over the episode's calls;
# calls / truncated_calls / format_failures: counts over its calls (truncated: cut at the completion budget);
# finish_reason: "length" when any call was truncated, else "stop"; candidates / candidates_correct: the
# parallel role's candidate answers and how many were right (Voting, Orch-Workers, test split only; 0 / 0
# elsewhere); rounds: Eval-Opt's generator rounds (1 elsewhere).
OUTCOME_COLUMNS = [*FACTOR_COLUMNS, "step", "split", "uid", "reward", "correct", "completion_tokens", "calls",
                   "truncated_calls", "format_failures", "finish_reason", "candidates", "candidates_correct",
                   "rounds"]  # fmt: skip
OUTCOME_INTS = ("seed", "build", "step", "completion_tokens", "calls", "truncated_calls", "format_failures",
                "candidates", "candidates_correct", "rounds")  # fmt: skip

SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("workflow", pa.string()),
        ("sharing", pa.string()),
        ("scale", pa.string()),
        ("task", pa.string()),
        ("seed", pa.int64()),
        ("build", pa.int64()),
        ("intervention", pa.string()),
        ("step", pa.int64()),
        ("split", pa.string()),
        ("role", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
    ]
)


def with_build(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with a `build` column: tables written before the build axis existed are build 0 (the shipped toy
    model, or a fixed model at other scales)."""
    if "build" in df.columns or "seed" not in df.columns:
        return df
    return df.assign(build=0)


def validate_metrics(df: pd.DataFrame) -> pd.DataFrame:
    """Return `df` with the schema's columns and dtypes; raise ValueError naming what is wrong."""
    df = with_build(df)
    missing = [c for c in METRIC_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"metrics table lacks columns {missing}; expected {METRIC_COLUMNS}")
    extra = [c for c in df.columns if c not in METRIC_COLUMNS]
    if extra:
        raise ValueError(f"metrics table has unexpected columns {extra}; new metrics are rows, not columns")
    bad = set(df["split"].unique()) - set(SPLITS)
    if bad:
        raise ValueError(f"metrics split must be one of {SPLITS}, got {sorted(bad)}")
    out = df[METRIC_COLUMNS].copy()
    for col in INT_COLUMNS:
        out[col] = out[col].astype("int64")
    out["value"] = out["value"].astype("float64")
    for col in METRIC_COLUMNS:
        if col not in (*INT_COLUMNS, "value"):
            out[col] = out[col].astype(str)
    return out


def write_metrics(df: pd.DataFrame, path: str | os.PathLike) -> None:
    atomic_write_parquet(validate_metrics(df), path, schema=SCHEMA)


def outcomes_frame(records: Iterable[Mapping] | pd.DataFrame) -> pd.DataFrame:
    """Outcome rows (OUTCOME_COLUMNS; records or a frame) as a frame with fixed dtypes (an empty one has them
    too): counts int64, reward float64, correct bool, the rest strings; dictionary-encoded in parquet, so a
    run's file stays small."""
    if isinstance(records, pd.DataFrame):
        df = with_build(records).reindex(columns=OUTCOME_COLUMNS)
    else:
        df = pd.DataFrame(list(records), columns=OUTCOME_COLUMNS)
    for col in OUTCOME_COLUMNS:
        if col in OUTCOME_INTS:
            df[col] = df[col].astype("int64")
        elif col == "reward":
            df[col] = df[col].astype("float64")
        elif col == "correct":
            df[col] = df[col].astype(bool)
        else:
            df[col] = df[col].astype(str)
    return df


def write_outcomes(records: Iterable[Mapping], path: str | os.PathLike) -> None:
    """Write outcome rows to `path` atomically (see outcomes_frame)."""
    atomic_write_parquet(outcomes_frame(records), path)


def read_metrics(paths: Iterable[str | os.PathLike]) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in paths]
    if not frames:
        return pd.DataFrame(
            {c: pd.Series(dtype=f.type.to_pandas_dtype()) for c, f in zip(METRIC_COLUMNS, SCHEMA)}
        )
    return validate_metrics(pd.concat(frames, ignore_index=True))


def rows(
    factors: Mapping[str, object], step: int, split: str, role: str, values: Mapping[str, float]
) -> list[dict]:
    """Long-format rows for one (step, split, role): one row per metric name. Factors without a `build` are
    build 0 (every model but a rebuilt toy one)."""
    factors = {"build": 0, **factors}
    base = {c: factors[c] for c in FACTOR_COLUMNS}
    return [
        {**base, "step": int(step), "split": split, "role": role, "metric": k, "value": float(v)}
        for k, v in values.items()
    ]
