"""mass_balance: under SP, no role's projection share of the shared update exceeds a cap.

    mb: {kind: mass_balance, cap: 0.6}

Against dominant-role capture under SP (one role's gradient takes the shared adapter's update): each step,
before clipping, the roles of the shared policy get factors a_r in (0, 1] such that every role's projection
share a_r <g_r, g> / ||g||^2 of g = sum_r a_r g_r is at most `cap` (`mass_balance_scales`, from the roles'
Gram matrix). RunConfig refuses it under IP, where each adapter has one role.
"""

from __future__ import annotations

import torch

from marlflow.interventions.common import Intervention, gram, scaled_shares


def mass_balance_scales(G: torch.Tensor, cap: float, tol: float = 1e-6, rounds: int = 100) -> torch.Tensor:
    """Scales a (n,) in (0, 1] such that no role's projection share of sum_r a_r g_r exceeds `cap`.

    A role over the cap is scaled down by bisection on its own factor (its share goes to 0 as its factor
    does, so the root exists); lowering one role raises the others', so this repeats until all are under.
    Roles at or under the cap keep factor 1 unless a later round lowers them. Shares sum to 1, so a cap
    below 1/n cannot hold for every role; it is raised to 1/n (equal shares) in that case.
    G: (n, n) Gram matrix of the role gradients (`common.gram`)."""
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


class MassBalance(Intervention):
    """Factors that cap every role's projection share of the policy's update at spec["cap"] (2+ roles)."""

    def role_scales(self, grads, own, slots) -> dict[str, float]:
        if len(grads) < 2:
            return super().role_scales(grads, own, slots)
        a = mass_balance_scales(gram(list(grads.values())), self.spec["cap"])
        return {r: float(x) for r, x in zip(grads, a)}
