"""An evaluation that stops and resumes mid-way (RunConfig.eval_chunk_problems, marlflow.training.evaluation).

A chunked evaluation checks for SIGTERM / SIGUSR1 before each chunk; on one the trainer checkpoints the step
with the finished chunks' episodes (checkpoints/step-N/eval-partial.pt, their outcome rows beside it) and exits
75, and the rerun evaluates the rest. Through real processes and real signals: a stop during an evaluation loses
no finished problem, and the run stopped twice (once in a step's test chunks, once in the next step's
validation chunks) ends bit-identical to the uninterrupted run with the same chunks. Run:
`pytest -q -k mid_eval tests/test_mid_eval.py`.

As a script, `python tests/test_mid_eval.py --config C --out D` is tests/parity_train.py's trainer (its test
tasks registered) that sends itself a real signal after a chosen chunk of an evaluation:
MARLFLOW_TEST_EVAL_SIGNAL=SIGNAL@STEP:CHUNK:PURPOSE, e.g. SIGUSR1@1:1:eval = after the first test chunk of step
1's evaluation (PURPOSE "val": the validation chunks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
ENV = "MARLFLOW_TEST_EVAL_SIGNAL"


def _signal_after_chunk(spec: str) -> None:
    """Make the trainer signal itself after chunk CHUNK (1-based) of PURPOSE in step STEP's evaluation."""
    from marlflow.training import evaluation
    from marlflow.training import trainer as T

    name, at = spec.split("@")
    step, chunk, purpose = at.split(":")
    sig, step, chunk = signal.Signals[name], int(step), int(chunk)
    now, seen = {"step": None}, {"n": 0}
    evaluate_workflow, episodes = T.MultiAgentGRPOTrainer.evaluate_workflow, evaluation.episodes

    def evaluate_workflow_(self, s, base=False, stoppable=False):
        now["step"] = s if stoppable else None
        try:
            return evaluate_workflow(self, s, base, stoppable)
        finally:
            now["step"] = None

    def episodes_(*args, **kwargs):
        out = episodes(*args, **kwargs)
        p = kwargs.get("purpose", args[7] if len(args) > 7 else "eval")
        if now["step"] == step and p == purpose:
            seen["n"] += 1
            if seen["n"] == chunk:
                os.kill(os.getpid(), sig)
        return out

    T.MultiAgentGRPOTrainer.evaluate_workflow = evaluate_workflow_
    evaluation.episodes = episodes_


