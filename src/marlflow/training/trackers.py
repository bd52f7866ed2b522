"""Experiment trackers: mirror a run's metrics.parquet into TensorBoard, trackio or Weights & Biases, live.

Off by default. Turn one or more on for a preset in matrix.yaml (`RunConfig.report_to`):

    run: {backend: hf, device: cpu, threads: 1, report_to: [tensorboard]}   # also trackio, wandb

`MultiAgentGRPOTrainer.fit()` opens a `Trackers` for the run and, after each training step (and its
evaluation), hands it the metric rows added since the last call; it finishes every tracker when training
ends, also on an exception. Each row becomes one scalar, tagged `{split}/{role}/{metric}` (the columns of
metrics.parquet, e.g. `train/generator/grad_norm`, `eval/all/accuracy`) at the row's step. The tracker run
is named after the run id, and its config is `run_config(cfg)`: the cell's factors and every setting.

Where the files go (RUN = results/runs/<run_id>) and how each stays off the network:

    tensorboard  RUN/trackers/tensorboard/ (torch.utils.tensorboard.SummaryWriter): local files only.
    trackio      RUN/trackers/trackio/ unless TRACKIO_DIR is set (`prepare`): trackio's local SQLite store.
                 It only goes online when you set TRACKIO_SPACE_ID or TRACKIO_SERVER_URL yourself.
    wandb        RUN/trackers/wandb/ unless WANDB_DIR is set. Mode: WANDB_MODE if set; otherwise "online"
                 when WANDB_API_KEY is set, else "offline" (sync later with `wandb sync RUN/trackers/wandb/...`).

Resume: RUN/trackers/logged.json keeps the last step each tracker logged. A job resumed from its step-k
checkpoint logs the steps after k, which it recomputes; the killed job may have logged some of them already:
TensorBoard hides those old events (the writer's purge_step), a resumed wandb run ignores steps at or below its
last one online (offline, each job is an offline run of the same wandb id), trackio keeps both copies. A
tracker that never logged the run (turned on after it finished, say) first gets every restored row, so a
finished run rerun with a new tracker fills it in without training.

The libraries come with the `trackers` extra (`pip install -c constraints-cpu.txt -e '.[trackers]'`:
tensorboard, wandb); trackio is installed on its own (`pip install trackio`; it is not in the locks, see
pyproject.toml). A tracker whose library is missing is an error when the run starts (`require`).

A backend is one small class: `start(run_name, config)`, `log(metrics, step)` with the {tag: value} of one
step, `finish(failed)`; `Trackers` turns rows into those calls.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import secrets
from itertools import groupby
from pathlib import Path

from marlflow.core.config import TRACKERS
from marlflow.store.atomic import atomic_write_json

log = logging.getLogger("marlflow.training.trackers")


def tag(row: dict) -> str:
    """A metric row's scalar name: `{split}/{role}/{metric}`, e.g. eval/all/accuracy."""
    return f"{row['split']}/{row['role']}/{row['metric']}"


def run_config(cfg) -> dict:
    """The tracker run's config: the factors of metrics.parquet, then every RunConfig setting with dotted keys
    (grpo.learning_rate, task.name, intervention_spec.kind, ...). Values are numbers, strings or booleans;
    anything else (a per-role mapping, a list) is its JSON text."""
    out = dict(cfg.factors)

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and v and prefix == "":
                walk(f"{k}.", v)
            elif f"{prefix}{k}" not in out and k != "task_axis":  # task_axis is the factor `task`
                out[f"{prefix}{k}"] = v if isinstance(v, bool | int | float | str) else json.dumps(v)

    walk("", cfg.to_dict())
    return out


