"""Resume equivalence: a run killed with SIGKILL, or stopped by SIGTERM / SIGUSR1 (marlflow.training.preempt), and rerun
ends exactly where an uninterrupted run ends.

Compared: every metric except wall-clock timings (step_time, time_*, incl. time_eval), bit for bit, and every adapter
tensor with torch.equal. On one CPU machine with a fixed seed the computation is deterministic (same
kernels, same thread count, same order), so we require exact equality rather than a tolerance; a
tolerance would only hide a resume bug such as a restored RNG stream being off by one draw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from marlflow.store.schema import VOLATILE_METRICS

HERE = Path(__file__).parent


def _train(cfg_path: Path, out: Path, env=None, signal_at: str | None = None) -> subprocess.Popen:
    if signal_at:  # parity_train.py sends itself this signal at this point (MARLFLOW_TEST_SIGNAL)
        env = {**(env or os.environ), "MARLFLOW_TEST_SIGNAL": signal_at}
    return subprocess.Popen(
        [sys.executable, str(HERE / "parity_train.py"), "--config", str(cfg_path), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


def _adapters(run: Path) -> dict:
    ckpt = max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    return {
        str(f.relative_to(ckpt)): load_file(f) for f in sorted((ckpt / "adapters").rglob("*.safetensors"))
    }


def _metrics(run: Path) -> pd.DataFrame:
    m = pd.read_parquet(run / "metrics.parquet")
    m = m[~m.metric.isin(VOLATILE_METRICS)]
    return m.sort_values(["step", "split", "role", "metric"]).reset_index(drop=True)


def kill_and_resume(cfg, tmp_path: Path) -> tuple[dict, pd.DataFrame]:
    """Train `cfg` uninterrupted, and again SIGKILLed inside step 3 then rerun; assert both end bit-identical
    (metrics except timings, every adapter tensor). Returns the adapters and metrics of the resumed run."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))

    ref = tmp_path / "uninterrupted"
    p = _train(cfg_path, ref)
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()

    run = tmp_path / "killed"
    p = _train(cfg_path, run)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-2" / "COMPLETE").exists():  # kill somewhere inside step 3
        assert p.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (run / "DONE").exists()

    p = _train(cfg_path, run)
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    return _assert_same_run(ref, run)


