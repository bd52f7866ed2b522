"""GRPO math as pure functions on tensors: grouping, advantages, role loss weights, gradient metrics.

Shapes: N = role calls in a step (all episodes, all slots); G = rollouts per problem; D = parameters of one
policy (flattened). A GRPO group is one (problem, slot) pair across the G rollouts of that problem: slot
generator1 of problem p is compared only with slot generator1 of p in the other rollouts (docs/reference.md,
"How a training step works", step 4). `check_groups` enforces the invariant: every group holds one call per rollout
(exactly G for slots every episode has), identical prompt token ids for first-stage slots, and never mixes
problems, roles or tasks. `token_budget_chunks` packs a slot's calls into forward-backward chunks.

Gradient metrics (one meaning under SP and IP; definitions in marlflow.core.definitions):
projection_shares, cosine, slot_amplification, mean_pairwise_cosine, clip_coef, ema_update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from marlflow.core.workflow_spec import spec_of


class GroupingError(AssertionError):
    """A GRPO group mixes problems, roles or tasks: advantages would compare unlike things."""


def group_ids(keys: Sequence[tuple]) -> tuple[torch.Tensor, list[tuple]]:
    """keys: N hashable group keys -> (index (N,) long in [0, K), the K distinct keys in first-seen order)."""
    index, seen = [], {}
    for k in keys:
        index.append(seen.setdefault(k, len(seen)))
    return torch.tensor(index, dtype=torch.long), list(seen)


def check_groups(
    index: torch.Tensor,
    problems: Sequence[str],
    roles: Sequence[str],
    tasks: Sequence[str],
    *,
    slots: Sequence[str] | None = None,
    rollouts: Sequence[int] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    group_size: int | None = None,
    workflow: str | None = None,
    policies: Sequence[str] | None = None,
) -> None:
    """Raise GroupingError unless every GRPO group is one problem, one role and one task, and (when the
    keyword arguments are given) one policy, at most one call per rollout in 0..G-1, exactly G for the
    workflow's mandatory slots, and identical prompt token ids for its first-stage slots.

    index: (N,) long group ids; problems, roles, tasks, slots, policies: N strings (policies: the adapter each
    call is trained on, RunConfig.policy_of; a group's advantages are one policy's); rollouts: N ints; prompt_ids: N
    token id lists; group_size: G; workflow: a workflow name, whose spec (marlflow.core.workflow_spec) says
    which slots are mandatory (every episode has them) and first-stage (prompt from the problem alone).
    """
    spec = spec_of(workflow) if workflow is not None and slots is not None else None
    members: dict[int, list[int]] = {}
    for i, g in enumerate(index.tolist()):
        members.setdefault(g, []).append(i)
    for g, idx in members.items():
        first = (problems[idx[0]], roles[idx[0]], tasks[idx[0]])
        for i in idx[1:]:
            item = (problems[i], roles[i], tasks[i])
            if item != first:
                raise GroupingError(
                    f"GRPO group {g} mixes (problem, role, task) {first} with {item}; "
                    "a group must be one problem and one role-call slot across the G rollouts"
                )
        if slots is not None and len({slots[i] for i in idx}) > 1:
            raise GroupingError(f"GRPO group {g} mixes slots {sorted({slots[i] for i in idx})}")
        if policies is not None and len({policies[i] for i in idx}) > 1:
            raise GroupingError(f"GRPO group {g} mixes policies {sorted({policies[i] for i in idx})}: each "
                                "call of a group must train the same adapter")  # fmt: skip
        slot = slots[idx[0]] if slots is not None else "?"
        if rollouts is not None:
            seen = [rollouts[i] for i in idx]
            if len(set(seen)) != len(seen):
                raise GroupingError(
                    f"GRPO group {g} ({first[0]}, {slot}) holds rollout(s) "
                    f"{sorted({r for r in seen if seen.count(r) > 1})} more than once; one call per rollout"
                )
            if group_size is not None and any(not 0 <= r < group_size for r in seen):
                raise GroupingError(
                    f"GRPO group {g} ({first[0]}, {slot}) has rollout ids {seen} outside 0..G-1"
                )
        mandatory = spec is not None and spec.is_mandatory(slot)
        if group_size is not None and mandatory and len(idx) != group_size:
            raise GroupingError(
                f"GRPO group {g} ({first[0]}, {slot}) holds {len(idx)} calls; every episode has slot "
                f"{slot}, so it must hold exactly G={group_size}, one per rollout"
            )
        first_stage = spec is not None and spec.is_first_stage(slot)
        if prompt_ids is not None and first_stage:
            ref = list(prompt_ids[idx[0]])
            for i in idx[1:]:
                if list(prompt_ids[i]) != ref:
                    raise GroupingError(
                        f"GRPO group {g} ({first[0]}, {slot}): first-stage prompts differ between "
                        f"rollouts {rollouts[idx[0]] if rollouts else idx[0]} and "
                        f"{rollouts[i] if rollouts else i}; they must be the same token ids"
                    )


def group_advantages(
    rewards: torch.Tensor, index: torch.Tensor, scale: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages.

    rewards: (N,) float; index: (N,) long group ids in [0, K).
    Returns (advantages (N,), group_std (K,)). advantage = (r - mean_group) / (std_group + eps) when
    scale == "group" (the paper's normalisation), r - mean_group when scale == "none". Groups of one
    sample and groups whose rewards are all equal get advantage 0 (std is the unbiased estimate; a
    singleton's is defined as 0).
    """
    k = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(k).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(k).index_add_(0, index, rewards) / count
    dev = rewards - mean[index]
    var = torch.zeros(k).index_add_(0, index, dev**2) / (count - 1).clamp(min=1)
    std = var.sqrt()
    adv = dev if scale == "none" else dev / (std[index] + eps)
    informative = (count[index] > 1) & (std[index] > 0)
    return torch.where(informative, adv, torch.zeros_like(adv)), std


