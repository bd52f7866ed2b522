"""GRPO math on toy tensors: grouping invariant, advantages, role loss weights, gradient metrics."""

import math

import pytest
import torch

from marlflow.core import algos


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


# ---------------------------------------------------------------- the grouping invariant, one violation each

G = 3


def voting_step():
    """A valid voting step for two problems x G rollouts: generator0, generator1, aggregator0 per episode."""
    rec = []
    for p in ("p1", "p2"):
        for r in range(G):
            for slot in ("generator0", "generator1", "aggregator0"):
                prompt = [1, 2, 3] if slot != "aggregator0" else [9, r]  # aggregator prompts differ: fine
                rec.append(dict(problem=p, slot=slot, role=slot.rstrip("0123456789"), task="toy_math", rollout=r,
                                prompt=prompt))  # fmt: skip
    return rec


def check(rec, **over):
    index, _ = algos.group_ids([(c["problem"], c["slot"]) for c in rec])
    kw = dict(slots=[c["slot"] for c in rec], rollouts=[c["rollout"] for c in rec],
              prompt_ids=[c["prompt"] for c in rec], group_size=G, workflow="voting")  # fmt: skip
    kw.update(over)
    algos.check_groups(
        index, [c["problem"] for c in rec], [c["role"] for c in rec], [c["task"] for c in rec], **kw
    )


def test_valid_step_passes():
    check(voting_step())


def test_group_missing_a_rollout_fails():
    rec = [
        c
        for c in voting_step()
        if not (c["problem"] == "p1" and c["slot"] == "generator1" and c["rollout"] == 2)
    ]
    with pytest.raises(algos.GroupingError, match="holds 2 calls.*exactly G=3"):
        check(rec)


def test_group_with_a_rollout_twice_fails():
    rec = voting_step()
    rec[3]["rollout"] = 0  # p1 rollout 1 claims to be rollout 0
    with pytest.raises(algos.GroupingError, match="more than once"):
        check(rec)


def test_first_stage_prompts_that_differ_fail():
    rec = voting_step()
    rec[3]["prompt"] = [1, 2, 4]  # p1 rollout 1's generator0 saw another prompt
    with pytest.raises(algos.GroupingError, match="first-stage prompts differ"):
        check(rec)


def test_group_mixing_problems_fails():
    rec = voting_step()
    index = algos.group_ids([(c["problem"], c["slot"]) for c in rec])[0]
    problems = [c["problem"] for c in rec]
    problems[0] = "p9"  # same key, another problem uid: a uid collision
    with pytest.raises(algos.GroupingError, match="mixes"):
        algos.check_groups(index, problems, [c["role"] for c in rec], [c["task"] for c in rec])


def test_group_mixing_roles_fails():
    rec = voting_step()
    rec[0]["role"] = "aggregator"
    with pytest.raises(algos.GroupingError, match="mixes"):
        check(rec)


def test_group_mixing_tasks_fails():
    rec = voting_step()
    rec[0]["task"] = "toy_code"
    with pytest.raises(algos.GroupingError, match="mixes"):
        check(rec)


def test_optional_slots_may_hold_fewer_than_g():
    """Eval-Opt's second round exists only in episodes judged Incorrect: its group may be smaller."""
    rec = []
    for r in range(G):
        for slot in ("generator0", "evaluator0") + (("generator1", "evaluator1") if r < 2 else ()):
            rec.append(dict(problem="p", slot=slot, role=slot[:-1], task="t", rollout=r, prompt=[r] if slot[-1] == "1" else [0]))  # fmt: skip
    check(rec, workflow="eval_opt")
    with pytest.raises(algos.GroupingError, match="exactly G"):
        check([c for c in rec if not (c["slot"] == "evaluator0" and c["rollout"] == 0)], workflow="eval_opt")


# ---------------------------------------------------------------- gradient metrics


def test_amplification_identical_and_orthogonal():
    g = torch.tensor([1.0, -2.0, 0.5])
    assert algos.slot_amplification([g, g.clone(), g.clone()]) == pytest.approx(math.sqrt(3))
    assert algos.mean_pairwise_cosine([g, g.clone(), g.clone()]) == pytest.approx(1.0)
    e = torch.eye(3)
    assert algos.slot_amplification(list(e)) == pytest.approx(1.0)
    assert algos.mean_pairwise_cosine(list(e)) == pytest.approx(0.0)
    assert algos.slot_amplification([g, -g]) == pytest.approx(0.0)  # full cancellation
    assert math.isnan(algos.slot_amplification([g, torch.zeros(3)]))  # one non-zero slot: undefined


def test_projection_shares_two_roles_analytic():
    # g1 = (1, 0), g2 = (1, 1): g = (2, 1), |g|^2 = 5; <g1, g> = 2, <g2, g> = 3
    s = algos.projection_shares(
        {"generator": torch.tensor([1.0, 0.0]), "aggregator": torch.tensor([1.0, 1.0])}
    )
    assert s == {"generator": pytest.approx(0.4), "aggregator": pytest.approx(0.6)}
    # opposing roles: g1 = (2, 0), g2 = (-1, 0): g = (1, 0); shares 2 and -1, still summing to 1
    s = algos.projection_shares({"a": torch.tensor([2.0, 0.0]), "b": torch.tensor([-1.0, 0.0])})
    assert s == {"a": pytest.approx(2.0), "b": pytest.approx(-1.0)}
    assert algos.cosine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == pytest.approx(math.sqrt(0.5))