def _assert_same_run(ref: Path, run: Path) -> tuple[dict, pd.DataFrame]:
    """`run` ended bit-identical to `ref` (metrics except timings, per-problem outcomes, every adapter tensor),
    every step once."""
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(run))
    outcomes = pd.read_parquet(run / "outcomes.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(ref / "outcomes.parquet"), outcomes)
    assert len(outcomes) and not outcomes.duplicated(["step", "split", "uid"]).any()
    m = _metrics(run)
    assert not m.duplicated(["step", "split", "role", "metric"]).any()
    a, b = _adapters(ref), _adapters(run)
    assert a.keys() == b.keys() and len(a) >= 1
    for f in a:
        assert a[f].keys() == b[f].keys()
        for k in a[f]:
            assert torch.equal(a[f][k], b[f][k]), (f, k)
    return b, m


@pytest.mark.slow
@pytest.mark.parametrize("workflow,sharing", [("voting", "ip"), ("voting", "sp"), ("orch_workers", "ip"),
                                              ("orch_workers", "sp")])  # fmt: skip
def test_sigkill_then_resume_equals_uninterrupted(make_cfg, tmp_path, workflow, sharing):
    cfg = make_cfg(workflow, sharing, task="parity", steps=4, save_every=1, eval_every=2)
    a, _ = kill_and_resume(cfg, tmp_path)
    # the run really trained: adapters are not at their zero init
    assert any(v.abs().sum() > 0 for f in a for k, v in a[f].items() if "lora_B" in k)


@pytest.mark.slow
def test_per_agent_sigkill_then_resume_equals_uninterrupted(make_cfg, tmp_path):
    """Sharing agent on Orch-Workers (orchestrator, worker0..2, synthesizer: five adapters and optimizers, the
    later workers trained only in the steps whose orchestrator gave that many strategies): killed after a
    checkpoint, resumed, bit-identical to the uninterrupted run."""
    cfg = make_cfg("orch_workers", "agent", task="parity", steps=4, save_every=1, eval_every=2)
    a, _ = kill_and_resume(cfg, tmp_path)
    assert {Path(f).parent.name for f in a} == {
        "orchestrator",
        "worker0",
        "worker1",
        "worker2",
        "synthesizer",
    }
    assert any(v.abs().sum() > 0 for f in a for k, v in a[f].items() if "lora_B" in k)


@pytest.mark.slow
def test_full_ft_sigkill_then_resume_equals_uninterrupted(make_cfg, tmp_path):
    """Full fine-tuning under agent (a whole model and its AdamW per voter and for the aggregator): killed after a
    checkpoint, resumed, bit-identical to the uninterrupted run."""
    cfg = dataclasses.replace(make_cfg("voting", "agent", task="parity", steps=4, save_every=1, eval_every=2),
                              adapter="full")  # fmt: skip
    a, _ = kill_and_resume(cfg, tmp_path)
    assert {Path(f).parent.name for f in a} == {"generator0", "generator1", "generator2", "aggregator"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "workflow,sharing,stops",
    [
        # SIGTERM during step 2's rollout: step 2 is abandoned, step 1 checkpointed; then SIGUSR1 as step 3's
        # update starts: step 3 is finished and checkpointed.
        ("voting", "ip", [("SIGTERM@rollout:2", 1), ("SIGUSR1@update:3", 3)]),
        # The other way round, on a three-stage workflow with one shared adapter; step 2's evaluation is due
        # (eval_every 2) and runs before the checkpoint.
        ("orch_workers", "sp", [("SIGUSR1@rollout:2", 1), ("SIGTERM@update:2", 2)]),
    ],
)
def test_signal_then_resume_equals_uninterrupted(make_cfg, tmp_path, workflow, sharing, stops):
    """SIGTERM and SIGUSR1 (SLURM's --signal) between checkpoints (save_every 0: only the last step is saved on
    its own): the run checkpoints its last completed step and exits 75, each rerun resumes, and the end is
    bit-identical to an uninterrupted run, no step repeated or missing."""
    cfg = make_cfg(workflow, sharing, task="parity", steps=4, save_every=0, eval_every=2)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    ref = tmp_path / "uninterrupted"
    p = _train(cfg_path, ref)
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    _stop_resume_compare(cfg_path, tmp_path / "stopped", ref, stops)


@pytest.mark.slow
def test_signal_with_step0_eval_deferred(make_cfg, tmp_path):
    """Step 0's evaluation is deferred (another run of the cell holds its claim, marlflow.training.base_eval) and the
    signal comes at step 1, before any evaluation or checkpoint would fill it in: the stop fills it in first,
    so the step-1 checkpoint holds step 0's rows, and the resumed run equals an uninterrupted one."""
    from marlflow.training.base_eval import SharedBaseEval

    cfg = make_cfg("voting", "sp", task="parity", steps=4, save_every=0, eval_every=2)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    ref = tmp_path / "a" / "uninterrupted"
    p = _train(cfg_path, ref)
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    assert SharedBaseEval(cfg, tmp_path / "b").claim()  # a run that never writes: the stopped run waits on it
    (err,) = _stop_resume_compare(cfg_path, tmp_path / "b" / "stopped", ref, [("SIGUSR1@update:1", 1)])
    assert "another run of this cell is computing it" in err and "evaluating the initial adapters here" in err


def _stop_resume_compare(cfg_path: Path, run: Path, ref: Path, stops: list[tuple[str, int]]) -> list[str]:
    """Train `run` once per (signal spec, step it must checkpoint) in `stops`, each stopped by its signal and
    exiting 75 with that step checkpointed (every step up to it once, none after), then to the end; assert it
    ends bit-identical to `ref` with every step once. Returns the stopped runs' stderr."""
    from marlflow.training.preempt import EXIT_PREEMPTED

    errs = []
    for spec, kept in stops:
        p = _train(cfg_path, run, signal_at=spec)
        err = p.communicate(timeout=300)[1].decode()
        errs.append(err)
        assert p.returncode == EXIT_PREEMPTED, (spec, err)
        assert f"checkpointed step-{kept}, steps lost: 0" in err, err
        assert not (run / "DONE").exists() and not (run / "metrics.parquet").exists()
        newest = max((run / "checkpoints").glob("step-*"), key=lambda c: int(c.name[5:]))
        assert newest.name == f"step-{kept}" and (newest / "COMPLETE").exists()
        m = pd.read_parquet(newest / "metrics.parquet")  # every step up to `kept`, once, and none after it
        assert sorted(m[m.split == "train"].step.unique()) == list(range(1, kept + 1))
        assert sorted(m[m.split == "eval"].step.unique()) == [s for s in (0, 2) if s <= kept]
        assert not m.duplicated(["step", "split", "role", "metric"]).any()
    p = _train(cfg_path, run)
    err = p.communicate(timeout=300)[1].decode()
    assert p.returncode == 0, err
    assert f"resumed from {run / 'checkpoints' / f'step-{stops[-1][1]}'}" in err
    _, m = _assert_same_run(ref, run)
    assert sorted(m[m.split == "train"].step.unique()) == [1, 2, 3, 4]
    assert sorted(m[m.split == "eval"].step.unique()) == [0, 2, 4]
    return errs


def test_second_signal_exits_at_once(preempt_installed):
    """The first SIGTERM / SIGUSR1 is a request the trainer acts on at its next safe point; a second one (SLURM's
    SIGTERM at the time limit after its SIGUSR1) exits at once with 128 + the signal, as before."""
    preempt = preempt_installed
    assert not preempt.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preempt.requested() and preempt.describe().startswith("SIGUSR1 (received ")
    with pytest.raises(SystemExit) as exit_:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert exit_.value.code == 128 + signal.SIGTERM


@pytest.mark.slow
def test_checkpoints_of_another_config_are_not_resumed_from(make_cfg, tmp_path, caplog):
    """A changed cell of matrix.yaml reruns its run (the config is a Snakemake param). The rerun must train the
    new config from step 0, not resume the old config's checkpoints, which would splice two runs into one
    curve: it equals a run of the new config in a fresh folder, and the old checkpoints are moved aside, not
    deleted. A config that differs only in provenance (the preset that listed the run) resumes."""
    from marlflow.cli import train as T
    from marlflow.core.config import config_fingerprint

    old = make_cfg("single", "sp", steps=2, eval_every=2, save_every=1)
    new = dataclasses.replace(old, grpo=dataclasses.replace(old.grpo, learning_rate=3e-3))
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    T.run(old, run)
    old_marker = json.loads((run / "checkpoints" / "step-2" / "COMPLETE").read_text())
    assert old_marker["step"] == 2 and old_marker["config"]["grpo"]["learning_rate"] == 1e-2
    with caplog.at_level("WARNING", logger="marlflow.training.checkpoint"):
        T.run(new, run)
    moved = run / f"checkpoints-superseded-{old_marker['config_fingerprint'][:12]}"
    assert json.loads((moved / "step-2" / "COMPLETE").read_text()) == old_marker
    assert "grpo.learning_rate: 0.01 -> 0.003" in caplog.text and "training from step 0" in caplog.text
    T.run(new, fresh)
    pd.testing.assert_frame_equal(_metrics(run), _metrics(fresh))
    mine, theirs = _adapters(run), _adapters(fresh)
    assert mine.keys() == theirs.keys()
    for f in mine:
        for k in mine[f]:
            assert torch.equal(mine[f][k], theirs[f][k]), (f, k)
    # Only the preset's name differs: the same run, resumed from its step-2 checkpoint, nothing moved.
    renamed = dataclasses.replace(new, preset="toy_seeds")
    assert config_fingerprint(renamed.to_dict()) == config_fingerprint(new.to_dict())
    T.run(renamed, run)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoints")) == [
        "checkpoints",
        moved.name,
    ]


