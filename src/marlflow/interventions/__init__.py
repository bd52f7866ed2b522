"""Interventions against the paper's two failure mechanisms, as small functions the trainer calls at one hook.

The paper (arXiv 2605.24202) explains its failures as same-role gradient amplification under IP (parallel
slots of one role add up) and dominant-role capture under SP (one role's gradient takes the shared update).
An intervention is a matrix axis value: a preset's `interventions:` block in matrix.yaml maps a name to a
kind and its parameters, and the run id gets `-<name>` (marlflow.pipeline.matrix.run_id):

    interventions:
      kl_agg:   {kind: kl_anchor, beta: {aggregator: 0.05}}      # I1: per-role KL anchor
      coh:      {kind: coherence, lam: 0.3, window: 128}         # I6: coherence regulariser
      srn:      {kind: same_role_norm}                           # parallel same-role slots weigh as one call
      mb:       {kind: mass_balance, cap: 0.6}                   # SP: no role's projection share above cap
      cg:       {kind: cliff_guard, max_restores: 2, lr_factor: 0.5}  # on a cliff, back to the best eval

Kinds, parameters and their ranges are in marlflow.core.config.INTERVENTION_KINDS (validated when a RunConfig is
built). The trainer's update (marlflow.training.update: `finish_policy`, `apply_step`) applies them at one place:

- on the loss: `role_beta` gives the KL coefficient of each role's sub-batch (the global grpo.beta, or I1's
  per-role value on top of it); the KL term is TRL's k3 estimator (`k3_kl`) against the base model, i.e. the
  role's adapter disabled;
- on the gradient, after every role of a policy has run its backward and before clipping: `role_scales`
  returns one factor per role; the policy's gradient becomes sum_r scale_r * g_r.

- after an evaluation (cliff_guard): `guard_observe` adds the eval to the guard's curve and says whether it
  is a new best (the trainer then keeps a copy of the adapters and optimizer moments); `guard_check` runs the
  analysis's calibrated cliff test on that curve and says whether to restore the copy.

Gradient and test functions are pure (flat (D,) tensors, an (n, n) Gram matrix or an eval curve in, numbers
out); the state (I6's per-role EMA; cliff_guard's curve, best copy and restore count) is in `State`, which the
trainer checkpoints.

cliff_guard, the online form of the analysis's cliff flag (marlflow.core.stats.curve_tests): its curve
is the run's evals since the last restore, starting with the best one. After each eval that is not a new
best, the curve is tested exactly as the analysis tests a finished run (every eval before the last is a
candidate peak, compared with the mean of the up-to-`window` evals after it, by max(0.05, z * SE of the
difference), z from a union bound over the candidates), at level alpha / L where L is the number of evals the
run makes after step 0 (`eval_looks`): testing after every eval is L looks at one curve, and the union bound
over them keeps the chance that a flat run is ever restored at or below alpha (simulated: <= 2.3% at alpha
0.04, p in {0.3, 0.5, 0.8}, n in {32, 200}, 13 or 51 evals; a 12-point drop at n = 200 is caught in 96% of
runs, mostly by the next eval). On a cliff, at most `max_restores` times per run, the trainer puts back the
best eval's adapters and AdamW moments, multiplies every policy's learning rate (and its schedule) by
`lr_factor`, and trains on: the step counter and the data schedule go on, so the curve continues from the
restored weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from marlflow.core import algos, stats
from marlflow.core.workflow_spec import spec_of

# ---------------------------------------------------------------- KL (loss side)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 ("low-variance") KL estimate of KL(pi || ref) from samples of pi, as TRL and verl compute
    it: exp(ref - logp) - (ref - logp) - 1 (>= 0; unbiased for the KL when tokens are sampled from pi).
    logps, ref_logps: (B, T) log-probabilities of the sampled tokens under the policy and the reference."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def masked_mean_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over sequences of the mean k3 over each sequence's completion tokens (the 'grpo' loss
    aggregation): the number beta multiplies in the loss for loss_type grpo."""
    kl = k3_kl(logps, ref_logps) * mask
    return float((kl.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean().item())


def role_beta(spec: dict, role: str, global_beta: float) -> float:
    """KL coefficient of `role`'s sub-batch: grpo.beta, plus I1's per-role beta (kl_anchor) for that role."""
    if spec.get("kind") == "kl_anchor":
        return global_beta + float(spec["beta"].get(role, 0.0))
    return global_beta


# ---------------------------------------------------------------- gradient side (pure)


def coherence_scale(g: torch.Tensor, ema: torch.Tensor | None, lam: float) -> float:
    """I6: 1 - lam * max(0, cos(g, ema)). No EMA yet (first step) or a zero vector: 1 (cos undefined)."""
    if ema is None:
        return 1.0
    cos = algos.cosine(g, ema)
    if not math.isfinite(cos):
        return 1.0
    return 1.0 - lam * max(0.0, cos)


def parallel_slots(workflow: str, role: str, slots: list[str]) -> int:
    """How many of `slots` (the slots of `role` that ran this step) are parallel same-role calls; 1 if the
    role has none (so its scale stays 1). Which slots run in parallel on the same input is the workflow's
    spec (parallel_role, parallel_slots: the amplification the paper measures under IP); Eval-Opt's generator
    rounds are sequential refinements, not parallel copies, so they are not normalised."""
    spec = spec_of(workflow)
    return max(1, sum(spec.is_parallel_slot(role, s) for s in slots))


def same_role_scale(workflow: str, role: str, slots: list[str]) -> float:
    """same_role_norm: 1/m for a role with m parallel slots, so together they weigh as one call."""
    return 1.0 / parallel_slots(workflow, role, slots)


def gram(grads: list[torch.Tensor]) -> torch.Tensor:
    """(n, n) float64 Gram matrix of n flat (D,) gradients: all that projection shares need."""
    stack = torch.stack([g.double() for g in grads])
    return (stack @ stack.T).cpu()


def scaled_shares(G: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Projection shares of the contributions a_r * g_r in g = sum_r a_r g_r, from the Gram matrix G:
    a_r (G a)_r / (a^T G a). NaN where the total is zero."""
    a = a.to(G.dtype)
    tot = float(a @ G @ a)
    if tot <= 0:
        return torch.full_like(a, math.nan)
    return a * (G @ a) / tot


def mass_balance_scales(G: torch.Tensor, cap: float, tol: float = 1e-6, rounds: int = 100) -> torch.Tensor:
    """Scales a (n,) in (0, 1] such that no role's projection share of sum_r a_r g_r exceeds `cap`.

    A role over the cap is scaled down by bisection on its own factor (its share goes to 0 as its factor
    does, so the root exists); lowering one role raises the others', so this repeats until all are under.
    Roles at or under the cap keep factor 1 unless a later round lowers them. Shares sum to 1, so a cap
    below 1/n cannot hold for every role; it is raised to 1/n (equal shares) in that case.
    G: (n, n) Gram matrix of the role gradients (`gram`)."""
    n = G.shape[0]
    a = torch.ones(n, dtype=torch.float64)
    if n < 2 or float(a @ G @ a) <= 0:
        return a
    cap = max(cap, 1.0 / n)
    for _ in range(rounds):
        s = scaled_shares(G, a)
        over = [r for r in range(n) if s[r] > cap + tol]
        if not over:
            break
        r = max(over, key=lambda i: float(s[i]))
        lo, hi = 0.0, float(a[r])
        for _ in range(60):
            mid = (lo + hi) / 2
            a[r] = mid
            if scaled_shares(G, a)[r] > cap:
                hi = mid
            else:
                lo = mid
        a[r] = lo
    return a


# ---------------------------------------------------------------- state and the hook


@dataclass
class State:
    """What an intervention remembers across steps; checkpointed with the optimizers.

    ema: role -> I6's EMA of the role's own-loss gradient (flat, fp32).
    evals: cliff_guard's curve, [(step, accuracy, n)] since the last restore, the best eval first after one.
    best: cliff_guard's copy of the best eval, {step, acc, n, adapters, optimizers} (policy -> CPU copies of
        the adapter's state dict and its optimizer's); None before the first eval.
    restores: how many times cliff_guard restored; lr_scale: the product of its lr_factors so far."""

    ema: dict[str, torch.Tensor] = field(default_factory=dict)
    evals: list[tuple[int, float, int]] = field(default_factory=list)
    best: dict | None = None
    restores: int = 0
    lr_scale: float = 1.0

    def state_dict(self) -> dict:
        return {
            "ema": cpu_copy(self.ema),
            "guard": {"evals": list(self.evals), "best": cpu_copy(self.best), "restores": self.restores,
                      "lr_scale": self.lr_scale},
        }  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        self.ema = dict(sd.get("ema", {}))
        guard = sd.get("guard", {})  # checkpoints written before cliff_guard existed have none
        self.evals = [tuple(e) for e in guard.get("evals", [])]
        self.best = guard.get("best")
        self.restores, self.lr_scale = guard.get("restores", 0), guard.get("lr_scale", 1.0)


def role_scales(
    spec: dict,
    state: State,
    workflow: str,
    grads: dict[str, torch.Tensor],
    own: dict[str, float],
    slots: dict[str, list[str]],
) -> dict[str, float]:
    """The hook: one gradient factor per role of one policy, after its backward and before clipping.

    grads: role -> g_r, the role's flat contribution to the policy gradient; own: role -> f_r (its share of
    the policy's loss normaliser, g_r / f_r is the gradient of its own mean loss); slots: role -> the slots
    that ran. Reads `state` only; `commit` updates it once the whole step is known to be finite."""
    kind = spec.get("kind", "none")
    if kind == "coherence":
        return {
            r: coherence_scale(g / own[r] if own[r] > 0 else g, _dev(state.ema.get(r), g), spec["lam"])
            for r, g in grads.items()
        }
    if kind == "same_role_norm":
        return {r: same_role_scale(workflow, r, slots.get(r, [])) for r in grads}
    if kind == "mass_balance" and len(grads) >= 2:
        a = mass_balance_scales(gram(list(grads.values())), spec["cap"])
        return {r: float(x) for r, x in zip(grads, a)}
    return {r: 1.0 for r in grads}


def commit(spec: dict, state: State, grads: dict[str, torch.Tensor], own: dict[str, float]) -> None:
    """After a finite step: I6's EMA takes in each role's (unscaled) own-loss gradient."""
    if spec.get("kind") != "coherence":
        return
    for r, g in grads.items():
        if own.get(r, 0) > 0:
            ema, _ = algos.ema_update(_dev(state.ema.get(r), g), g / own[r], spec["window"])
            if ema is not None:
                state.ema[r] = ema


def _dev(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(like.device)


# ---------------------------------------------------------------- cliff_guard (after an evaluation)


def eval_looks(steps: int, eval_every: int) -> int:
    """How many evals a run makes after step 0 (every eval_every steps, and the last step)."""
    return steps // eval_every + (steps % eval_every != 0)


def guard_observe(state: State, step: int, acc: float, n: int) -> bool:
    """Add an eval to cliff_guard's curve; True if it is a new best (strictly above the best so far, so ties
    keep the earlier step), when the caller should replace `state.best` with a copy of the current weights."""
    state.evals.append((int(step), float(acc), int(n)))
    return state.best is None or acc > state.best["acc"]


def guard_check(evals: list[tuple[int, float, int]], restores: int, spec: dict, looks: int) -> dict:
    """cliff_guard's decision on its curve `evals` [(step, accuracy, n)], in eval order.

    The analysis's cliff test (stats.curve_tests, window spec["window"]) at level spec["alpha"] / looks.
    Returns {cliff, fire, drop, drop_se, drop_z}: cliff, the test's verdict (never on a last eval at or above
    every earlier one: the current weights are as good as any copy); fire, cliff and restores <
    spec["max_restores"]; drop, drop_se, drop_z, the test's peak - terminal difference, its SE and its
    critical value."""
    acc = [a for _, a, _ in evals]
    r = stats.curve_tests([acc], [[n for *_, n in evals]], has_base=False, window=spec["window"],
                          alpha=spec["alpha"] / max(1, looks))  # fmt: skip
    cliff = len(acc) >= 2 and acc[-1] < max(acc[:-1]) and bool(r["cliff"][0])
    out = {k: float(r[k][0]) for k in ("drop", "drop_se", "drop_z")}
    return {"cliff": cliff, "fire": cliff and restores < spec["max_restores"], **out}


def cpu_copy(obj):
    """A deep copy of a (nested dict / list of) state dict with every tensor detached, cloned and on the
    CPU: optimizer.state_dict() and get_peft_model_state_dict() return the live tensors, which later steps
    change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj
