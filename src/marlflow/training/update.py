"""The update half of a training step: role calls -> per-policy gradients -> one optimizer step per policy.

`MultiAgentGRPOTrainer.update` (marlflow.training.trainer) runs, for each policy (SP: "shared"; IP: one per role type):

    pg = policy_backward(engine, ...)     # backward over this process's chunks: p.grad, g_r, per-slot g_s, sums
    ---- data-parallel hook: all-reduce pg here (see PolicyGrad), before anything reads a gradient ----
    finite = finish_policy(pg, ...)       # role metrics, the intervention hook, norm, proj_share, cos_others
and after every policy, `apply_step`: gradient EMAs, the intervention's commit, clip + AdamW + scheduler.

Everything a metric reads is in `PolicyGrad` (flat gradients and plain sums), so a data-parallel run sums
those over ranks at the hook and every metric after it means the same at any rank count. The gradient
accounting is pure functions on flat (P,) tensors (P = the policy's adapter parameters), tested on toy tensors
in tests/test_update.py; what the metrics mean: marlflow.core.definitions, "Gradient metrics".
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from marlflow.core import algos


@dataclasses.dataclass
class Piece:
    """What one forward-backward chunk of n calls reports (`engine.piece_loss`).

    loss: the chunk's weighted TRL loss (scalar tensor); entropy, clip: the chunk's mean entropy and clip ratio
    times n; kl: its mean k3 KL times n (None without a KL term); gap, gap_n: sum of |logp_rollout -
    logp_trainer| over its sampled tokens and their count."""

    loss: torch.Tensor
    entropy: float
    clip: float
    kl: float | None
    gap: float
    gap_n: int


@dataclasses.dataclass
class RoleGrad:
    """One role's part of its policy's gradient after the local backward.

    g: (P,) the flat gradient the role's calls added (= the sum of `slot_grads` on metric steps); slot_grads:
    (P,) per slot that ran (metric steps only, first-seen slot order); f: the role's share of the policy's loss
    normaliser (algos.own_scale; ||g|| / f is its own mean-loss gradient norm); slots: the role's slots;
    calls / live: its calls and those run (nonzero advantage, or all with a KL term); loss: sum of its chunks'
    losses; entropy / clip / kl: per chunk, mean x calls; gap / gap_n: rollout-trainer log-prob gap sums."""

    role: str
    slots: list[str]
    calls: int
    live: int
    f: float
    g: torch.Tensor | None = None
    slot_grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grad_slots: list[str] = dataclasses.field(default_factory=list)  # the slot of each slot_grads entry
    # each slot_grads entry's parameter block when the role spans several policies (role_view: the entries are
    # then each on its own policy's parameters, not padded to g's length); empty: all on g's parameters
    slot_blocks: list[int] = dataclasses.field(default_factory=list)
    loss: float = 0.0
    entropy: list[float] = dataclasses.field(default_factory=list)
    clip: list[float] = dataclasses.field(default_factory=list)
    kl: list[float] = dataclasses.field(default_factory=list)
    gap: float = 0.0
    gap_n: int = 0

    def add(self, piece: Piece) -> None:
        self.entropy.append(piece.entropy)
        self.clip.append(piece.clip)
        if piece.kl is not None:
            self.kl.append(piece.kl)
        self.gap, self.gap_n = self.gap + piece.gap, self.gap_n + piece.gap_n


@dataclasses.dataclass
class PolicyGrad:
    """One policy's gradient after the backward over this process's chunks, before anything reads it.

    params: the policy's adapter parameters (their .grad is the accumulated gradient, zeros where unused);
    raw: (P,) that gradient, flat; roles: role -> RoleGrad, in the order they ran; finite: every chunk's loss
    was finite (a False stops the step: no parameter changes).

    Data parallel (issue 27): `reduce_policy_grad` goes between `policy_backward` and `finish_policy`: it sums
    over ranks each param's .grad, `raw`, every RoleGrad's g and slot_grads, and its loss, calls, live,
    entropy/clip/kl sums and gap sums, and AND-reduces `finite`; `policy_backward` then normalises with the
    step's global counts (`policy_counts` summed over the ranks by `sum_counts`)."""

    policy: str
    params: list
    raw: torch.Tensor
    roles: dict[str, RoleGrad]
    finite: bool = True


