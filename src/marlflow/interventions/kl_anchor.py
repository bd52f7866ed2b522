"""kl_anchor, the paper's I1: a per-role KL anchor against the base model, on the loss.

    kl_agg: {kind: kl_anchor, beta: {aggregator: 0.05}}

`role_beta` gives the KL coefficient of each role's sub-batch: grpo.beta plus the role's entry of `beta` (0
for a role it does not name). The KL term is TRL's k3 estimator (`common.k3_kl`) against the base model,
i.e. the role's adapter disabled, with TRL's bias correction, so its gradient is that of the reverse
KL(pi_role || pi_ref) that I1 names (marlflow.training.trl_loss.grpo_args). With any KL active, the update
also trains zero-advantage calls.
"""

from __future__ import annotations

from marlflow.interventions.common import Intervention


class KLAnchor(Intervention):
    """I1: grpo.beta + beta[role] on `role`'s loss; gradients and evaluations are left alone."""

    def role_beta(self, role: str, beta: float) -> float:
        return beta + float(self.spec["beta"].get(role, 0.0))
