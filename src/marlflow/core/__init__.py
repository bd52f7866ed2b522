"""Definitions that every other layer shares: the run config, workflow and intervention specs, GRPO math,
metric definitions.

Lives here: `config` (RunConfig, TaskSpec, GRPOParams: what one run is), `workflow_spec` (WorkflowSpec, the one
home of what a workflow's roles, slots and calls are), `intervention_spec` (InterventionSpec: each intervention
kind's parameters and rules; its behaviour is in marlflow.interventions), `registry` (loading either kind of
`SPEC` from a module named at run time), `algos` (advantages, losses, chunking: pure tensor functions),
`definitions` (what base, peak, terminal, cliff and capture mean, in numbers) and `stats` (the pure statistics
that both training-time interventions and the analysis use).

May import: `marlflow.store` only. Training and analysis both import core, so neither needs the other.
"""
