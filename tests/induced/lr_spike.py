"""lr_spike: every policy's learning rate x `factor` after the evaluation of step `at`, to the end of the run.

A learning-rate spike at a known step, through the hook cliff_guard uses (`Evaluated.restore`): after the
evaluation of step `at` the run's current weights and AdamW states are put back unchanged and every policy's
rate and schedule are multiplied by `factor`. AdamW's step is about lr per parameter whatever the gradient's
size, so a large factor moves the LoRA weights far in a few steps: a run that has risen by step `at` falls
after it, which is the cliff the calibrated test (stats.curve_tests) looks for.

    MARLFLOW_INTERVENTIONS=induced.lr_spike    (tests/ on PYTHONPATH)
    spike: {kind: lr_spike, at: 6, factor: 50.0}
"""

from __future__ import annotations

from marlflow.core.intervention_spec import InterventionSpec, Param
from marlflow.interventions import Intervention


class LRSpike(Intervention):
    """The evaluation hook only; no state (the scaled schedule is in the checkpointed scheduler)."""

    keeps_grads = False

    def role_scales(self, grads, own, slots) -> None:
        return None

    def after_eval(self, ev) -> dict[str, float]:
        if ev.step != self.spec["at"]:
            return {}
        ev.restore(ev.snapshot(), self.spec["factor"])  # the current state, at factor x the rate
        return {"lr_spike": float(self.spec["factor"])}


SPEC = InterventionSpec(
    name="lr_spike",
    help="every learning rate x factor after the evaluation of step `at`",
    hooks="induced.lr_spike:LRSpike",
    params={
        "at": Param(
            "int", {"minimum": 0, "maximum": 1_000_000}, None, "the evaluated step after which it acts"
        ),
        "factor": Param("float", {"exclusiveMinimum": 0, "maximum": 10_000}, None, "the rate's multiplier"),
    },
)
