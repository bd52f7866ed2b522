"""RunConfig.sampling_seeds: per-call sampling seeds, and the default stream left as it was.

- per_call: a call's sampled tokens depend on its key (marlflow.generation.sampling.call_seed: rollout seed, purpose,
  problem uid, slot, rollout index) and its logits only: alone, in a batch with other calls, or in a batch in
  another order it samples the same tokens (hf backend, fast path and HF `generate`, on the shipped toy model);
- stream (the default): a toy training rollout and an evaluation sample the token ids, and hand the backend
  the request seeds, that the code before per_call did (a fingerprint recorded from commit dd31066), so the
  committed toy evidence stays what this code samples;
- per_call is not a biased sampler: its first-token frequencies over many keys match the warped softmax
  (temperature, top-p) within a total-variation bound;
- the config refuses ranks > 1 without per_call, and per_call on a path that cannot honour it.

    .venv/bin/pytest -q tests/test_sampling_seeds.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from marlflow import workflows
from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec
from marlflow.generation.sampling import Sampling, call_seed, call_uniforms
from marlflow.models.loading import SHIPPED_TOY
from marlflow.training import rollout as ro


def _cfg(workflow="voting", sharing="sp", **run) -> RunConfig:
    """A small toy-math run on the shipped toy model, sampling from the fp32 model (generation_dtype
    "model": the same kernels on every CPU, unlike the bf16 copy)."""
    grpo = GRPOParams(steps=2, eval_every=1, save_every=1, problems_per_step=2, group_size=4, max_completion_length=12, max_prompt_length=256,
                      lora_r=4, lora_alpha=8, temperature=1.0, eval_temperature=0.7)  # fmt: skip
    return RunConfig(run_id=f"{workflow}-{sharing}-toy-math-s3", workflow=workflow, sharing=sharing, scale="toy",
                     task_axis="math", seed=3, task=TaskSpec(name="toy_math", eval_size=6, train_size=40),
                     model=str(SHIPPED_TOY), grpo=grpo, generation_dtype="model", **run)  # fmt: skip


class _Setup:
    """What a trainer samples with, without the trainer: model with random adapters, hf backend, encoder,
    task and its splits (as marlflow.cli.evaluate builds them)."""

    def __init__(self, cfg: RunConfig, fast: bool = True):
        from marlflow.generation.fastgen import use_gqa_sdpa
        from marlflow.generation.hf import ChatEncoder, HFBackend
        from marlflow.models.loading import attach_adapters, load_model_and_tokenizer
        from marlflow.tasks import get_task
        from marlflow.tasks.splits import run_splits

        torch.manual_seed(0)
        base, tok = load_model_and_tokenizer(cfg.model, device="cpu")
        self.model = attach_adapters(cfg, base)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # random adapters: far from the warm start, so rows stop at scattered steps
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if fast:
            use_gqa_sdpa(self.model)
        self.backend = HFBackend(self.model, tok, cfg.policies, "model", fast=fast)
        self.encoder = ChatEncoder(tok, cfg.grpo.max_prompt_length)
        self.cfg, self.task = cfg, get_task(cfg.task.name)
        self.train, _, self.test = run_splits(self.task, cfg.task)
        self.seeds = []  # the seeds every backend call was handed, in order
        generate = self.backend.generate

        def recording(policy, prompts, sampling, seeds=None):
            self.seeds.append(seeds)
            return generate(policy, prompts, sampling, seeds)

        self.backend.generate = recording

    def train_rollout(self, step: int):
        """The step's training episodes, as MultiAgentGRPOTrainer.train_step rolls them out."""
        cfg = self.cfg
        ctx = ro.context(cfg, self.task, self.backend, self.encoder, cfg.grpo.temperature,
                         seed=ro.rollout_seed(cfg.seed, step))  # fmt: skip
        problems = ro.step_problems(self.train, cfg.seed, step, cfg.grpo.problems_per_step)
        return ro.train_episodes(cfg, self.task, problems, ctx)


def _calls(episodes) -> list:
    return [[e.problem.uid, e.rollout, c.slot, c.completion_ids] for e in episodes for c in e.calls]