def _train(cfg_path: Path, out: Path, spec: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: spec} if spec else {k: v for k, v in os.environ.items() if k != ENV}
    return subprocess.run([sys.executable, __file__, "--config", str(cfg_path), "--out", str(out)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)  # fmt: skip


def _metrics(run: Path) -> pd.DataFrame:
    from marlflow.store.schema import VOLATILE_METRICS

    m = pd.read_parquet(run / "metrics.parquet")
    return m[~m.metric.isin(VOLATILE_METRICS)].reset_index(drop=True)


def _final(run: Path) -> dict:
    return {str(f.relative_to(run)): load_file(f) for f in sorted((run / "final").rglob("*.safetensors"))}


def test_mid_eval_chunk_seeds():
    """Chunk 0 keeps the evaluation's seed (0 chunks = today's evaluation); under "stream" every later chunk
    gets its own seed, a pure function of (seed, chunk); under "per_call" the call keys already name the
    problem, so every chunk keeps the seed."""
    from marlflow.training.evaluation import chunk_seed

    stream = type("C", (), {"sampling_seeds": "stream"})()
    per_call = type("C", (), {"sampling_seeds": "per_call"})()
    seeds = [chunk_seed(stream, 1_000_003, k) for k in range(50)]
    assert seeds[0] == 1_000_003 and len(set(seeds)) == 50 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert seeds == [chunk_seed(stream, 1_000_003, k) for k in range(50)]
    assert chunk_seed(stream, 7, 3) != chunk_seed(stream, 8, 3)
    assert {chunk_seed(per_call, 1_000_003, k) for k in range(5)} == {1_000_003}


def test_mid_eval_setting_is_identity_and_absent_at_default(make_cfg):
    """eval_chunk_problems 0 leaves config.json and the fingerprint as they were; another value changes the
    numbers (its own batches and streams), so it is part of the run's identity."""
    from marlflow.core.config import config_fingerprint

    plain = make_cfg("voting", "ip")
    chunked = dataclasses.replace(plain, eval_chunk_problems=2)
    assert "eval_chunk_problems" not in plain.to_dict() and chunked.to_dict()["eval_chunk_problems"] == 2
    assert config_fingerprint(plain.to_dict()) != config_fingerprint(chunked.to_dict())


@pytest.mark.slow
def test_mid_eval_stop_keeps_finished_problems_and_resumes_bit_identical(make_cfg, tmp_path):
    from marlflow.training.checkpoint import PARTIAL, PARTIAL_OUTCOMES
    from marlflow.training.preempt import EXIT_PREEMPTED

    cfg = make_cfg("voting", "ip", task="parity", steps=2, save_every=0, eval_every=1)
    # 6 test and 4 validation problems in chunks of 2: 3 test chunks and 2 validation chunks per evaluation;
    # sampling_seeds "stream" (the default): each chunk its own seeded stream
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, val_size=4), eval_chunk_problems=2)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    ref = tmp_path / "uninterrupted"
    p = _train(cfg_path, ref)
    assert p.returncode == 0, p.stderr[-3000:]
    ref_out = pd.read_parquet(ref / "outcomes.parquet")

    run = tmp_path / "stopped"
    # (signal, the step checkpointed, the problems of its evaluation finished: test first, then validation)
    for spec, step, done in (("SIGUSR1@1:1:eval", 1, {"eval": 2, "val": 0}),
                             ("SIGTERM@2:1:val", 2, {"eval": 6, "val": 2})):  # fmt: skip
        p = _train(cfg_path, run, spec)
        assert p.returncode == EXIT_PREEMPTED, (spec, p.stderr[-3000:])
        n = sum(done.values())
        assert f"checkpointed step-{step} with {n} of its evaluation's 10 problems done" in p.stderr
        assert not (run / "DONE").exists() and not (run / "metrics.parquet").exists()
        ckpt = run / "checkpoints" / f"step-{step}"
        assert (ckpt / "COMPLETE").exists() and (ckpt / PARTIAL).exists()
        # no finished problem is lost: the partial file holds exactly the uninterrupted run's rows of them
        kept = pd.read_parquet(ckpt / PARTIAL_OUTCOMES)
        assert kept.groupby("split").size().reindex(["eval", "val"], fill_value=0).to_dict() == done
        want = pd.concat(
            [ref_out[(ref_out.step == step) & (ref_out.split == s)].head(k) for s, k in done.items()]
        )
        pd.testing.assert_frame_equal(kept.reset_index(drop=True), want.reset_index(drop=True))
        # the step's own rows are in the checkpoint; its evaluation's are not yet
        m = pd.read_parquet(ckpt / "metrics.parquet")
        assert m[m.split == "train"].step.max() == step and step not in set(m[m.split == "eval"].step)

    p = _train(cfg_path, run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "evaluating the rest first" in p.stderr
    assert not (run / "checkpoints" / "step-2" / PARTIAL).exists()  # checkpointed again, whole
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(run))
    m = _metrics(run)
    assert not m.duplicated(["step", "split", "role", "metric"]).any()
    assert sorted(m[m.split == "eval"].step.unique()) == [0, 1, 2]
    for name in ("outcomes.parquet", "samples.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(ref / name), pd.read_parquet(run / name))
    out = pd.read_parquet(run / "outcomes.parquet")
    assert len(out) == 3 * 10 and not out.duplicated(["step", "split", "uid"]).any()
    a, b = _final(ref), _final(run)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import parity_train  # noqa: F401  (registers the parity task)

    from marlflow.cli.train import main

    if os.environ.get(ENV):
        _signal_after_chunk(os.environ[ENV])
    sys.exit(main())
