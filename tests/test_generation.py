"""The hf backend's decode loop (`marlflow.generation.fastgen.sample`) and grouped-query attention (`use_gqa_sdpa`).

`sample` replaces HF `generate` in the hf backend: these tests check that it returns exactly `generate`'s
tokens (greedy and sampled from the same RNG state, with rows stopping at different steps), that a model whose
generation config adds another logits processor falls back to `generate`, and that the GQA attention gives the
forward of transformers' own SDPA attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlflow.cli.train import build_trainer
from marlflow.generation.fastgen import GQA_SDPA, plain_sampling, use_gqa_sdpa
from marlflow.generation.sampling import Sampling
from marlflow.workflows import rollout


def _prompts(trainer):
    """Every call of a Voting step on 2 problems x 4 rollouts: repeated prompts of several lengths."""
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, *_ = trainer.flatten(episodes)
    return [c.prompt_ids for c in calls]


def _perturb(trainer, seed=0, scale=0.3):
    """Random adapter weights, so the policy is far from the warm start and rows stop at scattered steps."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    trainer.backend.on_update()  # as after any weight change: states stored for the old weights are dropped


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature,top_p",
    [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (0.8, 0.9)],
    ids=["greedy", "T1", "T0.7", "top_p"],
)
def test_sample_returns_generates_tokens(make_cfg, tmp_path, temperature, top_p):
    """The loop that drops finished rows gives HF `generate`'s completions, token for token, from the same
    RNG state: same warpers, and one whole-batch multinomial per step. fp32 model, rows of several lengths."""
    cfg = dataclasses.replace(make_cfg("voting", "sp", task="toy_math"), generation_dtype="model")
    trainer = build_trainer(cfg, tmp_path)
    _perturb(trainer)
    backend, prompts = trainer.backend, _prompts(trainer)
    sampling = Sampling(temperature, top_p, 16)
    model = trainer.model
    model.set_adapter("shared")
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), backend.pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(3)
    with torch.no_grad():
        ref = backend._hf_generate(model, ids, mask, sampling, width)
    torch.manual_seed(3)
    got = backend.generate("shared", prompts, sampling)
    lengths = [len(r) for r in ref]
    assert min(lengths) < max(lengths)  # rows did stop at different steps, so rows were dropped
    assert any(r[-1] in backend.eos_ids for r in ref)
    assert got == ref
    # and the RNG stream is left where generate leaves it
    torch.manual_seed(3)
    with torch.no_grad():
        backend._hf_generate(model, ids, mask, sampling, width)
    after_ref = torch.rand(3)
    torch.manual_seed(3)
    backend.generate("shared", prompts, sampling)
    assert torch.equal(torch.rand(3), after_ref)


def test_other_logits_processors_fall_back_to_generate(make_cfg, tmp_path):
    """A generation config that asks for a processor `sample` does not apply (a repetition penalty) is sampled
    by `generate` itself, so the hf backend never silently drops a model's sampling setting."""
    trainer = build_trainer(dataclasses.replace(make_cfg("single", "sp"), generation_dtype="model"), tmp_path)
    model, prompts = trainer.model, _prompts(trainer)[:3]
    assert plain_sampling(model.generation_config)
    model.generation_config.repetition_penalty = 1.3
    assert not plain_sampling(model.generation_config)
    seen = []
    original = type(model).generate

    def spy(self, *a, **k):
        seen.append(k.get("max_new_tokens"))
        return original(self, *a, **k)

    type(model).generate = spy
    try:
        out = trainer.backend.generate("shared", prompts, Sampling(0.0, 1.0, 5))
    finally:
        type(model).generate = original
    assert seen == [5] and len(out) == 3