# ------------------------------------------------------------------ pure gradient accounting


def flat_grad(params) -> torch.Tensor:
    """(P,) the parameters' gradients concatenated (zeros for a parameter without one); P = sum of numel."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten() for p in params]
    )


def set_flat_grad(params, flat: torch.Tensor) -> None:
    """Put (P,) `flat` back into the parameters' .grad (the inverse of `flat_grad`), each in its own dtype."""
    i = 0
    for p in params:
        p.grad = flat[i : i + p.numel()].view_as(p).to(p.dtype).clone()
        i += p.numel()


def finite_stats(d: dict, **values: float) -> None:
    """Set the finite values in `d`; a metric that is undefined this step (NaN: a zero gradient, fewer than
    two slots with a gradient) is left out rather than logged as NaN."""
    d.update({k: float(v) for k, v in values.items() if math.isfinite(v)})


def role_stats(rg: RoleGrad) -> dict:
    """A role's train metrics from its RoleGrad: loss, grad_norm (||g|| / f, the role's own mean-loss
    gradient; 0 when f = 0), grad_contrib_pre (||g||), live_frac; with two or more slots slot_amplification
    and slot_cos; over the calls run entropy, clip_frac, kl (with a KL term); logp_gap (with rollout log-probs)."""
    pre = rg.g.norm().item()
    out = {"loss": rg.loss, "grad_norm": pre / rg.f if rg.f > 0 else 0.0, "grad_contrib_pre": pre,
           "live_frac": rg.live / rg.calls}  # fmt: skip
    if len(rg.slot_grads) >= 2:  # parallel same-role calls (Voting, Orch-Workers), Eval-Opt rounds
        blocks = rg.slot_blocks or None
        finite_stats(out, slot_amplification=algos.slot_amplification(rg.slot_grads, blocks),
                     slot_cos=algos.mean_pairwise_cosine(rg.slot_grads, blocks))  # fmt: skip
    if rg.live:  # entropy and clipping of the calls that were run (with nonzero advantage)
        out.update(entropy=sum(rg.entropy) / rg.live, clip_frac=sum(rg.clip) / rg.live)
    if rg.kl:  # k3 KL to the base model, mean over the role's calls
        out["kl"] = sum(rg.kl) / rg.live
    if rg.gap_n:  # rollout-trainer agreement over the sampled tokens of those calls
        out["logp_gap"] = rg.gap / rg.gap_n
    return out


def combine(grads: dict[str, torch.Tensor], scales: dict[str, float]) -> torch.Tensor:
    """(P,) sum_r scales[r] * grads[r]: the policy gradient after the intervention's per-role factors."""
    return torch.stack([scales[r] * g for r, g in grads.items()]).sum(0)


def sharing_stats(grads: dict[str, torch.Tensor], raw: torch.Tensor) -> dict[str, dict]:
    """role -> {proj_share, cos_others}: each role's (P,) g_r projected on the policy's summed gradient, and,
    with two or more roles on the policy (SP), its cosine to the rest (raw - g_r; raw: (P,) the unscaled sum)."""
    out: dict[str, dict] = defaultdict(dict)
    for role, v in algos.projection_shares(grads).items():
        finite_stats(out[role], proj_share=v)
    if len(grads) >= 2:  # SP: does a role pull with or against the rest of its policy?
        for role, g in grads.items():
            finite_stats(out[role], cos_others=algos.cosine(g, raw - g))
    return out


def clipped_contributions(
    norms: dict[str, float],
    roles_of: dict[str, list[str]],
    pre: dict[str, float],
    scales: dict[str, float],
    max_norm: float,
) -> dict[str, tuple[float, float]]:
    """role -> (clip_coef of its policy, grad_contrib_post = clip_coef * scale * pre): what clipping each
    policy's gradient (norms: policy -> its norm after the intervention) leaves of each role's contribution
    (pre: role -> ||g_r||, or (policy, role) -> the part of g_r on that policy; scales: role -> the
    intervention's factor, 1 when absent). A role on several policies (sharing 'agent') has parts on disjoint
    parameters: its grad_contrib_post is the norm of its clipped parts, sqrt(sum_k (c_k scale ||g_k||)^2), and
    its clip_coef the ratio of that to its unclipped norm (its policies' common coefficient when they agree)."""
    parts: dict[str, list[tuple[float, float]]] = {}
    for policy, norm in norms.items():
        c = algos.clip_coef(norm, max_norm)
        for role in roles_of[policy]:
            parts.setdefault(role, []).append((c, pre.get((policy, role), pre.get(role))))
    out = {}
    for role, ps in parts.items():
        s = scales.get(role, 1.0)
        if len(ps) == 1:
            out[role] = (ps[0][0], ps[0][0] * s * ps[0][1])
            continue
        post = math.sqrt(sum((c * s * p) ** 2 for c, p in ps))
        whole = math.sqrt(sum(p * p for _, p in ps))
        out[role] = (post / (s * whole) if whole > 0 else min(c for c, _ in ps), post)
    return out


