"""Full fine-tuning at every sharing unit (`adapter: full`, marlflow.models.policies.FullPolicies): real TRL
training steps on the toy model, each policy a whole trainable copy of the model.

Selected with `pytest -k full_ft` (the resume and 2-rank tests are in test_resume.py and test_dp_train.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_trainer import _rel, _update_grads  # importing it also registers the parity task

from marlflow.cli.train import build_trainer, run
from marlflow.core.config import ConfigError
from marlflow.models.runs import find_checkpoint, load_policy_model
from marlflow.workflows import rollout


def _full(make_cfg, workflow, sharing, **grpo):
    return dataclasses.replace(make_cfg(workflow, sharing, task="parity", **grpo), adapter="full")


def _flat(model) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in model.parameters()])


def test_full_ft_run_trains_every_policys_whole_model_and_exports_it(make_cfg, tmp_path):
    """Voting under agent with full fine-tuning: four whole models (one per voter, one aggregator) train for
    two steps, the frozen base stays as it was, and final/<policy>/ is a transformers folder that
    AutoModelForCausalLM loads with exactly the trained weights, as `marlflow chat` / `eval` load them."""
    from transformers import AutoModelForCausalLM

    cfg = _full(make_cfg, "voting", "agent")
    assert "adapter" in cfg.to_dict() and "adapter" not in make_cfg("voting", "agent").to_dict()
    run(cfg, tmp_path)
    assert json.loads((tmp_path / "DONE").read_text())["steps"] == 2
    step, ckpt = find_checkpoint(tmp_path)
    model, _ = load_policy_model(cfg, tmp_path, ckpt)
    base = _flat(model.reference)
    base_file = AutoModelForCausalLM.from_pretrained(cfg.model)
    assert torch.equal(base, _flat(base_file))  # the reference is the untouched base
    for policy in cfg.policies:
        trained = _flat(model.for_policy(policy))
        assert not torch.equal(trained, base), policy
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / policy)
        assert torch.equal(_flat(exported), trained), policy
    card = (tmp_path / "final" / "README.md").read_text()
    assert "library_name: transformers" in card and "full fine-tuning" in card


def test_full_ft_gradient_of_each_policy_is_its_own_calls_alone(make_cfg, tmp_path):
    """IP with full fine-tuning: each policy's whole-model gradient in one update equals the one its own role's
    calls give alone, and the other policy gets none (no leak through the shared batch or normaliser)."""
    trainer = build_trainer(_full(make_cfg, "voting", "ip", max_grad_norm=1e6), tmp_path)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    both = _update_grads(trainer, calls, adv)
    n_model = sum(t.numel() for t in trainer.model.reference.parameters())
    assert set(both) == {"generator", "aggregator"} and all(g.numel() == n_model for g in both.values())
    for role in both:
        own = [i for i, c in enumerate(calls) if c.role == role]
        alone = _update_grads(trainer, [calls[i] for i in own], adv[own])
        assert set(alone) == {role}
        assert both[role].norm() > 0 and _rel(both[role], alone[role]) < 1e-5, role


def test_full_ft_gradient_equals_plain_trls_on_the_whole_batch(make_cfg, tmp_path):
    """SP with full fine-tuning: update()'s chunked, zero-advantage-skipping, prefix-sharing backward gives the
    whole-model gradient of plain TRL's `_compute_loss` on the policy's whole batch (TRL's own forward)."""
    trainer = build_trainer(_full(make_cfg, "voting", "sp", max_grad_norm=1e6), tmp_path)
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    adv = adv.clone()
    adv[::3] = 0.0
    trainer.model.set_adapter("shared")
    trainer.model.train()
    tokens = sum(len(c.completion_ids) for c in calls)
    trainer.trl.share_prefix = False
    ref = trainer.trl.loss(trainer.model, trainer.collate(calls, adv, tokens), 0.0).loss
    ref.backward()
    trainer.trl.share_prefix = True
    shared = trainer.policies["shared"]
    ref_grad = torch.cat([p.grad.flatten() for p in shared.params]).clone()
    assert all(p.grad is None for p in trainer.model.reference.parameters())  # the base gets no gradient
    shared.optimizer.zero_grad(set_to_none=True)
    got = _update_grads(trainer, calls, adv)
    assert ref_grad.norm() > 0 and _rel(got["shared"], ref_grad) < 1e-4


def test_full_ft_kl_reference_is_the_frozen_base(make_cfg, tmp_path):
    """The KL term's reference log-probs under full fine-tuning come from the frozen base, not the policy."""
    trainer = build_trainer(_full(make_cfg, "single", "sp"), tmp_path)
    with torch.no_grad():
        for t in trainer.policies["shared"].params:
            t.add_(0.05 * torch.randn_like(t))
    episodes = rollout(trainer.cfg, trainer.task, trainer.problems_for(1), trainer._ctx(1.0), 4)
    calls, _, adv, _, _ = trainer.flatten(episodes)
    inputs = trainer.collate(calls, adv, sum(len(c.completion_ids) for c in calls))
    trainer.model.set_adapter("shared")
    ref = trainer.trl.ref_logps(trainer.model, inputs)
    with torch.no_grad():
        pol, _ = trainer.trl.trl_logps(trainer.model, inputs)
        trainer.model.policy_models["shared"] = trainer.model.reference  # what the reference must equal
        base, _ = trainer.trl.trl_logps(trainer.model, inputs)
    assert torch.allclose(ref, base, atol=1e-6) and not torch.allclose(ref, pol, atol=1e-3)


def test_full_ft_is_refused_where_it_cannot_run(make_cfg):
    with pytest.raises(ConfigError, match="adapter 'full'.*vllm"):
        dataclasses.replace(make_cfg("voting", "ip"), adapter="full", backend="vllm", device="cpu")
    with pytest.raises(ConfigError, match="adapter"):
        dataclasses.replace(make_cfg("voting", "ip"), adapter="qlora")
