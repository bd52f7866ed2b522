"""TRL's GRPO loss behind a narrow interface: everything marlflow takes from `trl` (pinned to 1.16.0), in one class.

marlflow uses TRL as a loss library (docs/reference.md, "The TRL boundary"): `GRPOTrainer._compute_loss`
(clip-higher, every loss type, the bias-corrected k3 KL), its per-token log-prob forward through the fused
log-prob head (`_get_per_token_logps_and_entropies`) and its padding helper (`trl.trainer.utils.pad`). Those are
members of a `GRPOTrainer` instance, so `TrlLoss` builds one (with a placeholder dataset and a no-op reward, only
to satisfy its constructor) and keeps it private; marlflow.training.trainer holds a `TrlLoss` and sees only

    inputs = trl.collate(prompts, completions, advantages, num_items)  # the dict _compute_loss reads
    inputs["ref_per_token_logps"] = trl.ref_logps(model, inputs)      # with a KL term: the base model's
    out = trl.loss(model, inputs, beta)   # out.loss, out.metrics (TRL's entropy, kl, clip ratios), out.logps

and, for tests and benchmarks, the forward alone: `logps` (the trainer's: each repeated prompt run once where it
can), `trl_logps` (TRL's own) and `shared_prefix_logps`. tests/test_trl_contract.py pins the TRL members used
here: their signatures, and their numbers on a fixed batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, pad

from marlflow.generation.sampling import distinct_rows

__all__ = ["ChunkLoss", "TrlLoss", "grpo_args", "pad"]

# The variables from which accelerate (and transformers' TrainingArguments) infer a multi-process run.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
               "MV2_COMM_WORLD_SIZE")  # fmt: skip


def grpo_args(cfg, out_dir: Path) -> GRPOConfig:
    """The GRPOConfig TRL's loss is built with, from a RunConfig; out_dir: the run folder."""
    g = cfg.grpo
    return GRPOConfig(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=g.group_size,
        num_generations=g.group_size,
        max_completion_length=g.max_completion_length,
        learning_rate=g.learning_rate,
        # The KL term is computed per role (grpo.beta, or an I1 per-role beta) with reference log-probs
        # that `update` supplies from the base model (adapter disabled); TRL's own reference setup assumes an
        # adapter named "default" (ours are named after roles), so TRL is built with beta 0 and `TrlLoss.loss`
        # sets the beta of each role's sub-batch.
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


@contextlib.contextmanager
def _accelerate_single_process():
    """Hide torchrun's rank variables while TRL builds its Accelerator, so that each rank's accelerator is a
    single process. marlflow.training.distributed does every collective of a data-parallel step itself; under
    torchrun (not under srun, whose variables accelerate does not read) accelerate would otherwise reduce TRL's
    per-chunk entropy and clip metrics over the ranks inside `_compute_loss`: a collective per chunk, which hangs
    when the ranks run different numbers of chunks and would count every rank's calls twice
    (update.reduce_policy_grad sums them). accelerate keeps the state it builds here (a per-process singleton)."""
    hidden = {k: os.environ.pop(k) for k in LAUNCH_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _no_reward(prompts, completions, **kwargs):
    # TRL requires at least one reward function; rewards come from the task verifier (marlflow.training.rollout).
    return [None] * len(prompts)


@dataclasses.dataclass(frozen=True)
class ChunkLoss:
    """What `TrlLoss.loss` returns for one chunk of B calls with completions padded to C tokens."""

    loss: torch.Tensor = dataclasses.field(
        metadata={"help": "TRL's GRPO loss of the chunk (scalar, with graph)"}
    )
    metrics: dict[str, float] = dataclasses.field(
        metadata={"help": "the value TRL logged for the chunk per metric: entropy; kl (only with beta != 0); "
                  "clip_ratio/region_mean and the other clip ratios (loss types that clip)"}
    )  # fmt: skip
    logps: torch.Tensor = dataclasses.field(
        metadata={"help": "(B, C) the per-token log-probs the loss was computed with, detached"}
    )


def _joined(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, P + C) input ids and attention mask of a `collate` dict, as TRL's forward sees them, and C."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return ids, mask, inputs["completion_ids"].size(1)


class _GRPOTrainer(GRPOTrainer):
    """TRL's trainer used as a loss library: `_compute_loss` reaches the forward through `TrlLoss._forward`."""

    def __init__(self, forward, **kwargs):
        self._marlflow_forward = forward
        super().__init__(**kwargs)

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
        return self._marlflow_forward(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, kwargs
        )


class TrlLoss:
    """TRL's GRPO loss, per-token log-probs and batch layout for the policies of one PEFT model.

    cfg: the RunConfig (grpo_args); model: the `peft.PeftModel` TRL's trainer is built on; tokenizer: its
    tokenizer (pad and EOS ids); out_dir: the run folder (TRL's empty output folder in it is removed again).
    Build it before anything else draws random numbers: TRL's constructor seeds every RNG with cfg.seed."""

    def __init__(self, cfg, model, tokenizer, out_dir: str | Path):
        self.tokenizer = tokenizer
        # Run each distinct prompt of a chunk once (`shared_prefix_logps`); False: TRL's own forward of every row.
        self.share_prefix = True
        self._last_logps: torch.Tensor | None = None
        placeholder = Dataset.from_dict({"prompt": ["unused"] * cfg.grpo.group_size})
        # adapter full (marlflow.models.policies.FullPolicies): TRL's trainer is built on the frozen base, a
        # transformers model as it expects; the loss is always computed on the model passed to `loss`.
        host = getattr(model, "reference", model)
        with _accelerate_single_process():
            self._grpo = _GRPOTrainer(
                self._forward,
                model=host,
                reward_funcs=[_no_reward],
                args=grpo_args(cfg, Path(out_dir)),
                train_dataset=placeholder,
                processing_class=tokenizer,
            )
        if host is not model:  # each policy's model gets the fused log-prob head TRL gave its host
            for m in model.policy_models.values():
                add_fused_lm_head(m, temperature=self._grpo.temperature, outputs=("log_probs", "entropy"),
                                  cast_lm_head_to_fp32=self._grpo.args.cast_lm_head_to_fp32)  # fmt: skip
        # TRL's Trainer creates args.output_dir although nothing is saved there: leave no empty trl/ in the run.
        with contextlib.suppress(OSError):
            Path(self._grpo.args.output_dir).rmdir()
        # _compute_loss divides by it; marlflow weights its chunks itself (algos.role_loss_weight).
        self._grpo.current_gradient_accumulation_steps = 1

    @property
    def args(self) -> GRPOConfig:
        """The GRPOConfig TRL was built with (`grpo_args`)."""
        return self._grpo.args

    @property
    def device(self) -> torch.device:
        """Where `collate` puts its tensors: TRL's accelerator's device."""
        return self._grpo.accelerator.device

    # ------------------------------------------------------------------ batch layout

    def collate(
        self, prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, num_items: int
    ) -> dict:
        """Token ids of B calls -> the input dict TRL's `_compute_loss` reads: (B, P) prompt ids and mask
        (left-padded), (B, C) completion ids and mask (right-padded; an empty completion is one EOS token with
        mask 0), advantages (B,), num_items_in_batch (the loss normaliser's token count, `num_items`)."""
        device = self.device
        p = [torch.tensor(ids) for ids in prompts]
        c = [torch.tensor(ids or [self.tokenizer.eos_token_id]) for ids in completions]
        return {
            "prompt_ids": pad(p, self.tokenizer.pad_token_id, padding_side="left").to(device),
            "prompt_mask": pad([torch.ones_like(t) for t in p], 0, padding_side="left").to(device),
            "completion_ids": pad(c, self.tokenizer.pad_token_id, padding_side="right").to(device),
            "completion_mask": pad(
                [torch.ones_like(t) if ids else torch.zeros_like(t) for t, ids in zip(c, completions)],
                0,
                padding_side="right",
            ).to(device),
            "advantages": advantages.to(device),
            "num_items_in_batch": torch.tensor(float(num_items), device=device),
        }

    # ------------------------------------------------------------------ the loss

    def loss(self, model, inputs: dict, beta: float) -> ChunkLoss:
        """TRL's GRPO loss of one chunk (`collate`'s dict; with beta != 0 also inputs["ref_per_token_logps"],
        `ref_logps`) with KL coefficient `beta`, the metrics TRL logged for it, and its log-probs."""
        trl = self._grpo
        trl.beta = beta  # read by _compute_loss; TRL is built with 0 (grpo_args)
        try:
            loss = trl._compute_loss(model, inputs)
        finally:
            trl.beta = 0.0
        logged = trl._metrics["train" if trl.model.training else "eval"]  # the mode _compute_loss logs under
        metrics = {k: v[-1] for k, v in logged.items() if v}
        logged.clear()  # TRL's per-call lists, read here one chunk at a time
        return ChunkLoss(loss, metrics, self._last_logps)

    @torch.no_grad()
    def ref_logps(self, model, inputs: dict) -> torch.Tensor:
        """(B, C) log-probabilities of the completion tokens under the base model: every adapter disabled."""
        with model.disable_adapter():
            logps, _ = self.trl_logps(model, inputs)
        return logps.detach()

    # ------------------------------------------------------------------ the forward

    def logps(self, model, inputs: dict, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, C) log-probs and (B, C) entropies (None unless `entropy`) of `collate`'s completions, as the loss
        computes them: each distinct prompt once where it can (`shared_prefix_logps`), else TRL's forward."""
        ids, mask, keep = _joined(inputs)
        logps, entropies, _ = self._forward(model, ids, mask, keep, None, entropy, {})
        return logps, entropies

    def trl_logps(
        self, model, inputs: dict, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logps` by TRL's own forward of every row (`GRPOTrainer._get_per_token_logps_and_entropies`)."""
        ids, mask, keep = _joined(inputs)
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            self._grpo, model, ids, mask, keep, compute_entropy=entropy
        )
        return logps, entropies

    def shared_prefix_logps(
        self, model, inputs: dict, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`logps` with each distinct prompt run once, or None where that path does not run (no prompt repeats,
        or the layers are checkpointed: `_shared_prefix`)."""
        ids, mask, keep = _joined(inputs)
        return self._shared_prefix(model, ids, mask, keep, entropy)

    def _forward(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, kwargs):
        """TRL's `_get_per_token_logps_and_entropies`, as `_compute_loss` calls it (kwargs: its multimodal and MoE
        keywords): each distinct prompt once where every such keyword is None or False, else TRL's forward. Keeps
        the log-probs (no extra forward) for the rollout-trainer gap (`ChunkLoss.logps`)."""
        shared = None
        plain = all(v is None or v is False for v in kwargs.values())  # no images, no MoE aux loss
        # _shared_prefix returns None (TRL's forward runs) where layers are checkpointed, see there.
        if self.share_prefix and plain and (batch_size is None or batch_size >= input_ids.size(0)):
            shared = self._shared_prefix(model, input_ids, attention_mask, logits_to_keep, compute_entropy)
        if shared is None:
            logps, entropies, aux = GRPOTrainer._get_per_token_logps_and_entropies(
                self._grpo, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                **kwargs,
            )  # fmt: skip
        else:
            (logps, entropies), aux = shared, None
        self._last_logps = logps.detach()
        return logps, entropies, aux

    def _shared_prefix(self, model, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool):
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
        with self._grpo.accelerator.autocast():
            model(input_ids=input_ids[uniq, :n_prefix], attention_mask=attention_mask[uniq, :n_prefix],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
            cache.reorder_cache(torch.tensor(inv, device=input_ids.device))
            rows = input_ids[:, n_prefix:]
            labels = rows.masked_fill(attention_mask[:, n_prefix:] == 0, -100)
            out = model(input_ids=rows, attention_mask=attention_mask, past_key_values=cache, labels=labels,
                        fused_lm_head=True)  # fmt: skip
        logps = out.log_probs[:, -logits_to_keep:]
        return logps, (out.entropy[:, -logits_to_keep:] if compute_entropy else None)