def role_view(
    done: list[PolicyGrad], counts: dict[str, dict], loss_type: str, layout: dict[str, list[tuple[str, int]]]
) -> dict[str, RoleGrad]:
    """role -> one RoleGrad over every policy that trains it, in first-seen order: the policy's own RoleGrad
    for a role that one policy holds (SP, IP, and every role but the parallel one under sharing 'agent').

    layout: role -> [(policy, P_k), ...] for each role that several policies hold (under 'agent' the parallel
    role, one adapter per slot, P_k its parameters). Such a role is joined on the direct sum of those adapters,
    (P,) with P = sum P_k, always all of them (a policy without calls this step is a zero part, so the space
    is the same at every step): g is the parts' g concatenated in layout order, each slot gradient is
    kept on its own adapter with its block index (`RoleGrad.slot_blocks`; slots on different adapters are
    orthogonal in the joined space, so slot_cos is 0 and slot_amplification 1: nothing piles up in shared
    parameters; algos.block_gram computes both without padding), calls, live, losses and sums add, and f is
    set so that ||g|| / f is the norm of the role's own mean-loss gradient, cat_k(w_k g_k / f_k) with
    w_k = algos.own_scale(loss_type, part k's calls and tokens of the role's). counts: the step's
    `policy_counts` (all ranks)."""
    by_policy = {pg.policy: pg for pg in done}
    out = {rg.role: rg for pg in done for rg in pg.roles.values() if rg.role not in layout}
    for role, parts in layout.items():
        ps = [(p, size, by_policy[p].roles.get(role) if p in by_policy else None) for p, size in parts]
        if all(rg is None for *_, rg in ps):
            continue
        nt = [counts.get(p, {"roles": {}})["roles"].get(role, [0, 0]) for p, *_ in ps]  # [calls, tokens]
        n_r, tok_r = sum(n for n, _ in nt), sum(t for _, t in nt)
        device = next(rg.g for *_, rg in ps if rg is not None).device
        gs = [rg.g if rg is not None else torch.zeros(size, device=device) for _, size, rg in ps]
        g = torch.cat(gs)
        w = [algos.own_scale(loss_type, n, n_r, t, tok_r) for n, t in nt]
        own = torch.cat([wk * gk / (rg.f if rg is not None and rg.f > 0 else 1.0)
                         for wk, gk, (*_, rg) in zip(w, gs, ps)])  # fmt: skip
        norm_own, norm_g = own.norm().item(), g.norm().item()
        live = [rg for *_, rg in ps if rg is not None]
        merged = RoleGrad(role, _union(rg.slots for rg in live), sum(rg.calls for rg in live),
                          sum(rg.live for rg in live), norm_g / norm_own if norm_own > 0 else 1.0, g=g)  # fmt: skip
        for k, (*_, rg) in enumerate(ps):
            for slot, sg in zip(rg.grad_slots if rg else [], rg.slot_grads if rg else []):
                merged.slot_grads.append(sg)
                merged.grad_slots.append(slot)
                merged.slot_blocks.append(k)
        for rg in live:
            merged.loss += rg.loss
            merged.entropy += rg.entropy
            merged.clip += rg.clip
            merged.kl += rg.kl
            merged.gap, merged.gap_n = merged.gap + rg.gap, merged.gap_n + rg.gap_n
        out[role] = merged
    return out