def _fingerprint(workflow: str, sharing: str, fast: bool = True) -> tuple[str, int]:
    """sha256 of a stream-mode toy step's and evaluation's calls (uid, rollout, slot, completion ids) and of the
    seeds handed to the backend, and the number of calls."""
    from marlflow.training import evaluation

    s = _Setup(_cfg(workflow, sharing), fast)
    torch.manual_seed(11)  # the trainer's global RNG at the step's start
    calls = _calls(s.train_rollout(1))
    seed = s.cfg.seed + evaluation.EVAL_SEED_OFFSET
    calls += _calls(evaluation.episodes(s.cfg, s.task, s.backend, s.encoder, s.test, seed, False))
    blob = json.dumps([calls, s.seeds])
    return hashlib.sha256(blob.encode()).hexdigest(), len(calls)


PINNED_KEY = (
    1849712487638950909  # call_seed(3, "train", "toy_math-17", "generator0", 2), recorded at dd31066+
)

# Recorded at dd31066 (the code before per_call; MARLFLOW_FASTGEN on and off gave the same) on machine [A]
# (README): `_fingerprint(workflow, sharing)` -> (sha256, calls).
STREAM = {
    ("voting", "sp"): ("b9b26d9eb747310f02881d0179d923612b23b9ea784a3043b3429e2cefc388bb", 56),
    ("eval_opt", "ip"): ("16577e7e55949ac269127435ef6aefd8f02b629cc550dc8f999e077985be7604", 54),
    ("orch_workers", "ip"): ("490a9c767e7c731b5a7f607b2bc784d992729b4b2687cb7db750ce5c210ed4e3", 42),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workflow", "sharing", "fast"),
    [
        ("voting", "sp", True),
        ("eval_opt", "ip", True),
        ("orch_workers", "ip", True),
        ("eval_opt", "ip", False),
    ],
    ids=["voting-fast", "eval_opt-fast", "orch_workers-fast", "eval_opt-reference"],
)
def test_stream_mode_samples_what_it_did_before_per_call(workflow, sharing, fast):
    """The default (sampling_seeds "stream") draws the same tokens, and hands vLLM the same request seeds, as
    the code that sampled the committed toy evidence: a changed token, call order or seed changes the hash."""
    assert _cfg().sampling_seeds == "stream"
    assert _fingerprint(workflow, sharing, fast) == STREAM[(workflow, sharing)]


def _by_call(episodes) -> dict:
    return {(e.problem.uid, e.rollout, c.slot): c.completion_ids for e in episodes for c in e.calls}


@pytest.mark.slow
@pytest.mark.parametrize(("workflow", "sharing"), [("voting", "sp"), ("eval_opt", "ip")])
def test_per_call_rollout_of_a_problem_does_not_depend_on_the_others(workflow, sharing):
    """What an N-rank run relies on: a problem's episodes under per_call are the same whether it is rolled out
    with the step's other problems (1 rank), alone or after them (its rank's share), call for call. Under
    stream the same comparison differs (the check has teeth). Eval-Opt: rounds that only some episodes reach
    make each stage's batch depend on the others; its later prompts reuse stored K/V."""
    per_call = {}
    for mode in ("per_call", "stream"):
        s = _Setup(_cfg(workflow, sharing, sampling_seeds=mode, eval_opt_rounds=3))
        problems = ro.step_problems(s.train, s.cfg.seed, 1, 3)

        def ctx(s=s):
            return ro.context(s.cfg, s.task, s.backend, s.encoder, 1.0, seed=ro.rollout_seed(3, 1))

        torch.manual_seed(5)
        together = _by_call(workflows.rollout(s.cfg, s.task, problems, ctx(), 4))
        torch.manual_seed(5)
        alone = _by_call(workflows.rollout(s.cfg, s.task, problems[2:], ctx(), 4))
        s.backend.forget_states()
        torch.manual_seed(5)
        reordered = _by_call(workflows.rollout(s.cfg, s.task, problems[::-1], ctx(), 4))
        mine = {k: v for k, v in together.items() if k[0] == problems[2].uid}
        assert len(mine) >= 8
        if mode == "stream":
            assert alone != mine or reordered != together, "stream sampling ignored the batch: test is void"
            continue
        assert alone == mine
        assert reordered == together
        assert len({len(v) for v in together.values()}) > 1  # rows stopped at different steps
        per_call = together
    assert per_call


