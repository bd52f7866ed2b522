"""What every intervention shares: the hooks interface (`Intervention`, and `NoIntervention` for kind none),
`build`, which makes a run's intervention from its config, the checkpointed `State`, what an intervention
sees after an evaluation (`Evaluated`), and the pure helpers more than one place uses (the k3 KL estimate,
Gram-matrix projection shares, CPU copies of state dicts, the number of evaluations a run makes).

    from marlflow.interventions import build
    itv = build(cfg)                          # the class cfg.intervention_spec's kind names (InterventionSpec.hooks)
    itv.role_scales(grads, own, slots)        # {role: factor}, or None for kind none

Pure functions take flat (D,) tensors, an (n, n) Gram matrix or state dicts and return numbers or copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module

import torch

from marlflow.core.intervention_spec import InterventionError, InterventionSpec, spec_of

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


# ---------------------------------------------------------------- projection shares (gradient side)


def gram(grads: list[torch.Tensor]) -> torch.Tensor:
    """(n, n) float64 Gram matrix of n flat (D,) gradients: all that projection shares need."""
    stack = torch.stack([g.double() for g in grads])
    return (stack @ stack.T).cpu()


def scaled_shares(G: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Projection shares of the contributions a_r * g_r in g = sum_r a_r g_r, from the (n, n) Gram matrix G
    and (n,) factors a: a_r (G a)_r / (a^T G a). NaN where the total is zero."""
    a = a.to(G.dtype)
    tot = float(a @ G @ a)
    if tot <= 0:
        return torch.full_like(a, math.nan)
    return a * (G @ a) / tot


# ---------------------------------------------------------------- copies and the evaluation schedule


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


def eval_looks(steps: int, eval_every: int) -> int:
    """How many evals a run makes after step 0 (every eval_every steps, and the last step)."""
    return steps // eval_every + (steps % eval_every != 0)


# ---------------------------------------------------------------- state


@dataclass
class State:
    """What an intervention remembers across steps; checkpointed with the optimizers (the trainer's
    state_dict()["interventions"], one format for every kind).

    ema: role -> coherence's EMA of the role's own-loss gradient (flat, fp32).
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


# ---------------------------------------------------------------- the hooks


@dataclass(frozen=True)
class Evaluated:
    """What `Intervention.after_eval` is given after an evaluation; the trainer makes it."""

    step: int = field(metadata={"help": "the step just evaluated (0: the untrained adapters)"})
    rows: list = field(
        metadata={
            "help": "the run's metric rows so far, this evaluation's included (split eval, and val with "
            "task.val_size); read them, do not change them"
        }
    )
    snapshot: Callable[[], dict] = field(
        metadata={
            "help": "snapshot() -> CPU copies of the weights, {'adapters': {policy: state dict}, "
            "'optimizers': {policy: AdamW state dict}}"
        }
    )
    restore: Callable[[dict, float], None] = field(
        metadata={
            "help": "restore(snapshot, lr_factor): put a snapshot's adapters and AdamW states back (the "
            "schedulers keep their step), multiply every policy's learning rate and schedule by "
            "lr_factor, and publish the adapters to the rollout engine"
        }
    )


class Intervention:
    """The hooks an intervention kind gives the trainer, each changing nothing here (role_scales reports factor
    1 for every role); a kind subclasses this and overrides the hooks it acts through (its
    InterventionSpec.hooks names the subclass).

    The update (marlflow.training.update) calls, for each policy and step:
      role_beta(role, beta)             on the loss: the KL coefficient of `role`'s sub-batch;
      role_scales(grads, own, slots)    on the gradient, after every role of a policy has run its backward and
                                        before clipping: one factor per role; the policy's gradient becomes
                                        sum_r scale_r * g_r (a factor other than 1 replaces it);
      commit(grads, own)                after every policy's gradient is finite, before the optimizer steps:
                                        what the intervention learns from the step goes into `self.state`.
    The trainer calls after_eval(Evaluated) after each evaluation (step 0 included) and logs what it returns.

    cfg: the RunConfig (its intervention_spec, checked and with defaults, is `self.spec`). `state` is
    checkpointed through state_dict() / load_state_dict(); hooks read it only in role_scales and write it in
    commit and after_eval.
    keeps_grads: the update keeps each role's flat gradient until commit (False: it may free them earlier).
    reads_evals: after_eval needs each evaluation as it happens, step 0 included, so step 0's evaluation is
        never deferred to another run of the cell (marlflow.training.base_eval)."""

    keeps_grads = True
    reads_evals = False

    def __init__(self, cfg):
        self.cfg, self.spec, self.state = cfg, cfg.intervention_spec, State()

    def role_beta(self, role: str, beta: float) -> float:
        """The KL coefficient of `role`'s sub-batch, given grpo.beta."""
        return beta

    def role_scales(
        self, grads: dict[str, torch.Tensor], own: dict[str, float], slots: dict[str, list[str]]
    ) -> dict[str, float] | None:
        """One gradient factor per role of one policy (1: unchanged); logged as itv_scale.

        grads: role -> g_r, the role's flat (P,) contribution to the policy gradient; own: role -> f_r (its
        share of the policy's loss normaliser: g_r / f_r is the gradient of its own mean loss); slots: role ->
        the slots that ran. Reads `self.state` only; `commit` updates it once the whole step is finite."""
        return {r: 1.0 for r in grads}

    def commit(self, grads: dict[str, torch.Tensor | None], own: dict[str, float]) -> None:
        """After a finite step: take in the roles' (unscaled) gradients, role -> (P,) (None where freed)."""

    def after_eval(self, ev: Evaluated) -> dict[str, float]:
        """After the evaluation of ev.step: metrics to log at that step (split train, role all)."""
        return {}

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_state_dict(sd)


class NoIntervention(Intervention):
    """Kind none: nothing is scaled or logged (no itv_scale), and no role gradient is kept for commit."""

    keeps_grads = False

    def role_scales(self, grads, own, slots) -> None:
        return None


def hooks_class(spec: InterventionSpec) -> type[Intervention]:
    """The Intervention subclass `spec.hooks` ('module:Class') names; InterventionError if there is none."""
    module, _, name = spec.hooks.partition(":")
    where = f"InterventionSpec {spec.name!r}: hooks {spec.hooks!r}"
    try:
        cls = getattr(import_module(module), name)
    except ModuleNotFoundError as err:
        raise InterventionError(f"{where}: module {module!r} cannot be imported ({err})") from err
    except AttributeError as err:
        raise InterventionError(f"{where}: module {module!r} has no {name}") from err
    if not (isinstance(cls, type) and issubclass(cls, Intervention)):
        raise InterventionError(f"{where} is not a subclass of marlflow.interventions.Intervention")
    return cls


def build(cfg) -> Intervention:
    """The run's intervention: its kind's hooks class (InterventionSpec.hooks) made from cfg, a RunConfig
    (whose intervention_spec RunConfig has checked)."""
    return hooks_class(spec_of(cfg.intervention_spec["kind"]))(cfg)
