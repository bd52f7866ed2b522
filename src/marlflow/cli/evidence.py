"""Results as data: committed result files with their provenance, and the tables the docs quote, regenerated.

An experiment's evidence is a folder results/evidence/<experiment>/ holding
    metrics.parquet    every run's metrics rows (marlflow.store.schema schema), the data everything is computed from
    summary.parquet    the aggregate's per-run summary of those runs, as the run's pipeline wrote it
    provenance.json    commit, toy weights hash, command, the runs' threads, and where they trained:
                       environments     each distinct environment the runs trained in (their
                                        environment.jsonl lines, marlflow.training.environment, less step, time and
                                        host names): its fields, the hosts and the run ids that used it
                       unrecorded_runs  runs without environment.jsonl (trained before it existed)
                       cpu, torch, omp_num_threads, python: the collecting machine, which is the runs' own
                                        only where they trained there; for unrecorded runs it is all there is
                                        (cpu's flags: toybuild.cpu_info's kernel flags; folders collected
                                        before it list avx2, avx512f, avx512_bf16, amx_bf16, amx_tile only)
    outcomes.parquet   every run's per-problem outcomes (marlflow.store.schema.OUTCOME_COLUMNS), where the runs
                       kept them
    tables/<name>.md   the tables rendered from metrics.parquet (summary, summary_by_cell, contrasts, claims,
                       interventions, slots: the parallel role's slot amplification per cell) and outcomes.parquet
                       (paired, paired_cliffs), exactly as `render` writes them

    python -m marlflow evidence collect toy_slice --results /path/to/worktree/results \\
        --command "snakemake --profile profiles/local --config preset=toy workflows=[single,voting] tasks=[math]"
    python -m marlflow evidence render toy_slice          # (re)write tables/*.md from the data
    python -m marlflow evidence render toy_slice --check  # exit 1 if a committed table differs

Docs quote a table between `<!-- evidence: EXPERIMENT/NAME.md -->` and `<!-- /evidence -->`;
tests/test_analysis.py regenerates every quoted table from the committed data and compares it with the quote,
and with tables/<name>.md. Only runs of the code at the recorded commit belong in a folder (provenance.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

from marlflow.store.atomic import atomic_write_json, atomic_write_parquet, atomic_write_text
from marlflow.store.schema import validate_metrics
from marlflow.training import environment

ROOT = Path(__file__).resolve().parents[3]
EVIDENCE = ROOT / "results" / "evidence"
TABLES = ("summary", "summary_by_cell", "contrasts", "claims", "interventions", "slots")
QUOTE = re.compile(r"<!-- evidence: ([\w.-]+)/([\w.-]+)\.md -->\n(.*?)<!-- /evidence -->", re.S)


def cpu() -> dict:
    """This (the collecting) machine's CPU: model name, kernel-relevant flags (toybuild.cpu_info) and cores."""
    from marlflow.models.toybuild import cpu_info  # imports torch: only when collecting

    info = cpu_info()
    return {"model": info["cpu_model"], "flags": info["cpu_flags"], "cores": os.cpu_count()}


def tables_of(
    metrics: pd.DataFrame, outcomes: pd.DataFrame | None = None, analysis: dict | None = None
) -> dict[str, str]:
    """name -> markdown of each TABLES table, computed from metrics rows by the aggregate step's code; with
    per-problem outcomes also "paired" and "paired_cliffs" (analysis.paired; analysis: the preset's declared
    analyses as provenance.json records them)."""
    from marlflow.analysis import markdown_table
    from marlflow.analysis.aggregate import build_tables
    from marlflow.analysis.paired import paired_markdown
    from marlflow.analysis.seeds import ci_markdown, contrasts_markdown, slots_by_cell

    t = build_tables(metrics, analysis, outcomes)
    shown = {
        "summary": t["summary"],
        "summary_by_cell": ci_markdown(t["summary_by_cell"]),
        "contrasts": contrasts_markdown(t["contrasts"]),
        "claims": t["claims"].drop(columns=["rule"]),
        "interventions": t["interventions"],
        "slots": slots_by_cell(t["grad_dynamics"]),
    }
    out = {name: markdown_table(df, index=False) for name, df in shown.items()}
    if outcomes is not None and len(outcomes):
        out["paired"] = paired_markdown(t["paired"], (analysis or {}).get("paired"))
        out["paired_cliffs"] = markdown_table(t["paired_cliffs"], index=False)
    return out


