"""grad_scale: every role's gradient x `factor` before clipping; factor -1 is the update of a reward that pays
wrong answers.

GRPO's advantages are group-normalised, so a reward 1 - r gives advantages -A(r); the trainer takes one
on-policy step per rollout (the importance ratio is 1, inside the clip range), where TRL's loss gradient is
linear in the advantage when there is no KL term (grpo.beta 0, the default and the toy's). The update for
"1 - correct" is then exactly the update for "correct" times -1, which this hook applies to every role's
gradient before clipping (tests/test_induced_diagnostics.py checks the advantage identity). The logged rewards
stay the task's own, so reward_mean reads how often the answers are right.

    MARLFLOW_INTERVENTIONS=induced.grad_scale    (tests/ on PYTHONPATH)
    wrong: {kind: grad_scale, factor: -1.0}
"""

from __future__ import annotations

from marlflow.core.intervention_spec import InterventionSpec, Param
from marlflow.interventions import Intervention


class GradScale(Intervention):
    """The gradient hook only: every role's factor is `factor`."""

    keeps_grads = False

    def role_scales(self, grads, own, slots) -> dict[str, float]:
        return {r: float(self.spec["factor"]) for r in grads}


SPEC = InterventionSpec(
    name="grad_scale",
    help="every role's gradient x factor (-1: the update of a reward paying wrong answers)",
    hooks="induced.grad_scale:GradScale",
    params={"factor": Param("float", {"minimum": -1, "maximum": 1}, None, "every role's gradient factor")},
)
