"""Inducers: phenomena made to happen by construction in real toy training runs, so that each diagnostic can
be shown to fire where its phenomenon is and to stay quiet on the matched null run.

Every inducer goes through an extension point the project already has; nothing in marlflow names them:

    MARLFLOW_WORKFLOWS=induced.voting_shared    Voting whose generators share one sample (slot amplification)
    MARLFLOW_WORKFLOWS=induced.eval_opt_echo    one Eval-Opt round whose evaluator repeats the generator's
                                                call (cross-role cosine)
    MARLFLOW_INTERVENTIONS=induced.lr_spike     the learning rate x factor after a given evaluation (cliff)
    MARLFLOW_INTERVENTIONS=induced.grad_scale   every role's gradient x factor; -1 pays wrong answers
                                                (collapse)

and, for capture, the existing example plug-in MARLFLOW_INTERVENTIONS=interventions_extra.role_gain (the
aggregator's gradient x 0: only the generators are paid), all with tests/ on PYTHONPATH.

`induced.cases` pairs each diagnostic with its induced and null run (the toy preset's cell at a smaller scale)
and reads the diagnostic off a run with the project's own analysis code; tests/test_induced_diagnostics.py and
benchmarks/diagnostics/induced.py run them. docs/diagnostics.md explains each mechanism and holds the measured
table.
"""