def role_loss_weight(loss_type: str, n_role: int, n_policy: int, tok_role: int, tok_policy: int) -> float:
    """Weight that makes per-role losses add up to the policy's whole-batch loss.

    TRL's `_compute_loss` normalises within the batch it is given. Computing it per role sub-batch and
    summing with these weights reproduces the loss of the policy's full batch (so SP can measure each
    role's gradient contribution without changing the update): grpo / dr_grpo average over sequences,
    bnpo over tokens, and dapo divides by the global token count passed as `num_items_in_batch`.
    """
    if loss_type in ("grpo", "dr_grpo"):
        return n_role / n_policy
    if loss_type == "bnpo":
        return tok_role / tok_policy
    if loss_type == "dapo":
        return 1.0
    raise ValueError(f"no role weighting defined for loss_type {loss_type!r}")


def grad_shares(norms: dict[str, float]) -> dict[str, float]:
    """Each role's share of the step's gradient mass: ||g_r|| / sum_r' ||g_r'|| (0 if all are 0)."""
    total = sum(norms.values())
    return {r: (v / total if total > 0 else 0.0) for r, v in norms.items()}


def token_budget_chunks(
    lengths: Sequence[int], max_calls: int, max_tokens: int, *, prompt_lengths: Sequence[int] | None = None
) -> list[list[int]]:
    """Pack the calls of one slot into forward-backward chunks by count and by padded tokens.

    lengths: n ints, prompt + completion tokens per call. max_calls: most calls per chunk (0 = no cap).
    max_tokens: most padded tokens per chunk, calls x the chunk's padded width (0 = no budget).
    prompt_lengths: optional n ints, the prompt part of each length. Without it a chunk's width is its longest
        call; with it, the width of the batch the trainer actually builds (prompts left-padded to the longest
        prompt, completions right-padded to the longest completion): max prompt + max completion, which is
        the longest call or more when the longest prompt and the longest completion are different calls.
    Returns chunks of indices into `lengths` that cover each index once: indices sorted by length (ties in
    index order), cut greedily into runs, each with len <= max_calls and len x width <= max_tokens. A single
    call wider than the budget is a chunk of its own (it cannot be split; the budget is then exceeded by it
    alone, which is the least any chunking can do).

    Like verl's dynamic batch size (`use_dynamic_bsz` with `ppo_max_token_len_per_gpu`), this bounds a
    chunk's activation memory, which grows with calls x width, and the padding mask a mixed-length chunk
    keeps per layer, 2 bytes x calls x width^2 <= 2 x max_tokens x width. Chunking is exact for the
    gradient as long as each chunk's loss is weighted by its share of the batch (`role_loss_weight`).
    With max_tokens = 0 the chunks are the length-sorted list cut every max_calls calls.
    """
    n = len(lengths)
    if prompt_lengths is not None and len(prompt_lengths) != n:
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries but lengths has {n}")
    if max_calls < 0 or max_tokens < 0:
        raise ValueError(f"max_calls ({max_calls}) and max_tokens ({max_tokens}) must be >= 0 (0 = no limit)")
    prompts = prompt_lengths if prompt_lengths is not None else [0] * n
    chunks: list[list[int]] = []
    cur: list[int] = []
    wide_p = wide_c = 0  # the current chunk's longest prompt and longest completion (or longest call)
    for i in sorted(range(n), key=lambda j: lengths[j]):
        p, c = prompts[i], lengths[i] - prompts[i]
        width = max(wide_p, p) + max(wide_c, c)
        full = (max_calls and len(cur) >= max_calls) or (max_tokens and (len(cur) + 1) * width > max_tokens)
        if cur and full:
            chunks.append(cur)
            cur, wide_p, wide_c = [], 0, 0
        cur.append(i)
        wide_p, wide_c = max(wide_p, p), max(wide_c, c)
    if cur:
        chunks.append(cur)
    return chunks


