"""Where a report's numbers come from: git commit, package versions, the CPU and its kernels, the toy model.

`provenance_section` renders them for the overview page; the machine facts come from each run's
environment.jsonl (marlflow.training.environment).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from marlflow.analysis.curves import wide
from marlflow.analysis.plots import (
    step_time_table,
)
from marlflow.core.config import TOY_SCALES
from marlflow.core.definitions import TOY_BASE_BAND
from marlflow.report.findings import band_warning
from marlflow.report.html import duration, kv_table
from marlflow.training import environment


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """HEAD of the repository the report is built in ('+ uncommitted changes' when tracked files differ), or
    'unknown (not a git checkout)' (environment.source_commit)."""
    commit = environment.source_commit(cwd or os.getcwd())
    if not commit:
        return "unknown (not a git checkout)"
    return commit.replace("+dirty", " + uncommitted changes")


def package_versions() -> dict[str, str]:
    """Python and the installed versions of PACKAGES ('not installed' when absent)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


CPU_FEATURES = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX512", "avx2": "AVX2"}


def cpu_text(model: str, flags: Sequence[str]) -> str:
    """'Intel(R) Xeon(R) Processor (AMX, AVX512-BF16, AVX512, AVX2)' from a CPU model and its flags."""
    have = [name for flag, name in CPU_FEATURES.items() if flag in set(flags)]
    return f"{model or 'unknown CPU'} ({', '.join(have) or 'no AVX2'})"


def machine_provenance(run_info: dict[str, dict]) -> list[tuple[str, str]]:
    """Where the runs trained: one line per distinct environment their environment.jsonl records
    (marlflow.training.environment: CPU and its kernels, torch, GPU, hosts); for runs that recorded none (trained before
    it existed) the CPU, kernels and torch of the machine the report is built on (toybuild.cpu_info)."""
    import torch

    from marlflow.models.toybuild import cpu_info  # imports torch: only when a report is built

    envs, unrecorded = environment.distinct(
        {rid: i["folder"] for rid, i in run_info.items() if i.get("folder") is not None}
    )
    unrecorded += [rid for rid, i in run_info.items() if i.get("folder") is None]
    out = []
    for e in envs:
        gpu = f"; GPU {e['cuda_device']}" if e.get("cuda_device") else ""
        out.append((
            f"CPU where {len(e['runs'])} of {len(run_info)} runs trained (environment.jsonl)",
            f"{cpu_text(e['cpu_model'], e['cpu_flags'])}; torch kernels: {e['torch_cpu_capability']}; "
            f"torch {e['torch']}{gpu}; {e['torch_threads']} torch thread(s); hosts {', '.join(e['hosts'])}",
        ))  # fmt: skip
    if unrecorded or not envs:  # the runs' own machine only if the matrix ran where the report is built
        info = cpu_info()
        out += [
            ("CPU (where the report was built)", cpu_text(info["cpu_model"], info["cpu_flags"])
             + f"; torch kernels: {torch.backends.cpu.get_cpu_capability()}"),
            ("torch (where the report was built)", torch.__version__),
        ]  # fmt: skip
        if envs:
            out.append(("runs that recorded no environment.jsonl", ", ".join(sorted(unrecorded))))
    return out


