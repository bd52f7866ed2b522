"""The hf backend's decode loop (`marlflow.generation.sample`) and grouped-query attention (`use_gqa_sdpa`).

`sample` replaces HF `generate` in the hf backend: these tests check that it returns exactly `generate`'s
tokens (greedy and sampled from the same RNG state, with rows stopping at different steps), that a model whose
generation config adds another logits processor falls back to `generate`, and that the GQA attention gives the
forward of transformers' own SDPA attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlflow.generation import GQA_SDPA, Sampling, plain_sampling, use_gqa_sdpa
from marlflow.train import build_trainer
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
