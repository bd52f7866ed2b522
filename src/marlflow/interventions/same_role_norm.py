"""same_role_norm: a role's parallel same-role calls together weigh as one call.

    srn: {kind: same_role_norm}

Under IP the gradients of parallel slots of one role add up (the same-role amplification the paper measures:
Voting's three generators, Orch-Workers' workers). A role with m parallel slots in a step gets the factor 1/m.
Which slots run in parallel on the same input is the workflow's spec (WorkflowSpec.parallel_role,
parallel_slots); Eval-Opt's generator rounds are sequential refinements, not parallel copies, so they keep
factor 1. RunConfig refuses it for a workflow without a parallel role.
"""

from __future__ import annotations

from marlflow.core.workflow_spec import spec_of
from marlflow.interventions.common import Intervention


def parallel_slots(workflow: str, role: str, slots: list[str]) -> int:
    """How many of `slots` (the slots of `role` that ran this step) are parallel same-role calls; 1 if the
    role has none (so its scale stays 1)."""
    spec = spec_of(workflow)
    return max(1, sum(spec.is_parallel_slot(role, s) for s in slots))


def same_role_scale(workflow: str, role: str, slots: list[str]) -> float:
    """1/m for a role with m parallel slots, so together they weigh as one call."""
    return 1.0 / parallel_slots(workflow, role, slots)


class SameRoleNorm(Intervention):
    """Each role's gradient x 1 / (its parallel slots that ran)."""

    def role_scales(self, grads, own, slots) -> dict[str, float]:
        return {r: same_role_scale(self.cfg.workflow, r, slots.get(r, [])) for r in grads}