def test_each_start_records_where_it_trains(make_cfg, tmp_path):
    """Every start of training appends one line to RUN/environment.jsonl (marlflow.training.environment): a fresh run at
    step 0, a rerun after a kill at the step of the checkpoint it resumes; no checkpoint holds the file."""
    import re
    import shutil
    import socket

    from marlflow.cli import train as T
    from marlflow.models.toybuild import cpu_info
    from marlflow.training import environment

    cfg = make_cfg("single", "sp", steps=2, eval_every=2, save_every=1)
    run = tmp_path / "run"
    T.run(cfg, run)
    (first,) = environment.read(run)
    assert set(first) == {"step", "time", "hostname", "hosts", "cpu_model", "cpu_flags", "torch",
                          "torch_cpu_capability", "cuda_device", "torch_threads", "omp_num_threads", "ranks",
                          "marlflow", "commit"}  # fmt: skip
    assert first["step"] == 0 and first["ranks"] == 1 and first["hosts"] == [socket.gethostname()]
    assert first["hostname"] == socket.gethostname()
    assert {k: first[k] for k in ("cpu_model", "cpu_flags")} == cpu_info()
    assert first["torch"] == torch.__version__
    assert first["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert first["cuda_device"] == "" and first["torch_threads"] == cfg.threads
    assert first["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS", "")
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", first["commit"])  # the tests run in a checkout
    # killed after step 1's checkpoint: the rerun resumes there, on "another machine" (here the same)
    shutil.rmtree(run / "checkpoints" / "step-2")
    (run / "DONE").unlink()
    T.run(cfg, run)
    kept, resumed = environment.read(run)
    assert kept == first and resumed["step"] == 1 and resumed["time"] >= first["time"]
    assert {k: v for k, v in resumed.items() if k not in ("step", "time")} == {
        k: v for k, v in first.items() if k not in ("step", "time")
    }
    assert not list((run / "checkpoints").rglob(environment.ENVIRONMENT_FILE))
    assert environment.since_fresh_start([first, resumed, {**first, "step": 0}, resumed]) == [
        {**first, "step": 0},
        resumed,
    ]


def test_source_commit_is_empty_outside_a_checkout_and_marks_changes(tmp_path):
    """environment.source_commit (the commit in environment.jsonl and benchmarks' environment line): HEAD of the
    checkout that tracks the folder, +dirty after an edit, "" for a folder no checkout tracks."""
    import subprocess

    from marlflow.training.environment import source_commit

    assert source_commit(tmp_path) == ""
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "pkg").mkdir()
    (repo / "pkg" / "a.py").write_text("1\n")
    (repo / "ignored").mkdir()
    (repo / ".gitignore").write_text("ignored/\n")
    subprocess.run([*git, "add", "pkg", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_commit(repo / "pkg") == head
    assert source_commit(repo / "ignored") == ""  # e.g. an installed package inside the checkout's .venv
    (repo / "pkg" / "a.py").write_text("2\n")
    assert source_commit(repo / "pkg") == head + "+dirty"
    short = source_commit(repo / "pkg", short=True)
    assert short.endswith("+dirty") and head.startswith(short.removesuffix("+dirty")) and len(short) < 40