def joined_stats(role: str, rg: RoleGrad, done: list[PolicyGrad], metrics: bool) -> dict:
    """A role's metrics from its `role_view` RoleGrad when several policies hold it (sharing 'agent'):
    role_stats, and on metric steps proj_share / cos_others against the summed gradient of the joined
    policies that ran (a policy without calls adds zeros to both)."""
    out = role_stats(rg)
    if metrics:
        held = [pg for pg in done if role in pg.roles]
        raw, g = torch.cat([pg.raw for pg in held]), torch.cat([pg.roles[role].g for pg in held])
        rest = raw - g
        grads = {role: g, **({"": rest} if rest.norm().item() > 0 else {})}
        out.update(sharing_stats(grads, raw)[role])
    return out


# ------------------------------------------------------------------ counts and the data-parallel reduce


def policy_counts(cfg, calls) -> dict[str, dict]:
    """policy -> {"n": calls, "tok": completion tokens, "roles": {role: [calls, tokens]}} of `calls` (first-seen
    role order): what the loss normalisers and each role's f are computed from."""
    out: dict[str, dict] = {}
    for c in calls:
        d = out.setdefault(cfg.policy_of(c.role, c.slot), {"n": 0, "tok": 0, "roles": {}})
        r = d["roles"].setdefault(c.role, [0, 0])
        d["n"], d["tok"] = d["n"] + 1, d["tok"] + len(c.completion_ids)
        r[0], r[1] = r[0] + 1, r[1] + len(c.completion_ids)
    return out


