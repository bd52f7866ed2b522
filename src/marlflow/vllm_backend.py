"""vLLM generation backend (optional `gpu` extra): colocated engine, one LoRA adapter per policy.

The engine holds the frozen base model once and serves each policy's adapter as a vLLM LoRA
(SP: one, IP: one per role type). After every optimizer step the trainer calls `on_update()`, which
saves the current adapters to a scratch folder and bumps their LoRA ids so vLLM loads the new weights on
the next request: rollouts always come from the policy being trained. The interface is HFBackend's, so
workflows cannot tell which backend runs.

vllm is imported here and only here; CPU installs never import this module (see generation.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "backend 'vllm' needs the optional GPU extra: pip install -e '.[gpu]' (CUDA-only wheels); "
            f"or set backend: hf in matrix.yaml ({err})"
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "backend 'vllm' needs a CUDA GPU, and torch sees none; run on a GPU node or use backend: hf"
        )


class VLLMBackend:
    def __init__(self, model, tokenizer, policies: tuple[str, ...], cfg):
        require_vllm()
        from vllm import LLM

        self.model, self.tok, self.policies, self.cfg = model, tokenizer, policies, cfg
        self.calls = 0
        self._dir = Path(tempfile.mkdtemp(prefix="marlflow-lora-"))
        self._version = 0
        g = cfg.grpo
        self.llm = LLM(
            model=cfg.model,
            enable_lora=True,
            max_loras=len(policies),
            max_lora_rank=g.lora_r,
            max_model_len=g.max_prompt_length + g.max_completion_length,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            dtype="bfloat16",
            enable_prefix_caching=True,  # role prompts share long prefixes across the G rollouts
            seed=cfg.seed,
        )
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos)
        self.on_update()

    def on_update(self) -> None:
        """Publish the current adapters to vLLM (new LoRA ids force a reload)."""
        from vllm.lora.request import LoRARequest

        self._version += 1
        self.requests = {}
        for i, p in enumerate(self.policies):
            path = self._dir / f"v{self._version}" / p
            self.model.save_pretrained(path.parent, selected_adapters=[p])
            # PEFT writes non-default adapters to a subfolder named after the adapter.
            src = path if (path / "adapter_config.json").exists() else path.parent
            self.requests[p] = LoRARequest(f"{p}-v{self._version}", self._version * 100 + i + 1, str(src))

    def generate(self, policy: str, prompts: list[list[int]], sampling) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        self.calls += 1
        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
            max_tokens=sampling.max_new_tokens, n=1,
        )  # fmt: skip
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=self.requests[policy],
            use_tqdm=False,
        )  # fmt: skip
        result = []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not ids or ids[-1] not in self.eos_ids):
                ids.append(next(iter(self.eos_ids)))
            result.append(ids)
        return result
