"""Definitions that every other layer shares: the run config, workflow specs, GRPO math, metric definitions.

Lives here: `config` (RunConfig, TaskSpec, GRPOParams: what one run is), `workflow_spec` (WorkflowSpec, the one
home of what a workflow's roles, slots and calls are), `algos` (advantages, losses, chunking: pure tensor
functions), `definitions` (what base, peak, terminal, cliff and capture mean, in numbers) and `stats` (the
pure statistics that both training-time interventions and the analysis use); `registry` (loading a workflow's or an intervention's `SPEC` from a module named at run time).

May import: `marlflow.store` only. Training and analysis both import core, so neither needs the other.
"""
