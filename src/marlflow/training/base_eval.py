"""The step-0 evaluation, computed once per cell and read by every run of the cell.

SP, IP and every intervention of a cell evaluate the same untrained workflow at step 0. Each adapter starts
with B = 0, so every policy's weights are the base model's bit for bit (W + s B A = W). The step-0 evaluation
routes every role through one policy (`policies[0]`), so an IP run issues exactly the generate calls of the
SP run of its cell (same batches, same K/V reuse, same seeded RNG stream) and gets the same episodes. What
decides it is the run config without the fields that act on training only (flagged training_only in
marlflow.core.config), the model's and the task's local files (by content, or size and mtime above 64 MiB), marlflow's source and the numerical libraries' versions, and the sampler
when RunConfig.fastgen is false, the reference one (marlflow.generation.fastgen); their hash (`key`) names the result:

    RUNS/.base-evals/<key>.parquet          the evaluation's metric rows (marlflow.store.schema schema)
    RUNS/.base-evals/<key>-samples.parquet  its sample rows
    RUNS/.base-evals/<key>-outcomes.parquet its per-problem outcome rows
    RUNS/.base-evals/<key>.claim            exists while a run computes it

where RUNS is the folder holding the run folders (results/runs). No locks, so that it works on cluster
filesystems: a run at step 0 reads the result if it is there; otherwise it claims the key (an exclusive
create) and computes and writes it. If another run holds the claim, a run that can wait (no intervention
that reads evaluations as they come, Intervention.reads_evals: cliff_guard needs step 0's accuracy at once;
and no tracker, which wants its steps in order) trains on and reads
the result at its first evaluation or checkpoint; if it is still missing then (the other run died), it puts
its initial adapters back for a moment and computes it itself. The trainer inserts the rows where a step-0
evaluation of its own would have put them, so metrics.parquet is the same whichever run computed them, apart
from `time_eval` (this run's seconds) and `eval_reused` (1 when read). Writes are atomic; two runs that write
one key write the same rows.

A data-parallel run (marlflow.training.distributed) evaluates its share of the problems on each rank and gathers them
(marlflow.training.evaluation), so its rows are the 1-rank rows: `ranks` is not part of the key. Rank 0 alone reads,
claims and writes the cache and hands what it found to the other ranks (marlflow.training.trainer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

import pandas as pd

from marlflow.core.config import GRPOParams, RunConfig, fields_with
from marlflow.store.atomic import atomic_write_parquet
from marlflow.store.schema import FACTOR_COLUMNS, write_outcomes

LIBRARIES = ("torch", "transformers", "peft", "trl", "vllm", "math-verify")
FOLDER = ".base-evals"
log = logging.getLogger("marlflow.training.base_eval")


HASH_LIMIT = 64 * 2**20  # bytes: smaller files are identified by their content, larger ones by size and mtime


def _identity(f: Path) -> str:
    st = f.stat()
    if st.st_size <= HASH_LIMIT:
        return hashlib.sha256(f.read_bytes()).hexdigest()
    return f"{st.st_size}:{st.st_mtime_ns}"  # a rebuilt multi-GB weights file gets a new mtime


def _files(path: str) -> list:
    """(name, identity) of a local file or of every file under a local folder; [] if not a local path."""
    p = Path(path) if path else None
    if p is None or not p.exists():
        return []
    if p.is_file():
        return [(p.name, _identity(p))]
    return [(str(f.relative_to(p)), _identity(f)) for f in sorted(p.rglob("*")) if f.is_file()]


def _source_digest() -> str:
    """Hash of marlflow's Python source: a change to a workflow, prompt or sampler changes the key."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[1]  # the marlflow package, not this subpackage
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def inputs(cfg) -> dict:
    """Everything the step-0 evaluation of `cfg` depends on, as JSON-able data."""
    d = cfg.to_dict()
    for target, cls in ((d, RunConfig), (d["grpo"], GRPOParams)):  # what does not change step 0's evaluation
        for name in fields_with(cls, "training_only"):
            target.pop(name, None)
    task = dataclasses.asdict(cfg.task)
    out = {
        "config": d,
        "model_files": _files(cfg.model),
        "task_files": {k: _files(v) for k, v in task.items() if isinstance(v, str) and k != "name"},
        "source": _source_digest(),
        "libraries": {n: _version(n) for n in LIBRARIES},
    }
    if not cfg.fastgen:  # the reference sampler can draw other bf16 tokens
        out["sampler"] = "reference"
    return out


def key(cfg) -> str:
    return hashlib.sha256(json.dumps(inputs(cfg), sort_keys=True, default=str).encode()).hexdigest()[:32]


class SharedBaseEval:
    """The cached step-0 evaluation of `cfg`'s cell, under `runs_dir`/.base-evals (see the module docstring)."""

    def __init__(self, cfg, runs_dir: str | Path):
        self.cfg = cfg
        root = Path(runs_dir) / FOLDER
        k = key(cfg)
        self.metrics = root / f"{k}.parquet"
        self.samples = root / f"{k}-samples.parquet"
        self.outcomes = root / f"{k}-outcomes.parquet"
        self.claim_path = root / f"{k}.claim"
        self.claimed = False

    def read(self) -> tuple[list[dict], list[dict], list[dict]] | None:
        """(metric rows, sample rows, outcome rows) relabelled with this run's factors, or None when not
        computed yet (or computed before outcomes were kept: computed anew)."""
        paths = (self.metrics, self.samples, self.outcomes)
        if not all(p.exists() for p in paths):  # metrics are written last
            return None
        own = {"build": 0, **self.cfg.factors}
        out = []
        for path in paths:
            try:
                frame = pd.read_parquet(path)
            except (OSError, ValueError) as err:  # not a parquet file (copied in, or damaged): compute anew
                log.warning("ignoring the shared step-0 evaluation %s, which cannot be read (%s)", path, err)
                return None
            for c in FACTOR_COLUMNS:
                frame[c] = own[c]
            out.append(frame.to_dict("records"))
        return out[0], out[1], out[2]

    def claim(self) -> bool:
        """True if this run now holds the claim to compute the result (an exclusive create)."""
        self.claim_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.claim_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        self.claimed = True
        return True

    def write(
        self,
        metric_rows: list[dict],
        sample_rows: list[dict],
        sample_columns: list[str],
        outcome_rows: list[dict],
    ) -> None:
        atomic_write_parquet(pd.DataFrame(sample_rows, columns=sample_columns), self.samples)
        write_outcomes(outcome_rows, self.outcomes)
        atomic_write_parquet(pd.DataFrame(metric_rows), self.metrics)
        # A claim left by a run that died before writing is stale now; the result is there.
        self.claim_path.unlink(missing_ok=True)
        self.claimed = False

    def release(self) -> None:
        """Drop this run's claim (after a failed computation), never another run's."""
        if self.claimed:
            self.claim_path.unlink(missing_ok=True)
            self.claimed = False
