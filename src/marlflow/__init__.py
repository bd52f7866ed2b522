"""marlflow: multi-agent GRPO for LLM workflows, run as a Snakemake matrix.

Reproduces and extends arXiv 2605.24202 ("When Does Multi-Agent RL Improve LLM Workflows?"):
Eval-Opt, Voting and Orch-Workers workflows (plus a single-agent baseline) trained with GRPO under
Shared-Policy (one adapter for all roles) or Isolated-Policy (one adapter per role type).
Entry points are commands: `marlflow COMMAND` or `python -m marlflow COMMAND` (marlflow.cli lists them);
the packages by layer are described in docs/architecture.md.
"""

__version__ = "0.1.0"