def test_gqa_attention_gives_sdpas_forward(make_cfg, tmp_path):
    """The toy model has 4 query and 2 K/V heads. With left padding (a 4D mask), the GQA attention's logits
    equal transformers' "sdpa" bit for bit and its gradients agree to float rounding (the kernel sums the
    query heads of a K/V head in another order); the trainer switches CPU models to it."""
    trainer = build_trainer(make_cfg("voting", "sp"), tmp_path)
    model = trainer.model
    assert model.config._attn_implementation == GQA_SDPA
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prompts = _prompts(trainer)
    prompts = prompts[:3] + prompts[-3:]  # voters' and the aggregators' (longer) prompts
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), trainer.backend.pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    assert (mask == 0).any()
    _perturb(trainer)
    out = {}
    for impl in ("sdpa", GQA_SDPA):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits.float().log_softmax(-1)[..., 7] * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[impl] = logits.detach(), grads
    assert torch.equal(out["sdpa"][0], out[GQA_SDPA][0])
    g_gqa, g_ref = out[GQA_SDPA][1], out["sdpa"][1]
    rel = ((g_gqa - g_ref).norm() / g_ref.norm()).item()
    print(f"relative gradient difference {rel:.2e}")
    assert rel < 1e-5
    model.set_attn_implementation("sdpa")
    assert use_gqa_sdpa(model) and model.config._attn_implementation == GQA_SDPA
    assert not use_gqa_sdpa(model)  # already switched


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["sp", "ip"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T1"])
def test_prefix_kv_reuse_samples_what_a_full_prefill_does(make_cfg, tmp_path, sharing, temperature):
    """Eval-Opt's later prompts extend earlier calls' sequences: with the stored K/V of those (PrefixKV) the
    backend runs only the new tokens, and the episodes are those of full prefills, from the same RNG state.
    Under IP the adapters differ per role, so a state of another policy reused by mistake would show here."""
    cfg = dataclasses.replace(make_cfg("eval_opt", sharing, task="toy_math"), generation_dtype="model")
    trainer = build_trainer(dataclasses.replace(cfg, eval_opt_rounds=3), tmp_path)
    _perturb(trainer, scale=0.05)
    backend, problems = trainer.backend, trainer.eval_problems[:6]
    positions = []  # prompt positions run through the model, seen by the embedding layer
    hook = trainer.model.get_input_embeddings().register_forward_pre_hook(
        lambda m, a: positions.append(a[0].numel())
    )
    store, episodes, ran = backend.prefix_kv, {}, {}
    for reuse in (False, True):
        backend.prefix_kv = store if reuse else None
        backend.on_update()
        positions.clear()
        with torch.random.fork_rng():
            torch.manual_seed(11)
            eps = rollout(trainer.cfg, trainer.task, problems, trainer._ctx(temperature), 2)
        episodes[reuse] = [[(c.slot, c.completion_ids) for c in e.calls] for e in eps]
        ran[reuse] = sum(positions)
    hook.remove()
    assert max(len(e) for e in episodes[False]) >= 4  # a refinement round ran
    assert episodes[True] == episodes[False]
    assert ran[True] < 0.8 * ran[False]


def test_prefix_kv_store():
    """Longest common prefix within a policy only; oldest entries dropped beyond the byte budget; clear."""
    from marlflow.generation.fastgen import PrefixKV

    def kv(n):
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # 64 bytes per token and layer

    store = PrefixKV(budget=64 * 20)
    store.add("gen", (1, 2, 3, 4), kv(4))
    store.add("gen", (1, 2, 9), kv(3))
    store.add("eval", (1, 2, 3, 4, 5, 6), kv(6))
    assert store.match("gen", (1, 2, 3, 4, 5, 6, 7))[0] == 4
    assert store.match("gen", (1, 2, 9, 9))[0] == 3
    assert store.match("gen", (7, 1, 2))[0] == 0 and store.match("other", (1, 2, 3))[0] == 0
    assert store.match("eval", (1, 2, 3, 4, 5, 6, 7))[0] == 6
    n, states = store.match("gen", (1, 2, 3, 0))
    assert n == 3 and states[0][0].shape == (2, 4, 4)  # a partial match of the 4-token sequence
    store.add("gen", (5, 5, 5, 5, 5, 5, 5, 5), kv(8))  # 21 tokens stored > 20: the oldest goes
    assert store.match("gen", (1, 2, 3, 4))[0] == 2 and store.size == 64 * 17
    store.clear()
    assert store.match("gen", (1, 2, 9))[0] == 0 and store.size == 0