# ---------------------------------------------------------------- gradient metrics (flat gradients, (D,))


def own_scale(loss_type: str, n_role: int, n_policy: int, tok_role: int, tok_policy: int) -> float:
    """f_r: the role's share of its policy's loss normaliser (calls for grpo / dr_grpo, completion tokens for
    bnpo / dapo). ||g_r|| / f_r is the gradient norm of the role's own mean loss, whatever else shares the
    policy, so it means the same under SP and IP (under IP, or for a single-role policy, f_r = 1)."""
    if loss_type in ("grpo", "dr_grpo"):
        return n_role / n_policy if n_policy else 0.0
    if loss_type in ("bnpo", "dapo"):
        return tok_role / tok_policy if tok_policy else 0.0
    raise ValueError(f"no role normaliser defined for loss_type {loss_type!r}")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two (D,) vectors; NaN if either is zero."""
    na, nb = a.norm().item(), b.norm().item()
    if na == 0 or nb == 0:
        return math.nan
    return float(torch.dot(a, b).item() / (na * nb))


def projection_shares(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """<g_r, g> / ||g||^2 per role, g = sum of the (D,) role gradients of one policy. Sums to 1 (up to
    float error); a role pulling against the others gets a negative share. All NaN if g = 0."""
    total = torch.stack(list(grads.values())).sum(0)
    sq = torch.dot(total, total).item()
    return {r: (torch.dot(g, total).item() / sq if sq > 0 else math.nan) for r, g in grads.items()}


def block_gram(grads: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """(m, m) inner products of m slot gradients that live on the direct sum of several parameter blocks
    (sharing agent: one adapter per agent): blocks[i] is gradient i's block, gradients of one block are (D_b,)
    on it and zero elsewhere, so two of different blocks have product 0 (and may differ in length)."""
    m = len(grads)
    out = torch.zeros(m, m, dtype=torch.float64)
    for i in range(m):
        for j in range(i, m):
            if blocks[i] == blocks[j]:
                out[i, j] = out[j, i] = torch.dot(grads[i].double(), grads[j].double())
    return out


def slot_amplification(grads: Sequence[torch.Tensor], blocks: Sequence[int] | None = None) -> float:
    """||sum_i g_i|| / sqrt(sum_i ||g_i||^2) over the non-zero (D,) slot gradients of one role: 1 when they
    are orthogonal, sqrt(m) when m are identical, < 1 when they cancel. NaN with fewer than 2 non-zero.
    blocks: each gradient's parameter block (`block_gram`), for slots on several adapters."""
    keep = [i for i, g in enumerate(grads) if g.norm().item() > 0]
    if len(keep) < 2:
        return math.nan
    if blocks is not None:
        gram = block_gram([grads[i] for i in keep], [blocks[i] for i in keep])
        return float(math.sqrt(max(gram.sum().item(), 0.0)) / math.sqrt(gram.diagonal().sum().item()))
    stack = torch.stack([grads[i] for i in keep])
    return float(stack.sum(0).norm().item() / math.sqrt(float((stack * stack).sum().item())))


def mean_pairwise_cosine(grads: Sequence[torch.Tensor], blocks: Sequence[int] | None = None) -> float:
    """Mean cosine over pairs of the non-zero (D,) slot gradients; NaN with fewer than 2. blocks: as in
    `slot_amplification`."""
    keep = [i for i, g in enumerate(grads) if g.norm().item() > 0]
    if len(keep) < 2:
        return math.nan
    if blocks is not None:
        gram = block_gram([grads[i] for i in keep], [blocks[i] for i in keep])
        d = gram.diagonal().sqrt()
        c = gram / torch.outer(d, d)
    else:
        u = torch.stack([grads[i] / grads[i].norm() for i in keep])
        c = u @ u.T
    m = len(keep)
    return float((c.sum().item() - c.diagonal().sum().item()) / (m * (m - 1)))


def clip_coef(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies the gradient by: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def ema_update(ema: torch.Tensor | None, g: torch.Tensor, window: int) -> tuple[torch.Tensor | None, float]:
    """(new EMA, cosine of g with the previous EMA). ema, g: (D,). Weight 1/window per step; a zero g leaves
    the EMA unchanged (cosine NaN); the first non-zero g starts it (cosine NaN)."""
    if g.norm().item() == 0:
        return ema, math.nan
    if ema is None:
        return g.detach().clone(), math.nan
    cos = cosine(g, ema)
    return ema + (g.detach() - ema) / window, cos