def toy_model_provenance(run_info: dict[str, dict]) -> list[tuple[str, str]]:
    """Per toy model (a scale in TOY_SCALES) the runs used (config.json `model`, a folder with
    warmstart.json): its weights_sha256, the CPU, torch version and threads it was built with, and whether it is
    the model marlflow ships for that scale (marlflow.models.loading.toy_world)."""
    from marlflow.models.loading import toy_world

    folders = sorted({(str(i["config"]["model"]), str(i["config"]["scale"])) for i in run_info.values()
                      if i["config"].get("scale") in TOY_SCALES and i["config"].get("model")})  # fmt: skip
    out = []
    for folder, scale in folders:
        ws = read_json(Path(folder) / "warmstart.json")
        h = ws.get("weights_sha256")
        if not h:
            out.append(
                (f"{scale} model {folder}", "no warmstart.json with weights_sha256 there (moved or deleted)")
            )
            continue
        shipped = read_json(toy_world(scale).shipped / "warmstart.json").get("weights_sha256")
        same = (
            "the model marlflow ships" if h == shipped
            else f"not the shipped model ({str(shipped)[:16]}...): rebuilt, so its numbers can differ"
        )  # fmt: skip
        out.append((
            f"{scale} model {folder}",
            f"weights_sha256 {h}, {same}; built on {cpu_text(ws.get('cpu_model', ''), ws.get('cpu_flags', []))}"
            f" with torch {ws.get('torch', '?')}, {ws.get('threads', '?')} threads",
        ))  # fmt: skip
    return out


def provenance_section(
    run_info: dict[str, dict], metrics: pd.DataFrame, commit: str, summary: pd.DataFrame
) -> list[str]:
    cfgs = [i["config"] for i in run_info.values() if i["config"]]
    threads = sorted({str(c["threads"]) for c in cfgs if c.get("threads") is not None}, key=int)
    presets = sorted({str(c.get("preset")) for c in cfgs if c.get("preset")})
    models = sorted({f"{c.get('scale')}: {c.get('model')}" for c in cfgs if c.get("model")})
    secs = train_seconds(metrics)
    steps = wide(metrics, "train", "all", ["step_time"]).groupby("run_id")["step"].max()
    pairs = [
        ("preset", ", ".join(presets) or "unknown (no config.json beside the metrics)"),
        ("runs", metrics["run_id"].nunique()),
        ("train steps per run", ", ".join(sorted({str(int(s)) for s in steps})) or "not logged"),
        ("models", "; ".join(models) or "unknown"),
        ("git commit (when the report was built)", commit),
        (
            "training wall time (sum of step_time over runs; evals and model loading excluded)",
            f"{duration(float(secs.sum()))} total; per run {duration(float(secs.min()))} to "
            f"{duration(float(secs.max()))}"
            if len(secs)
            else "not logged",
        ),
        ("evaluation wall time (sum of time_eval over runs)", eval_time_text(metrics, float(secs.sum()))),
        *machine_provenance(run_info),
        ("torch threads per run (config.json)", ", ".join(threads) or "unknown"),
        *toy_model_provenance(run_info),
    ]
    if summary["scale"].isin(TOY_SCALES).any():
        lo, hi = TOY_BASE_BAND
        n = int(summary["base"][summary["scale"].isin(TOY_SCALES)].notna().sum())
        pairs.append(
            (f"toy bases in the designed band [{lo:.2f}, {hi:.2f}]", band_warning(summary) or f"all {n}")
        )
    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    return ["<h2 id='provenance'>Provenance</h2>", kv_table([*pairs, ("package versions", versions)])]


def train_seconds(metrics: pd.DataFrame) -> pd.Series:
    """Sum of step_time per run (train split, role all): the time inside training steps, evals excluded."""
    t = step_time_table(metrics)
    return t.groupby("run_id")["step_time"].sum()


def eval_time_text(metrics: pd.DataFrame, train_s: float) -> str:
    """Total evaluation time and its share of training plus evaluation (runs that log `time_eval`)."""
    t = metrics[
        (metrics["split"] == "eval") & (metrics["role"] == "all") & (metrics["metric"] == "time_eval")
    ]
    if t.empty:
        return "not logged"
    ev = float(t["value"].sum())
    return f"{duration(ev)} total, {ev / (ev + train_s):.0%} of training plus evaluation"


PACKAGES = ["marlflow", "torch", "transformers", "trl", "peft", "accelerate", "vllm", "snakemake", "pandas",
            "matplotlib"]  # fmt: skip


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or rerun the job that writes it") from e
    return obj if isinstance(obj, dict) else {}
