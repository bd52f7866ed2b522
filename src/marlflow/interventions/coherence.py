"""coherence, the paper's I6: a coherence regulariser on each role's gradient.

    coh: {kind: coherence, lam: 0.3, window: 128}

A role whose gradient keeps pointing the way it pointed before is the coherent push the paper blames for
cliffs. Each step, before clipping, a role's gradient is multiplied by 1 - lam * max(0, cos(g, EMA)), where
EMA is the running mean (weight 1/window per step) of that role's own-loss gradients g_r / f_r over the
previous steps; a role moving against or across its history keeps its gradient. The EMA is `State.ema`,
updated by `commit` after each finite step with the unscaled gradient, and checkpointed.
"""

from __future__ import annotations

import math

import torch

from marlflow.core import algos
from marlflow.interventions.common import Intervention


def coherence_scale(g: torch.Tensor, ema: torch.Tensor | None, lam: float) -> float:
    """1 - lam * max(0, cos(g, ema)) for flat (D,) g and ema. No EMA yet (first step) or a zero vector: 1
    (cos undefined)."""
    if ema is None:
        return 1.0
    cos = algos.cosine(g, ema)
    if not math.isfinite(cos):
        return 1.0
    return 1.0 - lam * max(0.0, cos)


def _dev(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(like.device)


class Coherence(Intervention):
    """I6: each role's gradient x coherence_scale(its own-loss gradient, its EMA, lam)."""

    def role_scales(self, grads, own, slots) -> dict[str, float]:
        ema = self.state.ema
        return {
            r: coherence_scale(g / own[r] if own[r] > 0 else g, _dev(ema.get(r), g), self.spec["lam"])
            for r, g in grads.items()
        }

    def commit(self, grads, own) -> None:
        """The EMA takes in each role's (unscaled) own-loss gradient g_r / f_r."""
        for r, g in grads.items():
            if own.get(r, 0) > 0:
                ema, _ = algos.ema_update(_dev(self.state.ema.get(r), g), g / own[r], self.spec["window"])
                if ema is not None:
                    self.state.ema[r] = ema
