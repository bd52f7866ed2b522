"""The multi-agent GRPO trainer: workflow rollouts and per-role updates on TRL's GRPO loss.

`MultiAgentGRPOTrainer` is a plain class that holds a `TrlLoss` (marlflow.training.trl_loss: TRL's
`_compute_loss`, clip-higher, loss types, fused log-prob head, behind `collate` / `loss` / `ref_logps`) and
one `PolicyState` per policy (adapter parameters, AdamW, scheduler). It owns the outer loop, so that one step
reads top to bottom. The step is split in three modules; this one holds the loop, one chunk's loss
(`piece_loss`), step-0 sharing, the intervention's evaluation hook and the state:

    marlflow.training.rollout     problems  = the step's problems (a pure function of seed and step: no sampler state)
                         episodes  = workflows.rollout(problems x G)   # one generate per policy per stage
                         calls     = every role call, reward = the episode's final outcome (paper default)
                         adv       = GRPO advantages within (problem, slot) groups (check_groups: none mixed)
    marlflow.training.update      for policy in policies:           # SP: "shared"; IP: one per role type; agent: one per agent
                             policy_backward: for role, slot, chunk: loss = TRL _compute_loss(chunk) * weight;
                                 backward; g_r = the gradient the role added (sum of its slots' parts)
                             [data-parallel hook: all-reduce the PolicyGrad here; see update.PolicyGrad]
                             finish_policy: role metrics; intervention hook g = sum_r scale_r * g_r
                                 (marlflow.interventions.role_scales; KL acts on the loss)
                         role_view (agent): a role on several adapters measured on their direct sum
                         apply_step: clip each policy's gradient; step its own AdamW and scheduler
    marlflow.training.evaluation  evaluate every eval_every steps (the same function as `marlflow eval`), in chunks of
                         run.eval_chunk_problems problems with a stop check before each (0: one chunk)
    marlflow.training.checkpoint  checkpoint every save_every steps: state_dict() / load_state_dict()
    SIGTERM / SIGUSR1 (marlflow.training.preempt): abandon the step if its update has not started, else finish it
                         (a chunked evaluation: up to its current chunk, the finished chunks kept in the
                         checkpoint and the rest evaluated by the rerun); checkpoint the last completed step;
                         raise preempt.Preempted (exit 75, rerun)

Data parallel (marlflow.training.distributed; docs/slurm.md "Several GPUs per run"): each rank rolls out its shard of the
step's problems, the update sums the gradients over the ranks, the train rows and the evaluations read every
rank's episodes, and the ranks agree on a stop; every rank holds the same state, and rank 0 alone writes
(checkpoints, the step-0 cache, trackers). One process is the same code with every collective the identity.

Under SP each role's (and each slot's) gradient contribution is separated by differencing the accumulated
gradient after each slot's backward, so per-role gradient metrics exist under both sharings with one
meaning (marlflow.core.definitions, "Gradient metrics"): grad_norm of the role's own mean loss,
contributions before and after clipping, clip_coef, proj_share, cos_others, slot_amplification / slot_cos,
and ema_cos against a per-role gradient EMA that is checkpointed with the optimizers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
from transformers import get_scheduler

from marlflow import interventions as itv
from marlflow.generation.fastgen import use_gqa_sdpa
from marlflow.generation.hf import ChatEncoder, make_backend
from marlflow.models.policies import load_policy_state, policy_state
from marlflow.store.schema import SAMPLE_COLUMNS, outcomes_frame, rows
from marlflow.tasks.splits import run_splits
from marlflow.training import checkpoint, distributed, environment, evaluation, preempt
from marlflow.training import rollout as ro
from marlflow.training import update as upd
from marlflow.training.base_eval import SharedBaseEval
from marlflow.training.trackers import Trackers
from marlflow.training.trl_loss import TrlLoss, pad

log = logging.getLogger("marlflow.training.trainer")

# Rollout-trainer agreement: mean |logp_rollout - logp_trainer| over a role's sampled tokens above this many
# nats is warned about once per run. bf16 vLLM against the fp32 trainer measured 0.01-0.04 nats (SmolLM2-135M
# and the toy model, CPU); a stale adapter or a wrong stop token shows up as 0.1 and more.
LOGP_GAP_WARN = 0.1


class NaNLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """One policy's training state: its LoRA adapter's parameters and what steps them (checkpointed as the
    state dicts of `optimizer` and `scheduler`, and the adapter's weights under `name`)."""

    name: str = dataclasses.field(metadata={"help": "the policy, = its PEFT adapter's name (cfg.policies)"})
    params: list[torch.nn.Parameter] = dataclasses.field(
        metadata={"help": "the adapter's trainable parameters, in the model's named_parameters order"}
    )
    optimizer: torch.optim.Optimizer = dataclasses.field(metadata={"help": "AdamW over `params`"})
    scheduler: torch.optim.lr_scheduler.LRScheduler = dataclasses.field(
        metadata={"help": "grpo.lr_scheduler over `optimizer` (transformers.get_scheduler)"}
    )


def _policy_state(model, name: str, g) -> PolicyState:
    """`name`'s adapter parameters in `model`, with a fresh AdamW and scheduler from GRPOParams `g`."""
    params = [t for n, t in model.named_parameters() if f".{name}." in n]
    if not params:
        raise ValueError(f"adapter {name!r} has no parameters; was the PEFT model built with it?")
    opt = torch.optim.AdamW(params, lr=g.learning_rate, weight_decay=g.weight_decay)
    return PolicyState(name, params, opt, get_scheduler(g.lr_scheduler, opt, g.warmup_steps, g.steps))


def _logp_gap(pcalls, logps: torch.Tensor) -> tuple[float, int]:
    """Sum of |logp_rollout - logp_trainer| over the sampled tokens of `pcalls`, and the token count.

    logps (B, T): the trainer's per-token log-probabilities of the chunk (ChunkLoss.logps); call i's rollout
    log-probabilities cover its first len(completion_ids) positions."""
    ref = [c.rollout_logps if c.rollout_logps is not None and c.completion_ids else [] for c in pcalls]
    n = sum(len(r) for r in ref)
    if not n:
        return 0.0, 0
    # One padded tensor and one device sync per piece, not one per call.
    rollout = pad([torch.tensor(r, dtype=torch.float32) for r in ref], 0.0, padding_side="right")
    mask = pad([torch.ones(len(r)) for r in ref], 0.0, padding_side="right")
    ours = logps[:, : rollout.size(1)].float()
    gap = ((ours - rollout.to(ours.device)).abs() * mask.to(ours.device)).sum().item()
    return gap, n


class MultiAgentGRPOTrainer:
    """GRPO over workflow episodes with one LoRA adapter per policy on one frozen base model.

    model: a `peft.PeftModel` holding one adapter per name in `cfg.policies`; tokenizer: its tokenizer.
    task: a `marlflow.tasks.Task`; out_dir: the run folder (checkpoints/, metrics.parquet, ...).
    """

    def __init__(self, cfg, model, tokenizer, task, out_dir: str | Path):
        self.cfg, self.task, self.out_dir = cfg, task, Path(out_dir)
        # First: TRL's constructor seeds every RNG with cfg.seed, which everything below starts from.
        self.trl = TrlLoss(cfg, model, tokenizer, self.out_dir)
        self.model, self.tokenizer = model, tokenizer
        # val_problems: task.val_size problems disjoint from both, for what selects (cliff_guard): splits.py
        self.train_problems, self.val_problems, self.eval_problems = run_splits(task, cfg.task)
        for name, probs in (("train", self.train_problems), ("test", self.eval_problems)):
            if not probs:
                raise ValueError(
                    f"task {cfg.task.name!r} has an empty {name} split; check task.source in matrix.yaml"
                )
        self.encoder = ChatEncoder(tokenizer, cfg.grpo.max_prompt_length)
        use_gqa_sdpa(self.model, cfg.fastgen)  # CPU: grouped K/V heads read in place, not copied per layer
        self.backend = make_backend(cfg.backend, self.model, tokenizer, cfg.policies, cfg)
        if cfg.use_gradient_checkpointing:
            # Non-reentrant: the recompute is driven by autograd's saved-tensor hooks, so LoRA gradients flow
            # without inputs that require grad and with keyword arguments (the reentrant variant needs both).
            # It acts in training mode only: generation (model.eval(), HFBackend) keeps its K/V cache. Enabled
            # after the backend is built, so the hf backend's bf16 sampling copy has no checkpointing in it.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(task, "warm_up"):  # code tasks: start (and check) the sandbox before the step-0 eval
            task.warm_up()
        self.policies = {p: _policy_state(self.model, p, cfg.grpo) for p in cfg.policies}
        # role -> [(policy, its parameter count)] for a role that several policies train (sharing agent's
        # parallel role): its metrics are measured on their direct sum (marlflow.training.update.role_view)
        self.role_layout = {r: [(p, sum(t.numel() for t in self.policies[p].params)) for p in ps]
                            for r, ps in cfg.role_policies().items() if len(ps) > 1}  # fmt: skip
        self.step = 0
        self.nan_streak = 0
        self.metric_rows: list[dict] = []
        self.sample_rows: list[dict] = []
        self.outcome_rows: list[dict] = []  # every evaluation's per-problem outcomes (OUTCOME_COLUMNS)
        self._gap_warned = False
        # role -> EMA of its own-loss gradient (flat, fp32, on the adapter's device); checkpointed, so a
        # resumed run logs the same ema_cos as an uninterrupted one.
        self.grad_ema: dict[str, torch.Tensor] = {}
        self.itv = itv.build(cfg)  # the run's intervention: its hooks and its (checkpointed) state
        self._pending_base = None  # a deferred step-0 evaluation: (SharedBaseEval, initial adapters)
        # an evaluation of self.step stopped between chunks (evaluation.Partial): checkpointed with the step,
        # finished by the rerun before its next step
        self._pending_eval: evaluation.Partial | None = None
        self.trackers: Trackers | None = None  # fit()'s, open while it runs
        # the progress line's: the newest evaluation's accuracy; the newest step's reward, live share, seconds
        self.last_acc: float | None = None
        self.last_step: dict | None = None

    # ------------------------------------------------------------------ data

    def problems_for(self, step: int):
        """The step's problems: a pure function of (seed, step), so a resumed run sees the same data."""
        return ro.step_problems(self.train_problems, self.cfg.seed, step, self.cfg.grpo.problems_per_step)

    def _ctx(self, temperature: float, timer=None, seed: int | None = None, policy_of=None):
        return ro.context(
            self.cfg, self.task, self.backend, self.encoder, temperature, timer, seed, policy_of
        )

    # ------------------------------------------------------------------ one training step

    def flatten(self, episodes):
        """Episodes -> (calls, rewards (N,), advantages (N,), group index (N,), group std (K,)): rollout.flatten."""
        b = ro.flatten(self.cfg, episodes)
        return b.calls, b.rewards, b.advantages, b.index, b.std

    def collate(self, calls, advantages: torch.Tensor, num_items: int) -> dict:
        """Role calls -> the input dict TRL's `_compute_loss` expects (TrlLoss.collate: prompts left-,
        completions right-padded). advantages: (B,) one per call; num_items: the loss normaliser's tokens."""
        return self.trl.collate(
            [c.prompt_ids for c in calls], [c.completion_ids for c in calls], advantages, num_items
        )

    def piece_loss(self, pcalls, adv: torch.Tensor, tok_pol: int, weight: float, beta: float) -> upd.Piece:
        """One chunk's GRPO loss (TrlLoss.loss: TRL's `_compute_loss`) times `weight`, with the chunk's entropy,
        clip ratio, KL (beta > 0: a KL term to the base model, whose log-probs TrlLoss.ref_logps supplies) and
        rollout-trainer log-prob gap; marlflow.training.update runs it for every chunk. adv: (n,) the chunk's
        advantages."""
        inputs = self.collate(pcalls, adv, tok_pol)
        if beta:
            inputs["ref_per_token_logps"] = self.trl.ref_logps(self.model, inputs)
        out = self.trl.loss(self.model, inputs, beta)
        m, n = out.metrics, len(pcalls)
        kl = m["kl"] * n if beta else None
        gap, gap_n = _logp_gap(pcalls, out.logps)
        clip = m.get("clip_ratio/region_mean", 0.0) * n
        return upd.Piece(out.loss * weight, m["entropy"] * n, clip, kl, gap, gap_n)

    def update(self, calls, adv: torch.Tensor, metrics: bool = True) -> dict:
        """Per-policy backward with per-role and per-slot gradient accounting, per-policy clipping; optimizer
        steps (marlflow.training.update). adv: (N,) one advantage per call.

        Returns per-role stats {role: {...}} and workflow stats under "all". If any loss or gradient is not
        finite, no parameter changes, the gradient EMAs stay as they were, stats["all"]["nan_skipped"] == 1,
        and no role after the one that failed is run (its stats are absent).
        The gradient metrics only read the gradients: the update is the policy's whole-batch TRL loss either way.
        metrics=False (steps between grpo.grad_metrics_every) skips what needs more than one flat gradient per
        role: per-slot gradients, proj_share, cos_others, slot_amplification / slot_cos and the EMA (ema_cos).
        """
        self.backend.before_update()  # vLLM sleeps (weights to CPU, KV dropped) until the next generate
        stats: dict[str, dict] = defaultdict(dict)
        finite, norms, done = True, {}, []
        joined = bool(self.role_layout)  # a role on several policies: its stats join them (upd.role_view)
        # Data parallel (issue 27): `calls` are this rank's; the loss normalisers count every rank's, and each
        # policy's gradient is summed over the ranks before any metric, the intervention or clipping reads it
        # (marlflow.training.update.reduce_policy_grad). One process: the counts are its own and the reduce is the identity.
        counts = upd.sum_counts(distributed.gather(upd.policy_counts(self.cfg, calls)))
        for policy in self.cfg.policies:
            if not finite:  # the step is discarded: no later policy's backward is run
                break
            params = self.policies[policy].params
            pg = upd.policy_backward(self, self.cfg, policy, params, calls, adv, metrics, counts.get(policy))
            if distributed.world() > 1:
                pg = upd.reduce_policy_grad(pg, policy, params)
            if pg is None:
                continue
            norms[policy] = upd.finish_policy(pg, self.cfg, self.itv, stats, metrics, keep=joined)
            finite = pg.finite and math.isfinite(norms[policy])
            done.append(pg)
            for role in pg.roles:
                if "logp_gap" in stats[role]:
                    self._warn_gap(role, stats[role]["logp_gap"])
        stats["all"]["nan_skipped"] = float(not finite)
        if not finite:
            for st in self.policies.values():
                st.optimizer.zero_grad(set_to_none=True)
            return stats
        view = None
        if joined:
            view = upd.role_view(done, counts, self.cfg.grpo.loss_type, self.role_layout)
            for role in self.role_layout:
                if role in view:
                    stats[role] = upd.joined_stats(role, view[role], done, metrics)
        upd.apply_step(self, done, norms, stats, metrics, roles=view)
        self.backend.on_update()
        return stats

    def _warn_gap(self, role: str, gap: float) -> None:
        if gap > LOGP_GAP_WARN and not self._gap_warned:
            self._gap_warned = True
            log.warning(
                "step %d: role %s: rollout and trainer log-probabilities differ by %.3f nats per token on "
                "average (> %.2f): the rollouts may not come from the adapters being trained (metric logp_gap; "
                "warned once per run)", self.step, role, gap, LOGP_GAP_WARN,
            )  # fmt: skip

    def train_step(self, step: int) -> bool:
        """One step: rollout, advantages, update, train metrics. Returns False, having changed nothing, when a stop
        was requested (marlflow.training.preempt) before the update started: the step is abandoned for the rerun to do."""
        t0 = time.perf_counter()
        timer = defaultdict(float)
        calls_before = self.backend.calls
        rng = checkpoint.rng_state()  # the step's start, for an abandoned rollout to go back to
        ctx = self._ctx(self.cfg.grpo.temperature, timer, seed=ro.rollout_seed(self.cfg.seed, step))
        ctx.should_stop = preempt.requested  # checked before each stage of the rollout
        # Data parallel: this rank's whole problems (a GRPO group stays on one rank); all of them for one process.
        mine = distributed.shard(self.problems_for(step), distributed.rank(), distributed.world())
        episodes = ro.train_episodes(self.cfg, self.task, mine, ctx)
        # The ranks agree (distributed.stop_agreed): a signal to any rank abandons the step on all of them.
        if distributed.stop_agreed() or episodes is None:  # the update has not started: undo the rollout
            self._undo_rollout(rng, calls_before)
            return False
        batch = ro.flatten(self.cfg, episodes)
        t1 = time.perf_counter()
        stats = self.update(
            batch.calls, batch.advantages, metrics=step % self.cfg.grpo.grad_metrics_every == 0
        )
        t_backward = time.perf_counter() - t1
        self._count_nan(step, stats["all"]["nan_skipped"])
        calls, rewards = ro.gather_stats(batch)  # every rank's calls and episodes: the rows of one process
        self.metric_rows += ro.train_rows(self.cfg, step, calls, stats)
        step_time = time.perf_counter() - t0
        reward = sum(rewards) / len(rewards)
        self.metric_rows += rows(self.cfg.factors, step, "train", "all", {
            "reward_mean": reward, **stats["all"], "step_time": step_time, "time_generate": timer["generate"],
            "time_score": timer["score"], "time_backward": t_backward,
            "time_other": step_time - timer["generate"] - timer["score"] - t_backward,
            "generate_calls": self.backend.calls - calls_before,
        })  # fmt: skip
        adv = torch.tensor([c.advantage for c in calls], dtype=torch.float32)
        self.last_step = {"reward": reward, "live": float((adv != 0).float().mean()) if len(adv) else 0.0,
                          "seconds": step_time}  # fmt: skip
        return True

    def _count_nan(self, step: int, skipped: float) -> None:
        """Count consecutive steps skipped for a non-finite loss or gradient; raise NaNLossError at
        grpo.max_nan_steps of them (the last good checkpoint stays)."""
        if not skipped:
            self.nan_streak = 0
            return
        self.nan_streak += 1
        log.warning("step %d: non-finite loss or gradient; step skipped (%d in a row)", step, self.nan_streak)
        if self.nan_streak >= self.cfg.grpo.max_nan_steps:
            raise NaNLossError(
                f"{self.nan_streak} consecutive steps had a non-finite loss or gradient (last: step {step}); "
                f"stopping. The last good checkpoint is kept in {self.out_dir / 'checkpoints'}. Lower "
                "grpo.learning_rate or grpo.max_grad_norm, or check the model dtype, then rerun to resume."
            )

    def _undo_rollout(self, rng: dict, calls_before: int) -> None:
        """Put back what a rollout changed: the RNG states (HF sampling draws from torch's; `rng` is
        checkpoint.rng_state() at the step's start), the rollout engine's stored K/V and its call count. The
        trainer's own state (adapters, optimizers, EMAs, metric rows) is only touched by the update and after it."""
        checkpoint.set_rng_state(rng)
        self.backend.forget_states()
        self.backend.calls = calls_before

    # ------------------------------------------------------------------ evaluation

    def evaluate_workflow(
        self, step: int, base: bool = False, stoppable: bool = False
    ) -> evaluation.Evaluation | None:
        """Workflow accuracy on the fixed held-out subset, one episode per problem (marlflow.training.evaluation, whose
        docstring says how its sampling leaves training's RNG untouched; base: the untrained adapters, every
        role routed to the first policy). Returns its rows (the caller places them in the run's tables) and the
        test accuracy.

        With validation problems (task.val_size), they are evaluated next the same way (with their own seed):
        their metric rows (split "val") follow the test rows; their episodes give no sample rows.

        stoppable (training's evaluations after a step; run.eval_chunk_problems > 0): every rank asks for a stop
        before each chunk (distributed.stop_agreed); on one it returns None with the finished chunks in
        self._pending_eval (the checkpoint keeps them), and the next call for the same step goes on from there."""
        args = self.cfg, self.task, self.backend, self.encoder
        part, stop = None, None
        if stoppable and self.cfg.eval_chunk_problems:
            if self._pending_eval is None:
                self._pending_eval = evaluation.Partial(step)
            part, stop = self._pending_eval, distributed.stop_agreed
            assert part.step == step, (part.step, step)  # resumed evaluations finish before the next step
        ev = evaluation.evaluate(*args, self.eval_problems, step, base, part, stop)
        if ev is None:
            return None
        log.info("step %d eval accuracy %.3f (n=%d)", step, ev.accuracy, len(self.eval_problems))
        if not self.val_problems:
            self._pending_eval = None
            return ev
        val = evaluation.validate(*args, self.val_problems, step, base, part, stop)
        if val is None:
            return None
        self._pending_eval = None
        log.info("step %d validation accuracy %.3f (n=%d)", step, val.accuracy, len(self.val_problems))
        return dataclasses.replace(
            ev, metric_rows=ev.metric_rows + val.metric_rows, outcome_rows=ev.outcome_rows + val.outcome_rows
        )

    def _place(self, ev: evaluation.Evaluation, first: bool = False) -> None:
        """Put an evaluation's rows into the run's tables: after the rows so far, or (first) before them."""
        if first:
            self.metric_rows[:0], self.sample_rows[:0] = ev.metric_rows, ev.sample_rows
            self.outcome_rows[:0] = ev.outcome_rows
        else:
            self.metric_rows += ev.metric_rows
            self.sample_rows += ev.sample_rows
            self.outcome_rows += ev.outcome_rows

    def _after_eval(self) -> None:
        """The intervention's hook after the evaluation of `self.step` (marlflow.interventions; cliff_guard keeps
        a copy of the weights at a new best and puts it back on a cliff): it gets the step, the metric rows and
        `_weights_copy` / `_restore_weights`; what it returns is logged at this step (split train, role all)."""
        ev = itv.Evaluated(self.step, self.metric_rows, self._weights_copy, self._restore_weights)
        self.metric_rows += rows(self.cfg.factors, self.step, "train", "all", self.itv.after_eval(ev))

    def _weights_copy(self) -> dict:
        """CPU copies of every adapter and its AdamW state: {"adapters": ..., "optimizers": ...}."""
        return {
            "adapters": self._adapter_copies(),
            "optimizers": {p: itv.cpu_copy(s.optimizer.state_dict()) for p, s in self.policies.items()},
        }

    def _restore_weights(self, copy: dict, lr_factor: float) -> None:
        """Put back a `_weights_copy` (adapters and AdamW moments; the schedulers keep their step), scale every
        policy's learning rate and schedule by lr_factor, and publish the adapters to the rollout engine."""
        for p, sd in copy["adapters"].items():
            load_policy_state(self.model, sd, p)
        f = lr_factor
        for p, s in self.policies.items():
            lrs = [(gr["lr"] * f, gr.get("initial_lr", gr["lr"]) * f) for gr in s.optimizer.param_groups]
            # a copy: AdamW changes the state it loads in place
            s.optimizer.load_state_dict(itv.cpu_copy(copy["optimizers"][p]))
            upd.scale_schedule(s.optimizer, s.scheduler, lrs, f)
        self.backend.on_update()  # the rollout engine must sample from the restored adapters

    # ------------------------------------------------------------------ step 0, shared by the cell's runs

    def _adapter_copies(self) -> dict:
        """CPU copies of every policy's adapter weights (load_policy_state puts them back)."""
        return {p: itv.cpu_copy(policy_state(self.model, p)) for p in self.cfg.policies}

    def _base_eval(self) -> evaluation.Evaluation | None:
        """Step 0's evaluation (marlflow.training.base_eval): read from the cell's cache, computed here, or, while another
        run computes it, deferred (None; `_settle_base_eval` places it later). Its rows go first in the tables."""
        t0 = time.perf_counter()
        shared = SharedBaseEval(self.cfg, self.out_dir.parent)
        got = distributed.from_main(shared.read)  # rank 0 reads and claims the cache for every rank
        if got is not None:
            return self._step0_evaluation(*got, reused=True, seconds=time.perf_counter() - t0)
        can_wait = not self.itv.reads_evals and not self.cfg.report_to
        if distributed.from_main(shared.claim) or not can_wait:
            return self._step0_evaluation(*self._compute_base_eval(shared), reused=False)
        log.info("step 0 eval: another run of this cell is computing it; reading it at the first evaluation")
        self._pending_base = (shared, self._adapter_copies())
        return None

    def _settle_base_eval(self) -> bool:
        """Place a deferred step-0 evaluation first in the tables, if there is one (before anything is saved: a
        checkpoint holds step 0's rows); True if there was."""
        if self._pending_base is None:
            return False
        self._place(self._resolve_base_eval(), first=True)
        return True

    def _resolve_base_eval(self) -> evaluation.Evaluation:
        """A deferred step-0 evaluation: read, or computed with the initial adapters put back."""
        (shared, initial), self._pending_base = self._pending_base, None
        t0 = time.perf_counter()
        got = distributed.from_main(shared.read)
        if got is not None:
            return self._step0_evaluation(*got, reused=True, seconds=time.perf_counter() - t0)
        log.info("step 0 eval: not computed by another run; evaluating the initial adapters here")
        current = self._adapter_copies()
        try:
            for p, sd in initial.items():
                load_policy_state(self.model, sd, p)
            self.backend.on_update()
            got = self._compute_base_eval(shared)
        finally:
            for p, sd in current.items():
                load_policy_state(self.model, sd, p)
            self.backend.on_update()
        return self._step0_evaluation(*got, reused=False)

    def _compute_base_eval(self, shared: SharedBaseEval) -> tuple[list[dict], list[dict], list[dict]]:
        """Evaluate step 0 and write it for the cell (rank 0: the others evaluate their share of the problems);
        returns its (metric rows, sample rows, outcome rows), as `SharedBaseEval.read` does."""
        try:
            ev = self.evaluate_workflow(0, base=True)
            if distributed.is_main():
                shared.write(ev.metric_rows, ev.sample_rows, SAMPLE_COLUMNS, ev.outcome_rows)
            return ev.metric_rows, ev.sample_rows, ev.outcome_rows
        finally:
            shared.release()

    def _step0_evaluation(
        self, metric_rows, sample_rows, outcome_rows, reused: bool, seconds: float | None = None
    ) -> evaluation.Evaluation:
        """Step 0's rows as this run logs them, flagged eval_reused, and its accuracy. seconds: this run's own
        time for step 0's evaluation (the read), replacing the time_eval of the run that computed it."""
        if seconds is not None:
            metric_rows = [{**r, "value": seconds} if r["metric"] == "time_eval" else r for r in metric_rows]
        flag = rows(self.cfg.factors, 0, "eval", "all", {"eval_reused": float(reused)})
        acc = next(r["value"] for r in metric_rows
                   if r["split"] == "eval" and r["metric"] == "accuracy" and r["role"] == "all")  # fmt: skip
        log.info("step 0 eval accuracy %.3f (n=%d, %s)", acc, len(self.eval_problems),
                 "read from the cell's shared step-0 evaluation" if reused else "computed here")  # fmt: skip
        return evaluation.Evaluation([*metric_rows, *flag], sample_rows, acc, outcome_rows)

    # ------------------------------------------------------------------ checkpoints and resume

    def state_dict(self) -> dict:
        """Everything a checkpoint holds (marlflow.training.checkpoint), by reference: step, nan_streak, each policy's
        adapter weights, AdamW and scheduler states, the per-role gradient EMAs, the intervention's state, the
        process's RNG states (checkpoint.rng_state) and the metric, sample and outcome rows so far."""
        return {
            "step": self.step,
            "nan_streak": self.nan_streak,
            "adapters": {p: policy_state(self.model, p) for p in self.cfg.policies},
            "optimizers": {p: st.optimizer.state_dict() for p, st in self.policies.items()},
            "schedulers": {p: st.scheduler.state_dict() for p, st in self.policies.items()},
            "grad_ema": self.grad_ema,
            "interventions": self.itv.state_dict(),
            "rng": checkpoint.rng_state(),
            "metric_rows": self.metric_rows,
            "sample_rows": self.sample_rows,
            "outcome_rows": self.outcome_rows,
            "pending_eval": self._pending_eval,  # None, or the step's evaluation stopped between chunks
        }

    def load_state_dict(self, state: dict) -> None:
        """Put back a `state_dict()`: each adapter into its own policy, then publish them to the rollout engine
        (it still serves the adapters it started with; the next step would sample from the wrong policy and
        train on it as on-policy). grad_ema and interventions may be absent (older checkpoints)."""
        for p, sd in state["adapters"].items():
            load_policy_state(self.model, sd, p)
        for p, sd in state["optimizers"].items():
            self.policies[p].optimizer.load_state_dict(sd)
        for p, sd in state["schedulers"].items():
            self.policies[p].scheduler.load_state_dict(sd)
        checkpoint.set_rng_state(state["rng"])
        self.step, self.nan_streak = state["step"], state["nan_streak"]
        self.grad_ema = state.get("grad_ema", {})
        self.itv.load_state_dict(state.get("interventions", {}))
        self.metric_rows, self.sample_rows = list(state["metric_rows"]), list(state["sample_rows"])
        self.outcome_rows = list(state.get("outcome_rows", []))  # absent in checkpoints written before them
        self._pending_eval = state.get("pending_eval")
        self.backend.on_update()

    def save_checkpoint(self) -> Path | None:
        """Write the step's checkpoint (marlflow.training.checkpoint: whole or not at all, older ones pruned); rank 0 alone
        writes (every rank holds the same state), the others return None at once."""
        return checkpoint.save(self) if distributed.is_main() else None

    def restore(self) -> bool:
        """Load the newest complete checkpoint, if any (marlflow.training.checkpoint); False when there is none."""
        return checkpoint.restore(self)

    def samples_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.sample_rows, columns=SAMPLE_COLUMNS)

    def outcomes_frame(self) -> pd.DataFrame:
        return outcomes_frame(self.outcome_rows)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> pd.DataFrame:
        """Train to `grpo.steps`, resuming from the newest checkpoint; returns the metrics table. The trackers
        of cfg.report_to (marlflow.training.trackers) get each step's new metric rows and are finished on any exit.
        Raises preempt.Preempted after a SIGTERM / SIGUSR1, once the last completed step is checkpointed."""
        # Rank 0 alone feeds the trackers (the others hold the same rows).
        cfg = self.cfg if distributed.is_main() else dataclasses.replace(self.cfg, report_to=[])
        try:
            with Trackers(cfg, self.out_dir) as self.trackers:
                return self._fit()
        finally:
            self.backend.close()  # vLLM's published adapters are scratch files (hundreds of MB per run)

    def _fit(self) -> pd.DataFrame:
        g = self.cfg.grpo
        resumed = self.restore()
        # where this start trains, beside the run's outputs but in none of them (marlflow.training.environment)
        environment.record_start(self.out_dir, self.step, self.cfg.device)
        if resumed:  # the newest eval accuracy among the restored rows, read once
            accs = [r["value"] for r in self.metric_rows if r["split"] == "eval" and r["role"] == "all"
                    and r["metric"] == "accuracy"]  # fmt: skip
            self.last_acc = accs[-1] if accs else None
        else:
            base = self._base_eval()
            if base is not None:  # else deferred: placed at the first evaluation or checkpoint
                self._place(base, first=True)
                self.last_acc = base.accuracy
                self._after_eval()
        self.trackers.start(self.metric_rows, resumed_step=self.step or None)  # what each tracker lacks
        first, t_start = self.step, time.perf_counter()
        last_save = time.monotonic()  # time-based checkpoints (RunConfig.save_every_minutes)
        # Resumed from a checkpoint taken between two chunks of its step's evaluation: that evaluation is finished
        # first (from its next chunk), then checkpointed again, whole, in place of the partial one.
        resume_eval = self._pending_eval is not None
        # every rank asks at each step boundary
        while (resume_eval or self.step < g.steps) and not distributed.stop_agreed():
            if not resume_eval:
                self.step += 1
                if not self.train_step(self.step):  # stopped during its rollout: the step is undone
                    self.step -= 1
                    break
            evaluate = resume_eval or self.step % g.eval_every == 0 or self.step == g.steps
            save = resume_eval or (g.save_every and self.step % g.save_every == 0) or self.step == g.steps
            resume_eval = False
            if self.cfg.save_every_minutes and not save:  # rank 0's clock decides for every rank
                unsaved = time.monotonic() - last_save
                save = distributed.from_main(lambda u=unsaved: u >= 60 * self.cfg.save_every_minutes)
            if evaluate or save:
                self._settle_base_eval()
            if evaluate:
                ev = self.evaluate_workflow(self.step, stoppable=True)
                if ev is None:  # stopped between two chunks: checkpointed below with the finished ones
                    break
                self._place(ev)
                self.last_acc = ev.accuracy
                self._after_eval()
            self.trackers.log(self.metric_rows)  # this step's rows, before its checkpoint
            if save:
                self.save_checkpoint()
                last_save = time.monotonic()
            if self.step > first:  # not after a resumed evaluation alone
                self._log_progress(first, t_start)
        # a SIGTERM / SIGUSR1 (marlflow.training.preempt): checkpoint, exit 75 for a rerun
        if self.step < g.steps or self._pending_eval is not None:
            self._stop_for_rerun()
        self._settle_base_eval()
        return pd.DataFrame(self.metric_rows)

    def _stop_for_rerun(self) -> None:
        """Checkpoint the last completed step unless its checkpoint exists, log what happened, and raise
        preempt.Preempted (marlflow.cli.train exits with preempt.EXIT_PREEMPTED; the rerun resumes from here). Every
        rank calls it after the same step (distributed.stop_agreed); rank 0 decides and writes."""
        done = distributed.from_main(lambda: {p.name for p in checkpoint.complete(self.out_dir)})
        part = self._pending_eval
        if self.step == 0:  # the rerun starts afresh and reads step 0's evaluation from the cell's cache
            what = "no step completed, nothing to checkpoint"
        elif part is not None:  # mid-evaluation: the step and its finished chunks (newer than any on disk)
            self.trackers.log(self.metric_rows)
            self.save_checkpoint()
            n = len(self.eval_problems) + len(self.val_problems)
            what = (f"checkpointed step-{self.step} with {part.done()} of its evaluation's {n} problems done, "
                    "kept for the rerun to go on from" + ("" if distributed.is_main() else " (by rank 0)"))  # fmt: skip
        elif f"step-{self.step}" in done:
            what = f"checkpoint step-{self.step} already written"
        else:
            if self._settle_base_eval():
                self.trackers.log(self.metric_rows)
            self.save_checkpoint()  # rank 0's write; the others go on to the barrier below
            what = f"checkpointed step-{self.step}" + ("" if distributed.is_main() else " (by rank 0)")
        log.warning(
            "stopped on %s at step %d of %d: %s, steps lost: 0; exiting with %d for a rerun to resume",
            preempt.describe() or "another rank's signal", self.step, self.cfg.grpo.steps, what,
            preempt.EXIT_PREEMPTED,
        )  # fmt: skip
        distributed.barrier()  # no rank exits (and makes a launcher stop the others) before rank 0 has written
        raise preempt.Preempted(f"run {self.cfg.run_id} stopped on a signal after step {self.step}: {what}")

    def _log_progress(self, first: int, t_start: float) -> None:
        """One line per step for the job log: where the run is, how it learns, and when it will end."""
        g, last = self.cfg.grpo, self.last_step
        per_step = (time.perf_counter() - t_start) / (self.step - first)  # evals and checkpoints included
        log.info(
            "step %d/%d  reward %.3f  live %.0f%%  %.1f s/step  ETA %s  last eval accuracy %s",
            self.step, g.steps, last["reward"], 100 * last["live"], last["seconds"],
            time.strftime("%H:%M:%S", time.gmtime(per_step * (g.steps - self.step))),
            "n/a" if self.last_acc is None else f"{self.last_acc:.3f}",
        )  # fmt: skip