def sum_counts(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """The sum of several `policy_counts` (one per rank, in rank order): the step's global counts."""
    out: dict[str, dict] = {}
    for part in parts:
        for policy, d in part.items():
            o = out.setdefault(policy, {"n": 0, "tok": 0, "roles": {}})
            o["n"], o["tok"] = o["n"] + d["n"], o["tok"] + d["tok"]
            for role, (n, tok) in d["roles"].items():
                r = o["roles"].setdefault(role, [0, 0])
                r[0], r[1] = r[0] + n, r[1] + tok
    return out


def _union(lists) -> list:
    return list(dict.fromkeys(x for xs in lists for x in xs))


def reduce_policy_grad(pg: PolicyGrad | None, policy: str, params: list) -> PolicyGrad | None:
    """`pg` summed over the ranks (marlflow.training.distributed; the identity for one process): the PolicyGrad one
    process would have computed from every rank's calls, on every rank. pg: this rank's, None when it had no
    call of `policy` (it still takes part). Returns None when no rank had any.

    Roles, slots and slot gradients are matched by name (a rank may lack a role, or a slot without live calls,
    that another has) and ordered by first appearance in rank order, which with contiguous shards
    (distributed.shard) is the 1-rank order. Sums over ranks change the float summation order: results agree
    with one process within rounding (tests/test_distributed.py)."""
    from marlflow.training import distributed

    desc = None if pg is None else {
        "finite": pg.finite,
        "roles": [{"role": r, "slots": rg.slots, "grad_slots": rg.grad_slots, "calls": rg.calls, "live": rg.live,
                   "f": rg.f, "loss": rg.loss, "entropy": sum(rg.entropy), "clip": sum(rg.clip),
                   "kl": sum(rg.kl), "has_kl": bool(rg.kl), "gap": rg.gap, "gap_n": rg.gap_n}
                  for r, rg in pg.roles.items()],
    }  # fmt: skip
    present = [d for d in distributed.gather(desc) if d is not None]
    if not present:
        return None
    by_role: dict[str, list[dict]] = {}
    for d in present:
        for rd in d["roles"]:
            by_role.setdefault(rd["role"], []).append(rd)
    grad_slots = {r: _union(rd["grad_slots"] for rd in rds) for r, rds in by_role.items()}
    size = sum(p.numel() for p in params)
    zero = torch.zeros(size, device=params[0].device)
    mine = {} if pg is None else pg.roles
    parts = [pg.raw if pg is not None else zero]
    for role, slots in grad_slots.items():
        rg = mine.get(role)
        parts.append(rg.g if rg is not None and rg.g is not None else zero)
        for slot in slots:
            has = rg is not None and slot in rg.grad_slots
            parts.append(rg.slot_grads[rg.grad_slots.index(slot)] if has else zero)
    (total,) = distributed.all_reduce_sum([torch.cat(parts)])
    chunks = iter(total.split(size))
    raw = next(chunks)
    roles = {}
    for role, rds in by_role.items():
        rg = RoleGrad(role, _union(rd["slots"] for rd in rds), sum(rd["calls"] for rd in rds),
                      sum(rd["live"] for rd in rds), rds[0]["f"], g=next(chunks))  # fmt: skip
        rg.slot_grads = [next(chunks) for _ in grad_slots[role]]
        rg.grad_slots = grad_slots[role]
        rg.loss = sum(rd["loss"] for rd in rds)
        rg.entropy, rg.clip = [sum(rd["entropy"] for rd in rds)], [sum(rd["clip"] for rd in rds)]
        rg.kl = [sum(rd["kl"] for rd in rds)] if any(rd["has_kl"] for rd in rds) else []
        rg.gap, rg.gap_n = sum(rd["gap"] for rd in rds), sum(rd["gap_n"] for rd in rds)
        roles[role] = rg
    set_flat_grad(params, raw)  # what clipping and AdamW read
    return PolicyGrad(policy, params, raw, roles, all(d["finite"] for d in present))


# ------------------------------------------------------------------ the backward over local chunks


def pieces(ridx: list[int], calls, max_calls: int, max_tokens: int = 0) -> list[list[list[int]]]:
    """A role's calls per slot (first-seen slot order), each slot sorted by length and cut into
    forward-backward chunks of at most `max_calls` calls (0 = no cap) and at most `max_tokens` padded tokens
    (0 = no budget): `algos.token_budget_chunks` with the width `collate` pads to, longest prompt + longest
    completion (a chunk whose completions are all empty is one EOS token wider than counted).

    Chunks stay within a slot because calls of one slot have similar lengths (little padding; Eval-Opt's
    refinement prompts are ~5x its first prompt) and because each slot's gradient is measured. Sorting puts
    calls of similar length in one chunk, so a chunk pads to its own longest call, not the slot's. Both are
    exact: every chunk's loss carries its `role_loss_weight`, and gradients add up over chunks."""
    by_slot: dict[str, list[int]] = defaultdict(list)
    for i in ridx:
        by_slot[calls[i].slot].append(i)
    out = []
    for idx in by_slot.values():
        prompts = [len(calls[i].prompt_ids) for i in idx]
        lengths = [p + len(calls[i].completion_ids) for p, i in zip(prompts, idx)]
        chunks = algos.token_budget_chunks(lengths, max_calls, max_tokens, prompt_lengths=prompts)
        out.append([[idx[k] for k in chunk] for chunk in chunks])
    return out


def policy_backward(engine, cfg, policy: str, params: list, calls, adv: torch.Tensor, metrics: bool,
                    counts: dict | None = None):  # fmt: skip
    """Backward of `policy`'s calls (those `cfg.policy_of` routes to it), role by role, slot by slot, chunk by
    chunk; returns its PolicyGrad, or None when no call is routed to it. adv: (N,) per call.

    engine: the trainer; `engine.piece_loss(calls, adv, tok_pol, weight, beta) -> Piece` computes a chunk's
    weighted loss (TRL's `_compute_loss`), and `engine.itv.role_beta` (the run's intervention) gives each
    role's KL coefficient beta. Stops at the first non-finite loss (PolicyGrad.finite False).
    metrics: also measure each slot's gradient (one flat gradient per slot instead of per role).
    counts: the policy's entry of the step's global `policy_counts` (data parallel: summed over the ranks), which
    the loss normalisers and each role's f use; None: counted from `calls`."""
    idx = [i for i, c in enumerate(calls) if cfg.policy_of(c.role, c.slot) == policy]
    if not idx:
        return None
    engine.model.set_adapter(policy)  # PEFT: only the active adapter requires grad
    engine.model.train()
    for p in params:
        p.grad = None
    counts = counts or policy_counts(cfg, [calls[i] for i in idx])[policy]
    n_pol, tok_pol = counts["n"], counts["tok"]
    prev = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    pg = PolicyGrad(policy, params, prev, {})
    for role in dict.fromkeys(calls[i].role for i in idx):
        if not pg.finite:  # the step is discarded: no later role's backward is run
            break
        ridx = [i for i in idx if calls[i].role == role]
        rg, prev, pg.finite = _role_backward(engine, cfg, role, ridx, calls, adv, params, prev, n_pol, tok_pol,
                                             metrics, counts["roles"][role])  # fmt: skip
        pg.roles[role] = rg
    for p in params:  # AdamW skips a None grad; a zero grad keeps its moments decaying as before
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pg.raw = prev
    return pg


def _role_backward(engine, cfg, role, ridx, calls, adv, params, prev, n_pol, tok_pol, metrics, role_counts):
    """One role's chunks: (RoleGrad, the policy's flat gradient so far, whether every loss was finite)."""
    g = cfg.grpo
    beta = engine.itv.role_beta(role, g.beta)
    # A call with zero advantage adds exactly nothing to the GRPO loss (no KL term is used with beta=0, the
    # default everywhere here), so it is not run; the weights below are computed on the calls that are, which
    # keeps every loss type's normalisation exact. A slot (or a whole role) whose calls all have zero advantage
    # therefore has no gradient this step. With a KL term (beta > 0) every call has a gradient, so all run.
    live = [i for i in ridx if adv[i] != 0] if beta == 0 else ridx
    # f_r: the role's share of the policy's loss normaliser over all its calls (zero-advantage ones included,
    # as in the whole-batch loss); ||g_r|| / f_r is the norm of the role's own mean-loss gradient, the same
    # number under SP and IP. f_r = 0 only when the role produced no completion tokens (bnpo/dapo), and then
    # g_r = 0 as well.
    # role_counts: the role's [calls, completion tokens] in the step (all ranks): f is the global role's share.
    f = algos.own_scale(g.loss_type, role_counts[0], n_pol, role_counts[1], tok_pol)
    rg = RoleGrad(role, list(dict.fromkeys(calls[i].slot for i in ridx)), len(ridx), len(live), f)
    start, ok = prev, True
    for slot_pieces in pieces(live, calls, cfg.micro_batch_size, cfg.max_chunk_tokens):
        for piece in slot_pieces:
            pcalls = [calls[i] for i in piece]
            tok = sum(len(c.completion_ids) for c in pcalls)
            w = algos.role_loss_weight(g.loss_type, len(piece), n_pol, tok, tok_pol)
            got = engine.piece_loss(pcalls, adv[piece], tok_pol, w, beta)
            rg.add(got)
            if not torch.isfinite(got.loss):
                ok = False
                break
            got.loss.backward()
            rg.loss += got.loss.item()
        if not ok:
            break
        if metrics:
            flat = flat_grad(params)
            rg.slot_grads.append(flat - prev)
            rg.grad_slots.append(calls[slot_pieces[0][0]].slot)
            prev = flat
    if not metrics:
        prev = flat_grad(params)
    rg.g = prev - start  # = sum of its slots' gradients
    return rg, prev, ok


# ------------------------------------------------------------------ after the (reduced) gradient is known


def finish_policy(pg: PolicyGrad, cfg, itv, stats: dict, metrics: bool, keep: bool = False) -> float:
    """Role metrics into `stats` (role -> dict), then the intervention hook, then the policy's norm; returns it.

    itv: the run's intervention (marlflow.interventions.Intervention). Its hook `role_scales` (the KL
    intervention acts on the loss instead) runs after every role's backward and before clipping, on a finite
    gradient: the per-role factors replace the policy's .grad by `combine(g_r, scales)` where any factor is
    not 1 (None, kind none: nothing is scaled or logged); its state is read only (apply_step commits it). The
    metrics describe the raw role gradients; itv_scale says what the intervention did. keep: keep every role's
    g and slot gradients for `role_view` (sharing 'agent', where a role's stats join several policies)."""
    for role, rg in pg.roles.items():
        stats[role].update(role_stats(rg))
    grads = {r: rg.g for r, rg in pg.roles.items()}
    flat = pg.raw
    f, slots = {r: rg.f for r, rg in pg.roles.items()}, {r: rg.slots for r, rg in pg.roles.items()}
    scales = itv.role_scales(grads, f, slots) if pg.finite else None
    if scales is not None:
        for role, sc in scales.items():
            stats[role]["itv_scale"] = sc
        if any(sc != 1.0 for sc in scales.values()):
            flat = combine(grads, scales)
            set_flat_grad(pg.params, flat)
    norm = flat.norm().item()
    if pg.finite and math.isfinite(norm) and metrics:
        for role, v in sharing_stats(grads, pg.raw).items():
            stats[role].update(v)
    for rg in pg.roles.values():  # free what apply_step does not read: one policy's slot gradients at a time
        if keep:
            continue
        rg.slot_grads = []
        if not (metrics or itv.keeps_grads):
            rg.g = None
    return norm


def apply_step(
    trainer,
    done: list[PolicyGrad],
    norms: dict[str, float],
    stats: dict,
    metrics: bool,
    roles: dict[str, RoleGrad] | None = None,
) -> None:
    """After every policy's finite gradient: each role's gradient EMA (metric steps: ema_cos), the
    intervention's commit, then per policy clip to grpo.max_grad_norm, AdamW step and scheduler step; the
    roles' clip_coef, grad_contrib_post and grad_share (their shares of the applied, clipped update), and the
    workflow's loss, grad_norm and lr under "all". trainer: grad_ema, itv, and policies (policy -> its
    PolicyState: params, optimizer, scheduler; marlflow.training.trainer). roles: the step's `role_view` (None:
    each policy's own roles, which is the view unless a role spans several policies)."""
    cfg, g = trainer.cfg, trainer.cfg.grpo
    view = roles or {rg.role: rg for pg in done for rg in pg.roles.values()}
    roles = list(view.values())
    if metrics:
        for rg in roles:  # coherence: the role's own-loss gradient against its history
            if rg.f > 0:
                ema = trainer.grad_ema.get(rg.role)
                ema, cos = algos.ema_update(None if ema is None else ema.to(rg.g.device), rg.g / rg.f,
                                            g.grad_ema_window)  # fmt: skip
                if ema is not None:
                    trainer.grad_ema[rg.role] = ema
                finite_stats(stats[rg.role], ema_cos=cos)
    trainer.itv.commit({rg.role: rg.g for rg in roles}, {rg.role: rg.f for rg in roles})
    roles_of = {pg.policy: list(pg.roles) for pg in done}
    # ||g|| of each (policy, role) part: role_stats' grad_contrib_pre, except for a role joined over several
    # policies (role_view), whose stats are the joined role's
    pre = {(pg.policy, r): stats[r]["grad_contrib_pre"] if view[r] is rg else rg.g.norm().item()
           for pg in done for r, rg in pg.roles.items()}  # fmt: skip
    scales = {r: stats[r]["itv_scale"] for rs in roles_of.values() for r in rs if "itv_scale" in stats[r]}
    post = clipped_contributions(norms, roles_of, pre, scales, g.max_grad_norm)
    for role, (coef, contrib) in post.items():
        stats[role].update(clip_coef=coef, grad_contrib_post=contrib)
    for policy in norms:
        st = trainer.policies[policy]
        torch.nn.utils.clip_grad_norm_(st.params, g.max_grad_norm)
        st.optimizer.step()
        st.scheduler.step()
        st.optimizer.zero_grad(set_to_none=True)
    for role, v in algos.grad_shares({r: p for r, (_, p) in post.items()}).items():
        stats[role]["grad_share"] = v
    stats["all"].update(
        loss=sum(rg.loss for rg in roles),
        grad_norm=math.sqrt(sum(v * v for v in norms.values())),
        lr=trainer.policies[cfg.policies[0]].scheduler.get_last_lr()[0],
    )


def scale_schedule(optimizer, scheduler, lrs: list[tuple[float, float]], factor: float) -> None:
    """Put each param group's (lr, initial_lr) = `lrs` and scale the scheduler's base_lrs by `factor`, through
    its state_dict (cliff_guard's restore: the schedule goes on from its step at `factor` x the rate).

    transformers' schedulers are LambdaLR: lr = base_lr * schedule(step), recomputed from base_lrs at every
    scheduler.step(), so the next step's lr (what the update logs) is the scaled one; get_last_lr() answers
    the old rate until that step, and nothing reads it before."""
    for gr, (lr, initial) in zip(optimizer.param_groups, lrs):
        gr["lr"], gr["initial_lr"] = lr, initial
    state = scheduler.state_dict()
    scheduler.load_state_dict({**state, "base_lrs": [b * factor for b in state["base_lrs"]]})
