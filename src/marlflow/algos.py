"""GRPO math as pure functions on tensors: grouping, advantages, role loss weights, gradient shares.

Shapes: N = role calls in a step (all episodes, all slots); G = rollouts per problem.
A GRPO group is one (problem, slot) pair across the G rollouts of that problem: slot generator1 of
problem p is compared only with slot generator1 of p in the other rollouts (DESIGN.md "Workflows and
credit"). `check_groups` enforces that no group mixes problems, roles or tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GroupingError(AssertionError):
    """A GRPO group mixes problems, roles or tasks: advantages would compare unlike things."""


def group_ids(keys: Sequence[tuple]) -> tuple[torch.Tensor, list[tuple]]:
    """keys: N hashable group keys -> (index (N,) long in [0, K), the K distinct keys in first-seen order)."""
    index, seen = [], {}
    for k in keys:
        index.append(seen.setdefault(k, len(seen)))
    return torch.tensor(index, dtype=torch.long), list(seen)


def check_groups(
    index: torch.Tensor, problems: Sequence[str], roles: Sequence[str], tasks: Sequence[str]
) -> None:
    """Raise GroupingError if any group holds more than one problem uid, role type or task."""
    members: dict[int, tuple[str, str, str]] = {}
    for i, g in enumerate(index.tolist()):
        item = (problems[i], roles[i], tasks[i])
        first = members.setdefault(g, item)
        if first != item:
            raise GroupingError(
                f"GRPO group {g} mixes (problem, role, task) {first} with {item}; "
                "a group must be one problem and one role-call slot across the G rollouts"
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