def test_per_call_batch_alone_reordered_and_reference_path_agree():
    """A call's tokens under per_call: alone, in a batch of other calls, in the batch reversed, on the fast
    path and on HF `generate` (PerCallDraw), and with torch's RNG in any state: all the same."""
    s = _Setup(_cfg(sampling_seeds="per_call"))
    ref = _Setup(_cfg(sampling_seeds="per_call"), fast=False)
    problems = s.train[:6]
    prompts = [s.encoder([{"role": "user", "content": p.prompt}]) for p in problems]
    keys = [call_seed(7, "train", p.uid, "generator0", 0) for p in problems]
    sampling = Sampling(0.7, 0.9, 16, seed=7, per_call=True)
    batch = s.backend.generate("shared", prompts, sampling, keys)
    assert len({len(c) for c in batch}) > 1
    torch.manual_seed(123)  # per_call does not read torch's RNG
    assert s.backend.generate("shared", prompts[::-1], sampling, keys[::-1])[::-1] == batch
    for i in (0, 3):
        assert s.backend.generate("shared", [prompts[i]], sampling, [keys[i]]) == [batch[i]]
    assert ref.backend.generate("shared", prompts, sampling, keys) == batch
    assert ref.backend.generate("shared", prompts[2:4], sampling, keys[2:4]) == batch[2:4]
    other = [
        call_seed(7, "train", p.uid, "generator0", 1) for p in problems
    ]  # another rollout: its own draws
    assert s.backend.generate("shared", prompts, sampling, other) != batch
    with pytest.raises(ValueError, match="one key per prompt: got 6 prompts and no seeds"):
        s.backend.generate("shared", prompts, sampling)
    greedy = dataclasses.replace(sampling, temperature=0.0)  # keys change nothing in greedy decoding
    assert s.backend.generate("shared", prompts, greedy, keys) == s.backend.generate(
        "shared", prompts, greedy
    )


