"""Interventions against the paper's two failure mechanisms: one module per kind, each a set of hooks the
trainer calls at fixed points of a step.

The paper (arXiv 2605.24202) explains its failures as same-role gradient amplification under IP (parallel
slots of one role add up) and dominant-role capture under SP (one role's gradient takes the shared update).
An intervention is a matrix axis value: a preset's `interventions:` block in matrix.yaml maps a name to a
kind and its parameters, and the run id gets `-<name>` (marlflow.pipeline.matrix.run_id):

    interventions:
      kl_agg:   {kind: kl_anchor, beta: {aggregator: 0.05}}      # I1: per-role KL anchor        (kl_anchor.py)
      coh:      {kind: coherence, lam: 0.3, window: 128}         # I6: coherence regulariser     (coherence.py)
      srn:      {kind: same_role_norm}                           # parallel same-role slots weigh as one call
      mb:       {kind: mass_balance, cap: 0.6}                   # SP: no role's projection share above cap
      cg:       {kind: cliff_guard, max_restores: 2, lr_factor: 0.5}  # on a cliff, back to the best eval

Each kind's parameters, their ranges and where it applies are its InterventionSpec
(marlflow.core.intervention_spec, checked when a RunConfig is built); what it does is the `Intervention`
subclass the spec names, in this package's module of the same name, whose docstring explains it.
`build(cfg)` makes the run's intervention (`NoIntervention` for kind none, whose hooks do nothing), and the
trainer calls its hooks (`common.Intervention` documents them):

- on the loss (marlflow.training.update): `role_beta`, the KL coefficient of each role's sub-batch;
- on the gradient, after every role of a policy has run its backward and before clipping: `role_scales`,
  one factor per role (the policy's gradient becomes sum_r scale_r * g_r), then `commit` once the whole step
  is finite (what the intervention learns from the step);
- after an evaluation (marlflow.training.trainer): `after_eval`, which may keep a copy of the weights and
  put one back, through the narrow `Evaluated` the trainer hands it.

The intervention's state (coherence's EMA; cliff_guard's curve, best copy and restore count) is `State`,
which the trainer checkpoints. Gradient and test functions are pure (flat (D,) tensors, an (n, n) Gram
matrix or an eval curve in, numbers out); the helpers more than one kind uses are in `common`.
"""

from marlflow.interventions.common import (
    Evaluated,
    Intervention,
    NoIntervention,
    State,
    build,
    cpu_copy,
    eval_looks,
    k3_kl,
    masked_mean_kl,
)

__all__ = [
    "Evaluated",
    "Intervention",
    "NoIntervention",
    "State",
    "build",
    "cpu_copy",
    "eval_looks",
    "k3_kl",
    "masked_mean_kl",
]
