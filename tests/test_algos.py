"""GRPO math on toy tensors: grouping invariant, advantages, role loss weights, gradient shares."""

import pytest
import torch

from marlflow import algos


def test_group_ids_first_seen_order():
    index, keys = algos.group_ids(
        [("p1", "generator0"), ("p2", "generator0"), ("p1", "generator0"), ("p1", "agg")]
    )
    assert index.tolist() == [0, 1, 0, 2]
    assert keys == [("p1", "generator0"), ("p2", "generator0"), ("p1", "agg")]


def test_mixed_group_raises():
    index = torch.tensor([0, 0, 1])
    algos.check_groups(index, ["p1", "p1", "p2"], ["generator"] * 3, ["toy_math"] * 3)  # fine
    with pytest.raises(algos.GroupingError, match="mixes"):
        algos.check_groups(index, ["p1", "p2", "p2"], ["generator"] * 3, ["toy_math"] * 3)
    with pytest.raises(algos.GroupingError):
        algos.check_groups(index, ["p1", "p1", "p2"], ["generator", "aggregator", "generator"], ["t"] * 3)
    with pytest.raises(algos.GroupingError):
        algos.check_groups(index, ["p1", "p1", "p2"], ["generator"] * 3, ["toy_math", "toy_code", "toy_math"])


def test_group_advantages_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv, std = algos.group_advantages(rewards, index, eps=0.0)
    # group 0: mean 0.25, unbiased std 0.5 -> (0.75/0.5, -0.25/0.5 x3)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    assert adv[4:6].tolist() == [0.0, 0.0]  # equal rewards: zero advantage
    assert adv[6].item() == 0.0  # singleton group
    assert torch.allclose(std[:2], torch.tensor([0.5, 0.0]))
    adv_none, _ = algos.group_advantages(rewards, index, scale="none")
    assert torch.allclose(adv_none[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # advantages are zero-mean within every group of size > 1
    for g in (0, 1):
        assert abs(adv[index == g].sum().item()) < 1e-6


def test_role_loss_weights_sum_to_one():
    n, tok = {"generator": 24, "aggregator": 8}, {"generator": 300, "aggregator": 40}
    for lt in ("grpo", "dr_grpo", "bnpo"):
        total = sum(algos.role_loss_weight(lt, n[r], 32, tok[r], 340) for r in n)
        assert total == pytest.approx(1.0)
    assert algos.role_loss_weight("dapo", 24, 32, 300, 340) == 1.0
    with pytest.raises(ValueError):
        algos.role_loss_weight("cispo", 1, 2, 3, 4)


def test_role_weights_reproduce_full_batch_loss():
    # seq-mean-token-mean over the full batch == weighted sum of per-role seq-mean-token-means
    torch.manual_seed(0)
    loss_tok = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    full = ((loss_tok * mask).sum(-1) / mask.sum(-1)).mean()
    parts = [[0, 1, 2, 3], [4, 5]]
    total = sum(((loss_tok[p] * mask[p]).sum(-1) / mask[p].sum(-1)).mean() * len(p) / 6 for p in parts)
    assert torch.allclose(full, total)


def test_grad_shares():
    assert algos.grad_shares({"a": 3.0, "b": 1.0}) == {"a": 0.75, "b": 0.25}
    assert algos.grad_shares({"a": 0.0}) == {"a": 0.0}