def test_context_hands_the_backend_each_calls_key():
    """workflows.Context under per_call: the seeds each backend call gets are call_seed(rollout seed, purpose,
    uid, slot, rollout), what vLLM puts in SamplingParams(seed=); training, evaluation and validation keys
    differ; a rollout without a seed is refused."""
    from marlflow.training import evaluation

    s = _Setup(_cfg("eval_opt", "ip", sampling_seeds="per_call"))
    eps = s.train_rollout(1)
    seed = ro.rollout_seed(3, 1)
    want = sorted(call_seed(seed, "train", e.problem.uid, c.slot, e.rollout) for e in eps for c in e.calls)
    assert sorted(k for seeds in s.seeds for k in seeds) == want and len(set(want)) == len(want)
    s.seeds.clear()
    test = evaluation.episodes(s.cfg, s.task, s.backend, s.encoder, s.test, 9, False)
    val = evaluation.episodes(s.cfg, s.task, s.backend, s.encoder, s.test, 9, False, "val")
    got = [k for seeds in s.seeds for k in seeds]
    half = len(got) // 2
    assert sorted(got[:half]) == sorted(
        call_seed(9, "eval", e.problem.uid, c.slot, 0) for e in test for c in e.calls
    )
    assert not set(got[:half]) & set(got[half:])  # same seed and problems, other purpose: other keys
    assert len(val) == len(test)
    ctx = ro.context(s.cfg, s.task, s.backend, s.encoder, 1.0)
    with pytest.raises(ValueError, match="per-call sampling needs the rollout's seed"):
        workflows.rollout(s.cfg, s.task, s.train[:1], ctx, 2)
    from vllm import SamplingParams  # vLLM takes a 63-bit key as a request seed

    assert SamplingParams(temperature=1.0, seed=max(want)).seed == max(want)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square test of counts against probs, cells with expected count < 5 pooled into one."""
    n = counts.sum()
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = torch.tensor((keep.sum() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))  # chi2 survival


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_per_call_first_token_follows_the_warped_softmax(temperature, top_p):
    """Over 5000 keys, the first token per_call samples for one prompt matches softmax(warped logits): a
    Pearson chi-square p-value above 1e-3 and a total variation under 3x what an exact sampler shows on
    average (deterministic keys, so this holds or not, on every run). The same draws fail against the
    unwarped softmax when there is a warp to miss, and stream sampling (torch.multinomial, seeded) passes the
    same bounds: the check separates samplers. (At T 1 the prompt has ~500 tokens of nonzero probability, at
    T 0.7 / top-p 0.9 three.)"""
    from marlflow.generation import fastgen

    s = _Setup(_cfg(sampling_seeds="per_call"))
    prompt = s.encoder([{"role": "user", "content": s.train[0].prompt}])
    n = 5000
    keys = [call_seed(1, "train", s.train[0].uid, "generator0", g) for g in range(n)]
    sampling = Sampling(temperature, top_p, 1, seed=1, per_call=True)
    with torch.no_grad():
        s.model.set_adapter("shared")
        logits = s.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(fastgen.warpers(sampling)(None, logits[None]), -1)[0].double().numpy()
    # E|count / n - p| <= sqrt(p (1 - p) / n) per token: bounds the total variation of an exact sampler's draws
    noise = 0.5 * np.sqrt(probs * (1 - probs) / n).sum()

    def check(tokens, p=probs):
        counts = np.bincount(np.asarray([t[0] for t in tokens]), minlength=len(p)).astype(float)
        return 0.5 * np.abs(counts / n - p).sum(), _chi2_pvalue(counts, p)

    per_call = s.backend.generate("shared", [prompt] * n, sampling, keys)
    tv, pv = check(per_call)
    assert tv < 3 * noise and pv > 1e-3, (tv, noise, pv)
    if temperature != 1.0:
        assert check(per_call, torch.softmax(logits, -1).double().numpy())[1] < 1e-6
    torch.manual_seed(0)
    tv, pv = check(s.backend.generate("shared", [prompt] * n, dataclasses.replace(sampling, per_call=False)))
    assert tv < 3 * noise and pv > 1e-3, (tv, noise, pv)


def test_draw_and_uniforms():
    """fastgen.draw never picks a zero-probability token and picks token v for u in its CDF interval;
    call_uniforms is SplitMix64 (the reference's first output for seed 0), in (0, 1), a function of (key, t);
    call_seed is pinned (blake2b, the same in a process with another hash seed)."""
    from marlflow.generation import fastgen

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]])
    got = fastgen.draw(probs.repeat(3, 1), [1e-16] * 3 + [0.5] * 3 + [1 - 1e-16] * 3)
    assert got.tolist() == [1, 0, 2, 1, 1, 2, 3, 3, 2]
    assert int(call_uniforms([0], 0)[0] * 2**52) == 0xE220A8397B1DCDAF >> 12
    assert call_uniforms([2**63 - 1], 0)[0] < 1 and call_uniforms([0], 0)[0] > 0
    u = call_uniforms(np.arange(20_000, dtype=np.uint64) * 7919, 3)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert call_uniforms([5, 9], 4).tolist() == [call_uniforms([5], 4)[0], call_uniforms([9], 4)[0]]
    assert call_uniforms([5], 4)[0] != call_uniforms([5], 5)[0]
    key = call_seed(3, "train", "toy_math-17", "generator0", 2)
    assert key == PINNED_KEY and 0 <= key < 2**63
    code = "from marlflow.generation.sampling import call_seed; print(call_seed(3, 'train', 'toy_math-17', 'generator0', 2))"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == key
    assert (
        len({call_seed(3, "train", "u", "s", r) for r in range(100)} | {call_seed(3, "eval", "u", "s", 0)})
        == 101
    )


def test_config_sampling_seeds():
    """stream by default and left out of config.json there (existing runs' configs unchanged); per_call is
    written and read back; ranks > 1 is refused without per_call; an unknown value names the allowed ones;
    matrix.yaml's `run: {sampling_seeds: per_call}` reaches every run's config."""
    import yaml

    from marlflow.pipeline.matrix import run_sheet

    assert "sampling_seeds" not in _cfg().to_dict()
    per = _cfg(sampling_seeds="per_call")
    assert per.to_dict()["sampling_seeds"] == "per_call" and RunConfig.from_dict(per.to_dict()) == per
    with pytest.raises(ConfigError, match="ranks 2 needs sampling_seeds 'per_call', not 'stream'.*per_call"):
        _cfg(ranks=2)
    assert _cfg(ranks=2, sampling_seeds="per_call").ranks == 2
    with pytest.raises(ConfigError, match="sampling_seeds is 'batch'; allowed values: stream, per_call"):
        _cfg(sampling_seeds="batch")
    root = SHIPPED_TOY.parents[3]  # src/marlflow/models/toy_model -> the repository
    doc = yaml.safe_load((root / "matrix.yaml").read_text())
    doc["presets"]["smoke"]["run"] = {"sampling_seeds": "per_call"}
    configs = [json.loads(c) for c in run_sheet(doc, "smoke")["config"]]
    assert configs and {c["sampling_seeds"] for c in configs} == {"per_call"}