def _source(results: Path) -> tuple[list[Path], list[dict], dict, str]:
    """(metrics paths, run configs, model -> weights hash, commit) of one results/ folder."""
    runs = sorted((results / "runs").glob("*/metrics.parquet"))
    if not runs:
        raise FileNotFoundError(f"{results}/runs/*/metrics.parquet: no runs there; pass the results/ folder")
    configs = [json.loads((p.parent / "config.json").read_text()) for p in runs]
    warm = {}
    for cfg in configs:
        w = Path(results.parent, cfg["model"], "warmstart.json")
        if w.is_file():
            warm[cfg["model"]] = json.loads(w.read_text()).get("weights_sha256", "")
    commit = subprocess.run(["git", "-C", str(results.parent), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    return runs, configs, warm, commit


def _pipeline_summary(results: Path, run_ids: set[str]) -> pd.DataFrame | None:
    """The summary.parquet the pipeline's aggregate step wrote for exactly these runs: results/tables/ (the default
    preset), results/presets/<preset>/tables/ (any other), or a slice's <that>/slice-<axes>/tables/; None when
    there is none to copy."""
    for path in [
        results / "tables" / "summary.parquet",
        *sorted(results.glob("presets/*/tables/summary.parquet")),
        *sorted(results.glob("slice-*/tables/summary.parquet")),
        *sorted(results.glob("presets/*/slice-*/tables/summary.parquet")),
    ]:
        if path.is_file():
            summary = pd.read_parquet(path)
            if set(summary["run_id"]) == run_ids:
                return summary
    return None


def collect(
    experiment: str,
    results: Path | list[Path],
    command: str,
    out_root: Path = EVIDENCE,
    analysis: dict | None = None,
) -> Path:
    """Copy an experiment's data (results/runs/*/metrics.parquet of one or several results/ folders) into
    out_root/experiment with provenance.json, then render its tables. Returns the folder.

    One folder: the summary its pipeline's aggregate step wrote for these runs (results/tables/ or
    results/presets/<preset>/tables/) is copied, else computed here; provenance names its commit.
    Several (runs of one experiment trained in several checkouts, e.g. toy_seeds' build 0 and build 1):
    the summary is computed from the pooled metrics here, and provenance lists each folder's commit and runs
    under `sources` (`commit` lists them all)."""
    import torch

    from marlflow.analysis import summarize_runs
    from marlflow.analysis.io import load_outcomes, load_runs

    folders = [results] if isinstance(results, Path | str) else list(results)
    sources = [(Path(f), *_source(Path(f))) for f in folders]
    runs = [p for src in sources for p in src[1]]
    configs = [c for src in sources for c in src[2]]
    warm = {k: v for src in sources for k, v in src[3].items()}
    metrics, _ = load_runs(runs)
    out = out_root / experiment
    atomic_write_parquet(validate_metrics(metrics), out / "metrics.parquet")
    outcomes = load_outcomes(runs)
    if len(outcomes):
        atomic_write_parquet(outcomes, out / "outcomes.parquet")
    pipeline = _pipeline_summary(sources[0][0], {c["run_id"] for c in configs}) if len(sources) == 1 else None
    summary = summarize_runs(validate_metrics(metrics)) if pipeline is None else pipeline
    atomic_write_parquet(summary, out / "summary.parquet")
    commits = list(dict.fromkeys(src[4] for src in sources))
    envs, unrecorded = environment.distinct(
        {c["run_id"]: p.parent for p, c in zip(runs, configs, strict=True)}
    )
    extra = {}
    if len(sources) > 1:
        extra["sources"] = [{"results": str(f), "commit": c, "runs": [json.loads((p.parent / "config.json")
                            .read_text())["run_id"] for p in r]} for f, r, _, _, c in sources]  # fmt: skip
    atomic_write_json(
        out / "provenance.json",
        {
            "experiment": experiment,
            "commit": commits[0] if len(commits) == 1 else commits,
            **extra,
            "command": command,
            "runs": [c["run_id"] for c in configs],
            "weights_sha256": warm,
            "environments": envs,
            "unrecorded_runs": unrecorded,
            "cpu": cpu(),
            "torch": torch.__version__,
            "threads": sorted({c.get("threads", 1) for c in configs}),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "python": platform.python_version(),
            "analysis": analysis or {},
        },
    )
    render(experiment, out_root)
    return out


def render(experiment: str, root: Path = EVIDENCE, check: bool = False) -> list[str]:
    """Write (or, with check, compare) root/experiment/tables/<name>.md from its metrics.parquet. Returns the
    names that differ from the committed files (check) or were written."""
    folder = root / experiment
    if not (folder / "metrics.parquet").is_file():
        raise FileNotFoundError(f"{folder / 'metrics.parquet'} is missing: run `collect {experiment}` first")
    # validate_metrics: data collected before a factor column existed (e.g. build) reads with its default
    outcomes = (
        pd.read_parquet(folder / "outcomes.parquet") if (folder / "outcomes.parquet").is_file() else None
    )
    analysis = json.loads((folder / "provenance.json").read_text()).get("analysis") if (
        folder / "provenance.json").is_file() else None  # fmt: skip
    rendered = tables_of(validate_metrics(pd.read_parquet(folder / "metrics.parquet")), outcomes, analysis)
    changed = []
    for name, text in rendered.items():
        path = folder / "tables" / f"{name}.md"
        if check:
            if not path.is_file() or path.read_text() != text:
                changed.append(name)
        else:
            atomic_write_text(path, text)
            changed.append(name)
    return changed


def quotes(paths) -> list[tuple[str, str, str, str]]:
    """(file, experiment, table, quoted text) of every evidence block in the given markdown files."""
    out = []
    for p in paths:
        for m in QUOTE.finditer(Path(p).read_text()):
            out.append((str(p), m.group(1), m.group(2), m.group(3)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m marlflow evidence", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("collect", help="copy an experiment's results into results/evidence/<experiment>")
    c.add_argument("experiment")
    c.add_argument("--results", type=Path, required=True, nargs="+",
                   help="the results/ folder(s) the runs wrote (several: runs of one experiment made in several "
                   "checkouts; each one's commit is recorded)")  # fmt: skip
    c.add_argument("--command", required=True, help="the command that made the runs, for provenance.json")
    c.add_argument("--preset", default=None,
                   help="the matrix.yaml preset the runs belong to: its declared `analysis:` (before the runs) is "
                   "recorded in provenance.json and decides the paired tables (default: none declared)")  # fmt: skip
    r = sub.add_parser("render", help="regenerate results/evidence/<experiment>/tables/*.md")
    r.add_argument("experiment")
    r.add_argument("--check", action="store_true", help="compare with the committed tables instead")
    args = ap.parse_args(argv)
    if args.verb == "collect":
        analysis = None
        if args.preset:
            from marlflow.pipeline.matrix import analysis_of

            analysis = analysis_of(str(ROOT / "matrix.yaml"), args.preset)
        print(collect(args.experiment, args.results, args.command, analysis=analysis))
        return 0
    changed = render(args.experiment, check=args.check)
    if args.check and changed:
        print(
            f"tables differ from their data: {', '.join(changed)}; rerun `render {args.experiment}`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