class TensorBoard:
    """TensorBoard event files through torch.utils.tensorboard. The run name and config are an HParams
    session (the HParams tab) and a text summary `run` holding {"run_name", "config"} as JSON."""

    module = "tensorboard"

    def __init__(self, root: Path, first: int):
        self.dir, self.first = root / "tensorboard", first
        self.writer = None

    def start(self, run_name: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: events at or after the first step this job logs (left by an earlier job) are hidden.
        self.writer = SummaryWriter(str(self.dir), purge_step=self.first)
        for summary in hparams(config, {"eval/all/accuracy": None}):
            self.writer.file_writer.add_summary(summary)
        doc = json.dumps({"run_name": run_name, "config": config}, indent=1)
        self.writer.add_text("run", f"```\n{doc}\n```", self.first)

    def log(self, metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # one small write per step: the event file is current while the run trains

    def finish(self, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()


def prepare(cfg, run_dir: str | Path) -> None:
    """Settings that a tracker library reads when it is imported, set before anything imports it:
    TRACKIO_DIR defaults to RUN/trackers/trackio. TRL's trainer module imports trackio when it is installed,
    so `python -m marlflow train` calls this first; a process that imported trackio before logs to trackio's
    default directory instead (a warning says where)."""
    if "trackio" in cfg.report_to:
        os.environ.setdefault("TRACKIO_DIR", str(Path(run_dir) / "trackers" / "trackio"))


class Trackio:
    """trackio's local store (SQLite under TRACKIO_DIR, by default RUN/trackers/trackio: see `prepare`);
    project "marlflow", group = the preset, name = the run id."""

    module = "trackio"

    def __init__(self, root: Path, first: int):
        self.dir, self.resumed = root / "trackio", first > 0

    def start(self, run_name: str, config: dict) -> None:
        import trackio
        from trackio.utils import TRACKIO_DIR

        if os.environ.get("TRACKIO_DIR") != str(TRACKIO_DIR):
            log.warning("trackio was imported before TRACKIO_DIR was set (marlflow.training.trackers.prepare): run %s "
                        "logs to %s", run_name, TRACKIO_DIR)  # fmt: skip
        trackio.init(project="marlflow", name=run_name, group=config.get("preset"), config=config,
                     resume="allow" if self.resumed else "never", auto_log_cpu=False, auto_log_gpu=False)  # fmt: skip

    def log(self, metrics: dict, step: int) -> None:
        import trackio

        trackio.log(metrics, step=step)

    def finish(self, failed: bool = False) -> None:
        import trackio

        with contextlib.suppress(RuntimeError):  # no current run: start failed
            trackio.finish()


class WandB:
    """Weights & Biases, offline unless WANDB_MODE says otherwise or WANDB_API_KEY is set. Project
    WANDB_PROJECT or "marlflow", group = the preset, name = the run id. The wandb run id is kept in
    RUN/trackers/wandb/wandb-id: a resumed job continues the same wandb run, a fresh start makes a new one."""

    module = "wandb"

    def __init__(self, root: Path, first: int):
        self.dir, self.resumed = root / "wandb", first > 0
        self.run = None

    def start(self, run_name: str, config: dict) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "wandb-id"
        if self.resumed and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # wandb ids: letters and digits
            id_file.write_text(run_id + "\n")
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = wandb.init(
            project=None if os.environ.get("WANDB_PROJECT") else "marlflow",
            group=config.get("preset"),
            name=run_name,
            id=run_id,
            resume="allow",
            config=config,
            dir=None if os.environ.get("WANDB_DIR") else str(self.dir),
            mode=None if os.environ.get("WANDB_MODE") else mode,  # None: wandb reads WANDB_MODE
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)


BACKENDS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}
INSTALL = {
    "tensorboard": "pip install -c constraints-cpu.txt -e '.[trackers]' (or: pip install tensorboard)",
    "trackio": "pip install trackio (not in the trackers extra: it needs pillow<13, the locks pin 13.0.0)",
    "wandb": "pip install -c constraints-cpu.txt -e '.[trackers]' (or: pip install wandb)",
}
assert set(BACKENDS) == set(TRACKERS) == set(INSTALL)


def require(names) -> None:
    """Raise RuntimeError naming the install command for every tracker in `names` whose library is missing."""
    missing = [n for n in names if importlib.util.find_spec(BACKENDS[n].module) is None]
    if missing:
        why = "; ".join(f"{n}, but {BACKENDS[n].module} is not installed: {INSTALL[n]}" for n in missing)
        raise RuntimeError(f"report_to asks for {why}")


class Trackers:
    """The run's trackers (cfg.report_to, possibly none), fed metric rows as the run appends them.

        with Trackers(cfg, run_dir) as track:
            track.start(metric_rows, resumed_step)   # after the restore or the step-0 evaluation
            ...; track.log(metric_rows)              # after each step: logs the rows added since the last call

    RUN/trackers/logged.json keeps the last step each tracker logged for this run. A job that resumes from
    step k logs, for each tracker, the rows after min(k, its last logged step): everything when the tracker
    never logged this run (turned on later: the restored rows are backfilled), else the steps after k, which
    this job recomputes (the killed job may have logged some of them: see the module docstring).
    """

    def __init__(self, cfg, run_dir: str | Path):
        require(cfg.report_to)
        self.cfg, self.root = cfg, Path(run_dir) / "trackers"
        self.backends: dict[str, object] = {}
        self.first: dict[str, int] = {}  # tracker -> first step this job logs
        self.logged: dict[str, int] = {}  # tracker -> last step logged for this run, by any job
        self.sent = 0

    def start(self, rows: list[dict], resumed_step: int | None) -> None:
        """Start every tracker and log what it lacks of `rows`; resumed_step: the restored checkpoint's step,
        None on a fresh start."""
        if not self.cfg.report_to:
            return
        state = self.root / "logged.json"
        with contextlib.suppress(OSError, ValueError):
            self.logged = {k: int(v) for k, v in json.loads(state.read_text()).items()}
        config = run_config(self.cfg)
        for name in self.cfg.report_to:
            last = self.logged.get(name)
            self.first[name] = 0 if resumed_step is None or last is None else min(resumed_step, last) + 1
            self.backends[name] = BACKENDS[name](self.root, self.first[name])
            self.backends[name].start(self.cfg.run_id, config)
        self.log(rows)

    def log(self, rows: list[dict]) -> None:
        """Log rows[self.sent:], one call per step per tracker, skipping steps before the tracker's first.
        The trainer appends each step's rows before it calls this, so a step never comes in two calls."""
        new, self.sent = rows[self.sent :], len(rows)
        if not self.backends or not new:
            return
        for step, group in groupby(new, key=lambda r: int(r["step"])):
            metrics = {tag(r): r["value"] for r in group}
            for name, backend in self.backends.items():
                if step >= self.first[name]:
                    backend.log(metrics, step)
                    self.logged[name] = step
        atomic_write_json(self.root / "logged.json", self.logged)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for backend in self.backends.values():
            try:
                backend.finish(failed=exc_type is not None)
            except Exception:
                if exc_type is None:
                    raise
                log.exception("finishing tracker %s after a failed run", type(backend).__name__)