def test_single_role_grad_norm_same_under_sp_and_ip():
    """One role alone in its policy (single under SP, any role under IP): f_r = 1 under every loss type, so
    grad_norm = ||g_r||; with a second role in the policy (SP) the own-loss norm undoes the n_r/n share."""
    for lt in ("grpo", "dr_grpo", "bnpo", "dapo"):
        assert algos.own_scale(lt, 16, 16, 300, 300) == 1.0
    g_own = torch.tensor([3.0, 4.0])  # gradient of the role's own mean loss
    sp_contrib = g_own * algos.role_loss_weight("grpo", 8, 32, 0, 0)  # its weighted part of the SP loss
    assert (sp_contrib.norm() / algos.own_scale("grpo", 8, 32, 0, 0)).item() == pytest.approx(5.0)


def test_clip_coef_and_ema():
    assert algos.clip_coef(0.5, 1.0) == 1.0 and algos.clip_coef(4.0, 1.0) == pytest.approx(0.25, rel=1e-5)
    ema, cos = algos.ema_update(None, torch.tensor([1.0, 0.0]), 4)
    assert math.isnan(cos) and torch.equal(ema, torch.tensor([1.0, 0.0]))
    ema, cos = algos.ema_update(ema, torch.tensor([0.0, 1.0]), 4)
    assert cos == pytest.approx(0.0) and torch.allclose(ema, torch.tensor([0.75, 0.25]))
    same, cos = algos.ema_update(ema, torch.zeros(2), 4)
    assert same is ema and math.isnan(cos)


def _width(lengths, chunk, prompts=None):
    if prompts is None:
        return max(lengths[i] for i in chunk)
    return max(prompts[i] for i in chunk) + max(lengths[i] - prompts[i] for i in chunk)


@pytest.mark.parametrize("seed", range(30))
def test_token_budget_chunks_respect_both_limits_and_cover_every_call(seed):
    """Every index once; chunks in length order; each within max_calls and the token budget unless it is one
    call wider than the budget; greedy: a chunk ends only where the next call would break a limit."""
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 40)
    lengths = [rng.randint(1, 300) for _ in range(n)]
    prompts = [rng.randint(0, x) for x in lengths] if seed % 2 else None
    max_calls, max_tokens = rng.choice([0, 1, 3, 8]), rng.choice([0, 250, 600, 2000])
    chunks = algos.token_budget_chunks(lengths, max_calls, max_tokens, prompt_lengths=prompts)
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(n))
    assert [lengths[i] for i in flat] == sorted(lengths)  # length-sorted, across and within chunks
    for k, c in enumerate(chunks):
        assert c and (not max_calls or len(c) <= max_calls)
        if max_tokens and len(c) > 1:
            assert len(c) * _width(lengths, c, prompts) <= max_tokens
        if k + 1 < len(chunks):  # greedy: the next chunk's first call did not fit
            nxt = c + chunks[k + 1][:1]
            assert (max_calls and len(nxt) > max_calls) or (
                max_tokens and len(nxt) * _width(lengths, nxt, prompts) > max_tokens
            )


def test_token_budget_chunks_examples():
    lengths = [9, 3, 7, 1, 5, 8, 2]
    # no budget: the length-sorted list cut every max_calls (what micro_batch_size alone did before)
    assert algos.token_budget_chunks(lengths, 2, 0) == [[3, 6], [1, 4], [2, 5], [0]]
    assert algos.token_budget_chunks(lengths, 0, 0) == [[3, 6, 1, 4, 2, 5, 0]]
    # budget 16: 1,2,3,5 (4 x 5 = 20 > 16, so 1,2,3 = 9); 5,7 (14); 8 (8 x 2 = 16); 9
    assert algos.token_budget_chunks(lengths, 0, 16) == [[3, 6, 1], [4, 2], [5], [0]]
    assert algos.token_budget_chunks(lengths, 2, 16) == [[3, 6], [1, 4], [2, 5], [0]]  # 7, 8: 2 x 8 = 16
    assert algos.token_budget_chunks(lengths, 2, 15) == [[3, 6], [1, 4], [2], [5], [0]]
    # a call wider than the budget is a chunk of its own
    assert algos.token_budget_chunks([50, 4, 4], 0, 10) == [[1, 2], [0]]
    assert algos.token_budget_chunks([], 4, 10) == []
    # padded width: prompts 8 and 1, completions 1 and 8: each call is 9 tokens, but the batch is 2 x 16
    assert algos.token_budget_chunks([9, 9], 0, 18) == [[0, 1]]
    assert algos.token_budget_chunks([9, 9], 0, 18, prompt_lengths=[8, 1]) == [[0], [1]]
    assert algos.token_budget_chunks([9, 9], 0, 32, prompt_lengths=[8, 1]) == [[0, 1]]
    with pytest.raises(ValueError, match="prompt_lengths has 1 entries"):
        algos.token_budget_chunks([9, 9], 0, 18, prompt_lengths=[8])
    with pytest.raises(ValueError, match="must be >= 0"):
        algos.token_budget_chunks([9], -1, 0)
