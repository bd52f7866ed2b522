"""One run's training: the GRPO step, its rollouts, updates and evaluations, and what keeps a run alive.

The step, top to bottom: `trainer` (the loop; one `PolicyState` per policy) -> `rollout` (episodes through a
workflow) -> `update` (per-role losses and gradients, per policy; the loss itself is TRL's, behind
`trl_loss.TrlLoss`, the one module that imports trl) -> `evaluation` (held-out accuracy; `base_eval` shares
step 0 across runs). Around it: `checkpoint` (save, resume), `preempt` (signals), `distributed` (ranks,
gloo/nccl), `trackers` (TensorBoard, W&B), `environment` (what machine ran it) and `final` (the run's `final/`
adapters and cards).

May import: store, core, tasks, generation, workflows, models, interventions. Never analysis, pipeline or cli.
"""
