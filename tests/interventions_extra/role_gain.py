"""role_gain: each named role's gradient times a fixed gain, defined outside marlflow to show that an
intervention kind is one spec (what RunConfig checks) plus one hooks class (what the trainer calls).

    mute: {kind: role_gain, gain: {generator: 0.0}}     # the generators' adapter gets no gradient

Nothing in marlflow names this module: tests/test_interventions.py registers it the documented way
(MARLFLOW_INTERVENTIONS=interventions_extra.role_gain), RunConfig checks definitions against SPEC, and
tests/test_interventions_train.py trains a step with it.
"""

from __future__ import annotations

from marlflow.core.intervention_spec import InterventionSpec, Param
from marlflow.interventions import Intervention


class RoleGain(Intervention):
    """The gradient hook only: role r's gradient x gain[r] (1 for a role that gain does not name)."""

    def role_scales(self, grads, own, slots) -> dict[str, float]:
        return {r: float(self.spec["gain"].get(r, 1.0)) for r in grads}


SPEC = InterventionSpec(
    name="role_gain",
    help="each named role's gradient x a fixed gain in [0, 1]",
    hooks="interventions_extra.role_gain:RoleGain",
    params={"gain": Param("roles", {"minimum": 0, "maximum": 1}, None, "role type -> its gradient's factor")},
)
