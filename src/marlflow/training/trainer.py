"""The multi-agent GRPO trainer: TRL's GRPOTrainer with workflow rollouts and per-role updates.

`MultiAgentGRPOTrainer` subclasses `trl.GRPOTrainer` (pinned to 1.16.0) and keeps TRL's loss
(`_compute_loss`: clip-higher, loss types, fused log-prob head). What it replaces is the outer loop, so
that one step reads top to bottom. The step is split in three modules; this one holds the loop, the TRL
overrides (log-probs, one chunk's loss: `piece_loss`), step-0 sharing, cliff_guard and the state:

    marlflow.training.rollout     problems  = the step's problems (a pure function of seed and step: no sampler state)
                         episodes  = workflows.rollout(problems x G)   # one generate per policy per stage
                         calls     = every role call, reward = the episode's final outcome (paper default)
                         adv       = GRPO advantages within (problem, slot) groups (check_groups: none mixed)
    marlflow.training.update      for policy in policies:           # SP: "shared"; IP: one adapter per role type
                             policy_backward: for role, slot, chunk: loss = TRL _compute_loss(chunk) * weight;
                                 backward; g_r = the gradient the role added (sum of its slots' parts)
                             [data-parallel hook: all-reduce the PolicyGrad here; see update.PolicyGrad]
                             finish_policy: role metrics; intervention hook g = sum_r scale_r * g_r
                                 (marlflow.interventions.role_scales; KL acts on the loss)
                         apply_step: clip each policy's gradient; step its own AdamW and scheduler
    marlflow.training.evaluation  evaluate every eval_every steps (the same function as `marlflow eval`)
    marlflow.training.checkpoint  checkpoint every save_every steps: state_dict() / load_state_dict()
    SIGTERM / SIGUSR1 (marlflow.training.preempt): abandon the step if its update has not started, else finish it;
                         checkpoint the last completed step; raise preempt.Preempted (exit 75, rerun)

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

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
from datasets import Dataset
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import get_scheduler
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad

from marlflow import interventions as itv
from marlflow.generation.fastgen import use_gqa_sdpa
from marlflow.generation.hf import ChatEncoder, make_backend
from marlflow.generation.sampling import distinct_rows
from marlflow.store.schema import SAMPLE_COLUMNS, rows
from marlflow.tasks.splits import run_splits
from marlflow.training import checkpoint, distributed, environment, evaluation, preempt
from marlflow.training import rollout as ro
from marlflow.training import update as upd
from marlflow.training.base_eval import SharedBaseEval
from marlflow.training.trackers import Trackers

log = logging.getLogger("marlflow.training.trainer")

# Rollout-trainer agreement: mean |logp_rollout - logp_trainer| over a role's sampled tokens above this many
# nats is warned about once per run. bf16 vLLM against the fp32 trainer measured 0.01-0.04 nats (SmolLM2-135M
# and the toy model, CPU); a stale adapter or a wrong stop token shows up as 0.1 and more.
LOGP_GAP_WARN = 0.1


class NaNLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def _no_reward(prompts, completions, **kwargs):
    # TRL requires at least one reward function; rewards come from the task verifier in `rollout`.
    return [None] * len(prompts)


def _grpo_args(cfg, out_dir: Path) -> GRPOConfig:
    g = cfg.grpo
    return GRPOConfig(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=g.group_size,
        num_generations=g.group_size,
        max_completion_length=g.max_completion_length,
        learning_rate=g.learning_rate,
        # The KL term is computed per role (grpo.beta, or an I1 per-role beta) with reference log-probs
        # that `update` supplies from the base model (adapter disabled); TRL's own reference setup assumes an
        # adapter named "default" (ours are named after roles), so TRL is built with beta 0 and `update`
        # sets `self.beta` for each role's sub-batch.
        beta=0.0,
        # Kept at TRL 1.16's default, set here so a TRL upgrade cannot change it silently. With it, TRL multiplies
        # the k3 KL term by the importance ratio exp(logp - logp_old); on-policy (our case: no old log-probs are
        # passed, so logp_old = logp.detach()) its value is 1 but its gradient is not, and the KL gradient becomes
        # E[grad logp * log(pi / ref)], the unbiased gradient of KL(pi || ref), the reverse KL that grpo.beta and
        # kl_anchor (the paper's I1: beta_role * KL(pi_role || pi_ref)) put on the loss. Without it the k3
        # gradient is E[grad logp * (1 - ref / pi)], the gradient of the forward KL(ref || pi) (what verl's
        # low_var_kl loss, the paper's code, differentiates). Every KL run in docs/results.md ran with True.
        # tests/test_interventions.py::test_bias_corrected_k3_gradient_is_the_reverse_kl_gradient checks both.
        use_bias_correction_kl=True,
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        temperature=g.temperature,
        top_p=g.top_p,
        max_grad_norm=g.max_grad_norm,
        use_cpu=cfg.device == "cpu",
        bf16=cfg.device == "cuda",
        # RunConfig.gradient_checkpointing (auto: on at hub scales). TRL reads the flag only to call PEFT's
        # enable_input_require_grads in its __init__ (transformers' Trainer.train(), which would enable the
        # checkpointing itself, is never called: MultiAgentGRPOTrainer.__init__ enables it, non-reentrant,
        # with these same kwargs, which TRL's disable_gradient_checkpointing also restores with).
        gradient_checkpointing=cfg.use_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if cfg.use_gradient_checkpointing else None,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=cfg.seed,
        use_vllm=False,
        disable_tqdm=True,
    )


# The variables from which accelerate (and transformers' TrainingArguments) infer a multi-process run.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
               "MV2_COMM_WORLD_SIZE")  # fmt: skip


@contextlib.contextmanager
def _accelerate_single_process():
    """Hide torchrun's rank variables while TRL builds its Accelerator, so that each rank's accelerator is a
    single process. marlflow.training.distributed does every collective of a data-parallel step itself; under torchrun
    (not under srun, whose variables accelerate does not read) accelerate would otherwise reduce TRL's per-chunk
    entropy and clip metrics over the ranks inside `_compute_loss`: a collective per chunk, which hangs when the
    ranks run different numbers of chunks and would count every rank's calls twice (update.reduce_policy_grad
    sums them). accelerate keeps the state it builds here (a per-process singleton)."""
    hidden = {k: os.environ.pop(k) for k in LAUNCH_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


class MultiAgentGRPOTrainer(GRPOTrainer):
    """GRPO over workflow episodes with one LoRA adapter per policy on one frozen base model.

    model: a `peft.PeftModel` holding one adapter per name in `cfg.policies`.
    task: a `marlflow.tasks.Task`; out_dir: the run folder (checkpoints/, metrics.parquet, ...).
    """

    def __init__(self, cfg, model, tokenizer, task, out_dir: str | Path):
        self.cfg, self.task, self.out_dir = cfg, task, Path(out_dir)
        placeholder = Dataset.from_dict({"prompt": ["unused"] * cfg.grpo.group_size})
        with _accelerate_single_process():
            super().__init__(
                model=model,
                reward_funcs=[_no_reward],
                args=_grpo_args(cfg, self.out_dir),
                train_dataset=placeholder,
                processing_class=tokenizer,
            )
        # TRL's Trainer creates args.output_dir although nothing is saved there: leave no empty trl/ in the run.
        with contextlib.suppress(OSError):
            Path(self.args.output_dir).rmdir()
        self.current_gradient_accumulation_steps = 1
        # val_problems: task.val_size problems disjoint from both, for what selects (cliff_guard): splits.py
        self.train_problems, self.val_problems, self.eval_problems = run_splits(task, cfg.task)
        for name, probs in (("train", self.train_problems), ("test", self.eval_problems)):
            if not probs:
                raise ValueError(
                    f"task {cfg.task.name!r} has an empty {name} split; check task.source in matrix.yaml"
                )
        self.encoder = ChatEncoder(tokenizer, cfg.grpo.max_prompt_length)
        use_gqa_sdpa(self.model)  # CPU: grouped K/V heads read in place, not copied per layer (same forward)
        self.backend = make_backend(cfg.backend, self.model, tokenizer, cfg.policies, cfg)
        if cfg.use_gradient_checkpointing:
            # Non-reentrant: the recompute is driven by autograd's saved-tensor hooks, so LoRA gradients flow
            # without inputs that require grad and with keyword arguments (the reentrant variant needs both).
            # It acts in training mode only: generation (model.eval(), HFBackend) keeps its K/V cache. Enabled
            # after the backend is built, so the hf backend's bf16 sampling copy has no checkpointing in it.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.share_prefix = True  # run each distinct prompt of a piece once (see _shared_prefix_logps)
        if hasattr(task, "warm_up"):  # code tasks: start (and check) the sandbox before the step-0 eval
            task.warm_up()
        self.params = {
            p: [t for n, t in self.model.named_parameters() if f".{p}." in n] for p in cfg.policies
        }
        g = cfg.grpo
        self.optimizers, self.schedulers = {}, {}
        for p, params in self.params.items():
            if not params:
                raise ValueError(f"adapter {p!r} has no parameters; was the PEFT model built with it?")
            opt = torch.optim.AdamW(params, lr=g.learning_rate, weight_decay=g.weight_decay)
            self.optimizers[p] = opt
            self.schedulers[p] = get_scheduler(g.lr_scheduler, opt, g.warmup_steps, g.steps)
        self.step = 0
        self.nan_streak = 0
        self.metric_rows: list[dict] = []
        self.sample_rows: list[dict] = []
        self._last_logps: torch.Tensor | None = None
        self._gap_warned = False
        # role -> EMA of its own-loss gradient (flat, fp32, on the adapter's device); checkpointed, so a
        # resumed run logs the same ema_cos as an uninterrupted one.
        self.grad_ema: dict[str, torch.Tensor] = {}
        self.itv = itv.State()  # the intervention's state (I6's EMA); checkpointed
        self._pending_base = None  # a deferred step-0 evaluation: (SharedBaseEval, initial adapters)

    # ------------------------------------------------------------------ data

    def problems_for(self, step: int):
        """The step's problems: a pure function of (seed, step), so a resumed run sees the same data."""
        return ro.step_problems(self.train_problems, self.cfg.seed, step, self.cfg.grpo.problems_per_step)

    def _ctx(self, temperature: float, timer=None, seed: int | None = None, policy_of=None):
        return ro.context(
            self.cfg, self.task, self.backend, self.encoder, temperature, timer, seed, policy_of
        )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        **kwargs,
    ):
        # TRL's loss computes the trainer's log-probabilities here; keep the last ones (no extra forward) so
        # `update` can compare them with the rollout engine's.
        shared = None
        plain = all(v is None or v is False for v in kwargs.values())  # no images, no MoE aux loss
        # _shared_prefix_logps returns None (TRL's forward runs) where layers are checkpointed, see there.
        if self.share_prefix and plain and (batch_size is None or batch_size >= input_ids.size(0)):
            shared = self._shared_prefix_logps(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy
            )
        if shared is None:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
            )
        else:
            (logps, entropies), aux = shared, None
        self._last_logps = logps.detach()
        return logps, entropies, aux

    def _shared_prefix_logps(
        self, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool
    ):
        """TRL's per-token log-probs (and entropies) of the completions, with each distinct prompt run once.

        input_ids / attention_mask (B, P + C): left-padded prompts, right-padded completions; C = logits_to_keep.
        A piece's rows are G rollouts of a few prompts (calls are chunked per slot), so TRL's forward recomputes
        every prompt G times. Here the distinct prompts (all but their last token) go through the model once
        into a KV cache, the cache is expanded to the rows with `index_select` (gradients flow back through it),
        and each row runs only its last prompt token and completion, through the same fused log-prob head and
        the same positions (0..T-1) as TRL's forward. Returns ((B, C) log-probs, (B, C) entropies or None), or
        None when no prompt repeats or when the model's layers are checkpointed (below). Equal to TRL's up to
        float rounding, gradients included (tests/test_trainer.py::test_shared_prefix_logps_equal_trls,
        ::test_gradient_checkpointing_gives_the_same_logps_and_gradients); benchmarks/bench_prefix_share.py."""
        from transformers import DynamicCache

        # Switched off under gradient checkpointing (training mode), not adapted to it. transformers sets
        # past_key_values=None inside a checkpointed layer (a one-time warning), because a recompute would write
        # the cache twice: this path's rows would attend to no prompt at all, silently (up to 3.9 nats off
        # on the toy model). Running the prefix forward uncheckpointed is correct but keeps every activation of
        # the prompt (~92 KiB per token per layer at Qwen3-0.6B widths, measured on the CPU for issue 23), the
        # memory checkpointing exists to save; a read-only cache that checkpointed layers may keep would be
        # correct, but the cache expanded to the B rows, B x P x layers x 2 x 1,024 K/V values (4 KiB per token
        # per layer in bf16 at Qwen3 0.6B-4B), is as large as or larger than what checkpointing keeps of those
        # prompts in TRL's forward (their layer inputs: hidden size x 2 bytes, 2 / 4 / 5 KiB). So where layers
        # are checkpointed the plain forward is both correct and the smaller; the sharing saves compute only.
        if model.training and getattr(model, "is_gradient_checkpointing", False):
            return None
        n_prefix = input_ids.size(1) - logits_to_keep - 1  # prompt positions in the cache
        if n_prefix < 1:
            return None
        prefix = torch.cat([input_ids[:, :n_prefix], attention_mask[:, :n_prefix]], dim=1)
        first, inv = distinct_rows(map(tuple, prefix.tolist()))
        if len(first) == len(inv):
            return None
        uniq = torch.tensor(first, device=input_ids.device)
        cache = DynamicCache(config=model.config)
        with self.accelerator.autocast():
            model(input_ids=input_ids[uniq, :n_prefix], attention_mask=attention_mask[uniq, :n_prefix],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
            cache.reorder_cache(torch.tensor(inv, device=input_ids.device))
            rows = input_ids[:, n_prefix:]
            labels = rows.masked_fill(attention_mask[:, n_prefix:] == 0, -100)
            out = model(input_ids=rows, attention_mask=attention_mask, past_key_values=cache, labels=labels,
                        fused_lm_head=True)  # fmt: skip
        logps = out.log_probs[:, -logits_to_keep:]
        return logps, (out.entropy[:, -logits_to_keep:] if compute_entropy else None)

    def _logp_gap(self, pcalls) -> tuple[float, int]:
        """Sum of |logp_rollout - logp_trainer| over the sampled tokens of `pcalls`, and the token count.

        `self._last_logps` (B, T) is the trainer's per-token log-probabilities of the piece just computed;
        call i's rollout log-probabilities cover its first len(completion_ids) positions."""
        ref = [c.rollout_logps if c.rollout_logps is not None and c.completion_ids else [] for c in pcalls]
        n = sum(len(r) for r in ref)
        if not n:
            return 0.0, 0
        # One padded tensor and one device sync per piece, not one per call.
        rollout = pad([torch.tensor(r, dtype=torch.float32) for r in ref], 0.0, padding_side="right")
        mask = pad([torch.ones(len(r)) for r in ref], 0.0, padding_side="right")
        ours = self._last_logps[:, : rollout.size(1)].float()
        gap = ((ours - rollout.to(ours.device)).abs() * mask.to(ours.device)).sum().item()
        return gap, n

    # ------------------------------------------------------------------ one training step

    def flatten(self, episodes):
        """Episodes -> (calls, rewards (N,), advantages (N,), group index (N,), group std (K,)): rollout.flatten."""
        b = ro.flatten(self.cfg, episodes)
        return b.calls, b.rewards, b.advantages, b.index, b.std

    def collate(self, calls, advantages: torch.Tensor, num_items: int) -> dict:
        """Role calls -> the input dict TRL's `_compute_loss` expects (prompts left-, completions right-padded)."""
        device = self.accelerator.device
        prompts = [torch.tensor(c.prompt_ids) for c in calls]
        comps = [torch.tensor(c.completion_ids or [self.processing_class.eos_token_id]) for c in calls]
        return {
            "prompt_ids": pad(prompts, self.processing_class.pad_token_id, padding_side="left").to(device),
            "prompt_mask": pad([torch.ones_like(p) for p in prompts], 0, padding_side="left").to(device),
            "completion_ids": pad(comps, self.processing_class.pad_token_id, padding_side="right").to(device),
            "completion_mask": pad(
                [
                    torch.ones_like(c) if k.completion_ids else torch.zeros_like(c)
                    for c, k in zip(comps, calls)
                ],
                0,
                padding_side="right",
            ).to(device),
            "advantages": advantages.to(device),
            "num_items_in_batch": torch.tensor(float(num_items), device=device),
        }

    @torch.no_grad()
    def _ref_logps(self, inputs: dict) -> torch.Tensor:
        """(B, T) log-probabilities of the completion tokens under the base model: every adapter disabled."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.model.disable_adapter():
            logps, _, _ = super()._get_per_token_logps_and_entropies(
                self.model, ids, mask, inputs["completion_ids"].size(1)
            )
        return logps.detach()

    def piece_loss(self, pcalls, adv: torch.Tensor, tok_pol: int, weight: float, beta: float) -> upd.Piece:
        """One chunk's GRPO loss (TRL's `_compute_loss`) times `weight`, with the chunk's entropy, clip ratio,
        KL (beta > 0: a KL term to the base model, whose log-probs `_ref_logps` supplies) and rollout-trainer
        log-prob gap; marlflow.training.update runs it for every chunk. adv: (n,) the chunk's advantages."""
        inputs = self.collate(pcalls, adv, tok_pol)
        if beta:
            inputs["ref_per_token_logps"] = self._ref_logps(inputs)
        self.beta = beta  # read by TRL's _compute_loss
        try:
            loss = self._compute_loss(self.model, inputs) * weight
        finally:
            self.beta = 0.0
        m, n = self._metrics["train"], len(pcalls)
        kl = m["kl"].pop() * n if beta else None
        gap, gap_n = self._logp_gap(pcalls)
        clip = m.get("clip_ratio/region_mean", [0.0])[-1] * n
        return upd.Piece(loss, m["entropy"].pop() * n, clip, kl, gap, gap_n)

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
        # Data parallel (issue 27): `calls` are this rank's; the loss normalisers count every rank's, and each
        # policy's gradient is summed over the ranks before any metric, the intervention or clipping reads it
        # (marlflow.training.update.reduce_policy_grad). One process: the counts are its own and the reduce is the identity.
        counts = upd.sum_counts(distributed.gather(upd.policy_counts(self.cfg, calls)))
        for policy in self.cfg.policies:
            if not finite:  # the step is discarded: no later policy's backward is run
                break
            pg = upd.policy_backward(self, self.cfg, policy, self.params[policy], calls, adv, metrics,
                                     counts.get(policy))  # fmt: skip
            if distributed.world() > 1:
                pg = upd.reduce_policy_grad(pg, policy, self.params[policy])
            if pg is None:
                continue
            norms[policy] = upd.finish_policy(pg, self.cfg, self.itv, stats, metrics)
            finite = pg.finite and math.isfinite(norms[policy])
            done.append(pg)
            for role in pg.roles:
                if "logp_gap" in stats[role]:
                    self._warn_gap(role, stats[role]["logp_gap"])
        self._metrics["train"].clear()  # TRL's own per-call lists; we record per role instead
        stats["all"]["nan_skipped"] = float(not finite)
        if not finite:
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            return stats
        upd.apply_step(self, done, norms, stats, metrics)
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

    def evaluate_workflow(self, step: int, base: bool = False) -> float:
        """Workflow accuracy on the fixed held-out subset, one episode per problem (marlflow.training.evaluation, whose
        docstring says how its sampling leaves training's RNG untouched; base: the untrained adapters, every
        role routed to the first policy). Its rows go into the run's tables.

        With validation problems (task.val_size), they are evaluated next the same way (with their own seed)
        and logged under split "val"; returns the test accuracy."""
        args = self.cfg, self.task, self.backend, self.encoder
        ev = evaluation.evaluate(*args, self.eval_problems, step, base)
        self.metric_rows += ev.metric_rows
        self.sample_rows += ev.sample_rows
        log.info("step %d eval accuracy %.3f (n=%d)", step, ev.accuracy, len(self.eval_problems))
        if self.val_problems:
            val = evaluation.validate(*args, self.val_problems, step, base)
            self.metric_rows += val.metric_rows
            log.info("step %d validation accuracy %.3f (n=%d)", step, val.accuracy, len(self.val_problems))
        return ev.accuracy

    def _guard_input(self) -> tuple[float, int]:
        """cliff_guard's evaluation of `self.step`: (accuracy, n) of its validation rows (split "val"); the
        test rows are never read, so a restore never selects on the problems accuracy is reported on."""
        got = {r["metric"]: r["value"] for r in self.metric_rows if r["split"] == "val" and r["role"] == "all"
               and r["step"] == self.step and r["metric"] in ("accuracy", "n_eval")}  # fmt: skip
        return got["accuracy"], int(got["n_eval"])

    def _cliff_guard(self) -> None:
        """cliff_guard (marlflow.interventions), after the evaluation of `self.step`, on its validation
        accuracy (`_guard_input`).

        A new best eval: keep CPU copies of every adapter and its AdamW state (in `self.itv`, checkpointed).
        A cliff (interventions.guard_check): log guard_drop, guard_drop_se and guard_z (train split, role
        all); if restores are left, also put the copy back (adapters and AdamW moments; the schedulers keep
        their step), scale every policy's learning rate and schedule by lr_factor, publish the adapters to
        the rollout engine, and log guard_restore (the step restored to), guard_restores, guard_lr_scale."""
        spec, st = self.cfg.intervention_spec, self.itv
        if spec["kind"] != "cliff_guard":
            return
        acc, n = self._guard_input()
        if itv.guard_observe(st, self.step, acc, n):
            st.best = {
                "step": self.step, "acc": acc, "n": n,
                "adapters": self._adapter_copies(),
                "optimizers": {p: itv.cpu_copy(o.state_dict()) for p, o in self.optimizers.items()},
            }  # fmt: skip
            return
        g = self.cfg.grpo
        check = itv.guard_check(st.evals, st.restores, spec, itv.eval_looks(g.steps, g.eval_every))
        if not check["cliff"]:
            return
        values = {"guard_drop": check["drop"], "guard_drop_se": check["drop_se"], "guard_z": check["drop_z"]}
        if check["fire"]:
            best, f = st.best, spec["lr_factor"]
            for p, sd in best["adapters"].items():
                set_peft_model_state_dict(self.model, sd, adapter_name=p)
            for p, opt in self.optimizers.items():
                lrs = [(gr["lr"] * f, gr.get("initial_lr", gr["lr"]) * f) for gr in opt.param_groups]
                opt.load_state_dict(itv.cpu_copy(best["optimizers"][p]))  # a copy: AdamW updates it in place
                upd.scale_schedule(opt, self.schedulers[p], lrs, f)
            st.restores, st.lr_scale = st.restores + 1, st.lr_scale * f
            st.evals = [(best["step"], best["acc"], best["n"])]
            self.backend.on_update()  # the rollout engine must sample from the restored adapters
            values.update(guard_restore=best["step"], guard_restores=st.restores, guard_lr_scale=st.lr_scale)
            log.warning("step %d: cliff_guard: validation accuracy %.3f, a cliff (drop %.3f, SE %.3f); restored "
                        "the best eval's weights (step %d, %.3f), learning rate x%g (restore %d of %d)",
                        self.step, acc, check["drop"], check["drop_se"], best["step"], best["acc"],
                        st.lr_scale, st.restores, spec["max_restores"])  # fmt: skip
        self.metric_rows += rows(self.cfg.factors, self.step, "train", "all", values)

    # ------------------------------------------------------------------ step 0, shared by the cell's runs

    def _adapter_copies(self) -> dict:
        """CPU copies of every policy's adapter weights (set_peft_model_state_dict puts them back)."""
        return {
            p: itv.cpu_copy(get_peft_model_state_dict(self.model, adapter_name=p)) for p in self.cfg.policies
        }

    def _base_eval(self) -> float | None:
        """Step 0's evaluation (marlflow.training.base_eval): read from the cell's cache, computed here, or, while another
        run computes it, deferred (None; `_resolve_base_eval` fills it in)."""
        t0 = time.perf_counter()
        shared = SharedBaseEval(self.cfg, self.out_dir.parent)
        got = distributed.from_main(shared.read)  # rank 0 reads and claims the cache for every rank
        if got is not None:
            return self._put_base_eval(*got, reused=True, seconds=time.perf_counter() - t0)
        can_wait = self.cfg.intervention_spec["kind"] != "cliff_guard" and not self.cfg.report_to
        if distributed.from_main(shared.claim) or not can_wait:
            return self._put_base_eval(*self._compute_base_eval(shared), reused=False)
        log.info("step 0 eval: another run of this cell is computing it; reading it at the first evaluation")
        self._pending_base = (shared, self._adapter_copies())
        return None

    def _resolve_base_eval(self) -> None:
        """Fill in a deferred step-0 evaluation: read it, or compute it with the initial adapters put back."""
        (shared, initial), self._pending_base = self._pending_base, None
        t0 = time.perf_counter()
        got = distributed.from_main(shared.read)
        if got is not None:
            self._put_base_eval(*got, reused=True, seconds=time.perf_counter() - t0)
            return
        log.info("step 0 eval: not computed by another run; evaluating the initial adapters here")
        current = self._adapter_copies()
        try:
            for p, sd in initial.items():
                set_peft_model_state_dict(self.model, sd, adapter_name=p)
            self.backend.on_update()
            got = self._compute_base_eval(shared)
        finally:
            for p, sd in current.items():
                set_peft_model_state_dict(self.model, sd, adapter_name=p)
            self.backend.on_update()
        self._put_base_eval(*got, reused=False)

    def _compute_base_eval(self, shared: SharedBaseEval) -> tuple[list[dict], list[dict]]:
        """Evaluate step 0 and write it for the cell (rank 0: the others evaluate their share of the problems);
        returns its (metric rows, sample rows), which are kept out of this run's tables (`_put_base_eval`
        places them)."""
        kept = self.metric_rows, self.sample_rows
        self.metric_rows, self.sample_rows = [], []
        try:
            self.evaluate_workflow(0, base=True)
            if distributed.is_main():
                shared.write(self.metric_rows, self.sample_rows, SAMPLE_COLUMNS)
            return self.metric_rows, self.sample_rows
        finally:
            shared.release()
            self.metric_rows, self.sample_rows = kept

    def _put_base_eval(self, metric_rows, sample_rows, reused: bool, seconds: float | None = None) -> float:
        """Step 0's rows first in the tables, where an evaluation at step 0 puts them; returns its accuracy."""
        if seconds is not None:  # this run's own time for step 0's evaluation: the read
            metric_rows = [{**r, "value": seconds} if r["metric"] == "time_eval" else r for r in metric_rows]
        flag = rows(self.cfg.factors, 0, "eval", "all", {"eval_reused": float(reused)})
        self.metric_rows[:0] = [*metric_rows, *flag]
        self.sample_rows[:0] = sample_rows
        acc = next(r["value"] for r in metric_rows
                   if r["split"] == "eval" and r["metric"] == "accuracy" and r["role"] == "all")  # fmt: skip
        log.info("step 0 eval accuracy %.3f (n=%d, %s)", acc, len(self.eval_problems),
                 "read from the cell's shared step-0 evaluation" if reused else "computed here")  # fmt: skip
        return acc

    # ------------------------------------------------------------------ checkpoints and resume

    def state_dict(self) -> dict:
        """Everything a checkpoint holds (marlflow.training.checkpoint), by reference: step, nan_streak, each policy's
        adapter weights, AdamW and scheduler states, the per-role gradient EMAs, the intervention's state, the
        process's RNG states (checkpoint.rng_state) and the metric and sample rows so far."""
        return {
            "step": self.step,
            "nan_streak": self.nan_streak,
            "adapters": {p: get_peft_model_state_dict(self.model, adapter_name=p) for p in self.cfg.policies},
            "optimizers": {p: o.state_dict() for p, o in self.optimizers.items()},
            "schedulers": {p: s.state_dict() for p, s in self.schedulers.items()},
            "grad_ema": self.grad_ema,
            "interventions": self.itv.state_dict(),
            "rng": checkpoint.rng_state(),
            "metric_rows": self.metric_rows,
            "sample_rows": self.sample_rows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Put back a `state_dict()`: each adapter into its own policy, then publish them to the rollout engine
        (it still serves the adapters it started with; the next step would sample from the wrong policy and
        train on it as on-policy). grad_ema and interventions may be absent (older checkpoints)."""
        for p, sd in state["adapters"].items():
            set_peft_model_state_dict(self.model, sd, adapter_name=p)
        for p, sd in state["optimizers"].items():
            self.optimizers[p].load_state_dict(sd)
        for p, sd in state["schedulers"].items():
            self.schedulers[p].load_state_dict(sd)
        checkpoint.set_rng_state(state["rng"])
        self.step, self.nan_streak = state["step"], state["nan_streak"]
        self.grad_ema = state.get("grad_ema", {})
        self.itv.load_state_dict(state.get("interventions", {}))
        self.metric_rows, self.sample_rows = list(state["metric_rows"]), list(state["sample_rows"])
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
            self.last_acc = self._base_eval()
            if self.last_acc is not None:
                self._cliff_guard()
        self.trackers.start(self.metric_rows, resumed_step=self.step or None)  # what each tracker lacks
        first, t_start = self.step, time.perf_counter()
        while self.step < g.steps and not distributed.stop_agreed():  # every rank asks at each step boundary
            self.step += 1
            if not self.train_step(self.step):  # stopped during its rollout: the step is undone
                self.step -= 1
                break
            evaluate = self.step % g.eval_every == 0 or self.step == g.steps
            save = (g.save_every and self.step % g.save_every == 0) or self.step == g.steps
            if self._pending_base is not None and (evaluate or save):
                self._resolve_base_eval()  # before anything is saved: a checkpoint holds step 0's rows
            if evaluate:
                self.last_acc = self.evaluate_workflow(self.step)
                self._cliff_guard()
            self.trackers.log(self.metric_rows)  # this step's rows, before its checkpoint
            if save:
                self.save_checkpoint()
            self._log_progress(first, t_start)
        if (
            self.step < g.steps
        ):  # a SIGTERM / SIGUSR1 (marlflow.training.preempt): checkpoint, exit 75 for a rerun
            self._stop_for_rerun()
        if self._pending_base is not None:  # steps: 0
            self._resolve_base_eval()
        return pd.DataFrame(self.metric_rows)

    def _stop_for_rerun(self) -> None:
        """Checkpoint the last completed step unless its checkpoint exists, log what happened, and raise
        preempt.Preempted (marlflow.cli.train exits with preempt.EXIT_PREEMPTED; the rerun resumes from here). Every
        rank calls it after the same step (distributed.stop_agreed); rank 0 decides and writes."""
        done = distributed.from_main(lambda: {p.name for p in checkpoint.complete(self.out_dir)})
        if self.step == 0:  # the rerun starts afresh and reads step 0's evaluation from the cell's cache
            what = "no step completed, nothing to checkpoint"
        elif f"step-{self.step}" in done:
            what = f"checkpoint step-{self.step} already written"
        else:
            if self._pending_base is not None:
                self._resolve_base_eval()  # before anything is saved: a checkpoint holds step 0's rows
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
