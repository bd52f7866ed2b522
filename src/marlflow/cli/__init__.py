"""The `marlflow` command: one entry point whose subcommands are the modules of this package.

    marlflow run [SNAKEMAKE ARGS]      the matrix with Snakemake and the local profile (make run)
    marlflow matrix|models|train|aggregate|report|evidence|sandbox|plan ARGS
    marlflow eval --run results/runs/<id> [--step N] [--task T] [--n K]
    marlflow chat --run results/runs/<id> --role R [--step N]

`python -m marlflow <command> ARGS` is the same (the Snakemake rules call it so). Every subcommand hands its
remaining arguments to its module's `main(argv)` (COMMANDS: `marlflow.cli.<command>`, and the sandbox's own
`marlflow.sandbox`), so `marlflow train --help` is that module's own help. Each command module holds one
argparse block and calls its library (pipeline, training, analysis, report, models); nothing below this
package imports it. Installed as a console script by pyproject.toml (`[project.scripts]`).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

# subcommand -> (module whose main(argv) it runs, one-line help). "run" is Snakemake itself.
COMMANDS = {
    "run": (
        None,
        "run the experiment matrix with Snakemake (--profile profiles/local); extra args go to snakemake",
    ),
    "matrix": ("marlflow.cli.matrix", "validate matrix.yaml and print a preset's run sheet"),
    "models": (
        "marlflow.cli.models",
        "build the toy (toy, toy2s, toy2) and smol models or validate a hub model (prepare, build-toy)",
    ),
    "train": ("marlflow.cli.train", "train one cell from its config.json"),
    "eval": ("marlflow.cli.evaluate", "evaluate a run's checkpoint on any registered task"),
    "chat": ("marlflow.cli.chat", "talk to one role of a trained run"),
    "aggregate": ("marlflow.cli.aggregate", "turn finished runs into summary tables"),
    "report": ("marlflow.cli.report", "figures and the HTML report from the tables"),
    "sandbox": ("marlflow.sandbox", "run untrusted code against tests in the sandbox"),
    "evidence": ("marlflow.cli.evidence", "collect finished runs into committed evidence with provenance"),
    "plan": ("marlflow.cli.plan", "predict each run's GPU memory, step time and GPU-hours (any preset)"),
}


def targets_before_config(args: list[str]) -> list[str]:
    """`args` with any target written after `--config k=v ...` moved in front of it.

    Snakemake's --config takes every following word, so `--config preset=smoke results/tables/summary.csv`
    made it raise a traceback on the target ("Config entries have to be defined as name=value pairs"); a
    word without `=` there can only be a target."""
    out, moved, in_config = [], [], False
    for a in args:
        if a in ("--config", "-C"):
            in_config = True
        elif a.startswith("-"):
            in_config = False
        elif in_config and "=" not in a:
            moved.append(a)
            continue
        out.append(a)
    return moved + out


def run_parser() -> argparse.ArgumentParser:
    """`marlflow run --help`: the options that matter here; every other one is Snakemake's (`snakemake --help`)."""
    ap = argparse.ArgumentParser(
        prog="marlflow run",
        description="Run the experiment matrix with Snakemake from the repository root: "
        "`snakemake --profile profiles/local ARGS`. Finished runs are skipped; a killed run resumes.",
        epilog="Every other option goes to Snakemake unchanged (`snakemake --help` lists them). Outputs: "
        "results/runs/<run_id>/ per run; the tables, figures and report.html in results/ for the default "
        "preset in full, in results/presets/<preset>/ (and slice-... below it for --config axis restrictions) "
        "otherwise.",
    )
    ap.add_argument(
        "targets", nargs="*", help="files to make (default: every run, the tables and the report)"
    )
    ap.add_argument("-n", "--dry-run", action="store_true", help="list the jobs without running them")
    ap.add_argument(
        "--config",
        nargs="*",
        metavar="KEY=VALUE",
        help="preset=NAME (matrix.yaml's presets), axis restrictions such as workflows=[voting] tasks=[math] "
        "seeds=[0,1], matrix=FILE; unknown keys are refused with the known ones",
    )
    ap.add_argument(
        "--profile",
        default="profiles/local",
        help="Snakemake profile (default: %(default)s; profiles/slurm submits to a SLURM cluster)",
    )
    ap.add_argument("--cores", help="CPU cores for local jobs (the local profile: 2)")
    return ap


def run_snakemake(args: list[str]) -> int:
    """`snakemake --profile profiles/local ARGS` from the repository root (the folder with the Snakefile)."""
    if any(a in ("-h", "--help") for a in args):
        run_parser().print_help()  # not Snakemake's whole help under the name __main__.py
        return 0
    root = Path.cwd()
    if not (root / "Snakefile").is_file() or not (root / "profiles" / "local").is_dir():
        print(
            f"marlflow run: no Snakefile and profiles/local in {root}; run it from the marlflow repository root "
            "(or call snakemake with --snakefile and --profile yourself)",
            file=sys.stderr,
        )
        return 2
    profile = (
        []
        if any(a == "--profile" or a.startswith("--profile=") for a in args)
        else ["--profile", "profiles/local"]
    )
    rc = subprocess.call([sys.executable, "-m", "snakemake", *profile, *targets_before_config(args)])
    report = report_path(root, args)
    if (
        rc == 0
        and report
        and report.is_file()
        and not any(a in ("-n", "--dry-run", "--dryrun") for a in args)
    ):
        print(f"report: {report}")
    return rc


def report_path(root: Path, args: list[str]) -> Path | None:
    """The report.html that `snakemake ARGS` writes: under the preset's or slice's own folder
    (marlflow.pipeline.matrix.output_dir, from --config's matrix, preset and axis restrictions); None if unknown."""
    import yaml

    from marlflow.pipeline.matrix import ALIASES, AXES, MatrixError, output_dir

    config, in_config = {}, False
    for a in args:
        if a in ("--config", "-C"):
            in_config = True
        elif a.startswith("-"):
            in_config = False
        elif in_config and "=" in a:
            key, _, val = a.partition("=")
            try:
                config[key] = yaml.safe_load(val)
            except yaml.YAMLError:
                config[key] = val
    overrides = {k: v for k, v in config.items() if k in (*AXES, *ALIASES)}
    try:
        out = output_dir(root / str(config.get("matrix", "matrix.yaml")), config.get("preset"), overrides)
    except (MatrixError, OSError):
        return None
    return root / out / "report.html"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="marlflow",
        description="Multi-agent GRPO for LLM workflows, run as a Snakemake matrix.",
        epilog="`marlflow COMMAND --help` shows a command's own options.",
    )
    from marlflow import __version__

    ap.add_argument("--version", action="version", version=f"marlflow {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the command belongs to the command's own parser (argparse's REMAINDER would
    # reject a leading option such as `eval --run`), so only the part up to the command is parsed here.
    cut = next((i + 1 for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command = build_parser().parse_args(argv[:cut]).command
    rest = argv[cut:]
    module, _ = COMMANDS[command]
    if module is None:
        return run_snakemake(rest)
    rc = importlib.import_module(module).main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
