"""A marlflow step against plain TRL on the same load, per completion.

    python benchmarks/bench_vs_trl.py --model results/models/toy [--pairs 8] [--task math] [--sharing sp]
        [--workflows single eval_opt voting orch_workers] [--trl-micro-batch 32] [--ours-micro-batch N]
        [--no-live] [--json out.json] [--quick]   # tiny mode (benchmarks/harness.py): 1 pair, first workflow

For each workflow (the toy preset's run of `--task` and `--sharing`, from matrix.yaml, 1 thread):

1. "ours": `MultiAgentGRPOTrainer` as `make run` builds it, with the task's real reward. Step 1 is its
   warm-up. Each step's role calls (N chat prompts in (problem, slot) groups) are the load of the TRL step
   that follows it.
2. "trl": plain `trl.GRPOTrainer` (`trainer.train()`) on the same base model with the same LoRA (fresh, as
   ours starts), sampling (temperature, top_p, top_k 0), completion budget, loss type, clip range, beta 0,
   reward scaling and gradient clipping; `SAME` lists the fields checked against our trainer's own
   GRPOConfig. Its prompts are chat messages (TRL applies the chat template; the prompt ids are checked to
   equal ours): P = N/G of ours' calls, every G-th with the calls sorted by group, so one per group where
   every group holds G calls (Eval-Opt's second round and Orch-Workers' extra workers have fewer and are
   sampled in proportion). P is fixed by ours' step 1; before each TRL step its generation batch gets P
   prompts of the ours step run just before it (evenly spaced over that step's calls sorted by group), so
   each (ours, TRL) pair works on the same problems and prompts. TRL generates G completions of each prompt.
   One optimizer step consumes the whole generation batch of P x G completions: one generate call, then
   forward-backward in micro-batches of `--trl-micro-batch` completions with gradient accumulation (0 = all
   at once; on Voting, 8..128 cost TRL 6.0-6.7 CPU s per step and all 256 at once 10.0; 32 is the default).
   TRL's reward is 1 for every other completion (its cost does not depend on the values).
3. "ours_live" (`--no-live` drops it): ours with that same alternating reward (tasks `alternate_math` /
   `alternate_code`: each group's G rollouts get 0, 1, 0, 1, ...), so every advantage is nonzero and every
   call goes through forward-backward, as all of TRL's do. Ours skips zero-advantage calls (exact with
   beta 0: they add nothing to the loss); this variant is the step without that saving.
4. "ours_fp32gen" (`--no-fp32gen` drops it): ours sampling from the fp32 training model itself
   (`generation_dtype: model`). Where the CPU has native bf16, "ours" samples from its bf16 copy with the
   adapter merged (`generation_dtype: auto`), while TRL samples from its fp32 PEFT model; this variant shows
   how much of ours' lead is that copy. On a CPU without native bf16 the two ours variants are the same.

All run interleaved in one process: TRL's `train()` runs `--pairs` + 1 optimizer steps and after each one a
callback runs one step of each "ours" variant, so load drifts on a shared machine hit them alike. TRL's step
time is the wall time between consecutive `on_step_end` callbacks minus the time spent in ours (so it
includes TRL's data loading and logging); ours' is `train_step` (rollout, scoring, update, metrics). Both
also record the process CPU time of each step (`time.process_time`; with 1 thread it is the compute the step
used, which other jobs on the machine disturb far less than wall time; the code tasks' sandbox workers are
other processes and not counted). TRL's split: generate = `_generate`; fwd+bwd+opt = `training_step`
without generating and scoring, plus gradient clipping and `optimizer.step()` (ours: `update()`); other =
scoring, TRL's logging and data loading.

Printed: per workflow and variant, medians of seconds per step, completions and completion tokens per step,
prompt tokens per completion, the share of calls with a nonzero advantage, generate / fwd+bwd+opt / other
seconds; for each ours variant the median over pairs of ours / TRL in wall seconds per completion (the
issue's measure), per completion token and in CPU seconds per completion, and every pair's ratio. `--json`
writes all of it, every step included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from harness import add_cells, environment, parser, setup, toy_cells  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from marlflow.cli.train import build_trainer  # noqa: E402
from marlflow.core.config import RunConfig  # noqa: E402
from marlflow.models.loading import load_model_and_tokenizer  # noqa: E402
from marlflow.tasks import register  # noqa: E402
from marlflow.tasks.toy import ToyCode, ToyMath  # noqa: E402
from marlflow.training import rollout as ro  # noqa: E402
from marlflow.training.trl_loss import grpo_args  # noqa: E402

# GRPOConfig fields that must stay the same for TRL as in our trainer's (marlflow.training.trl_loss.grpo_args)
SAME = (
    "num_generations",
    "max_completion_length",
    "learning_rate",
    "beta",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_grad_norm",
    "scale_rewards",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "use_vllm",
    "use_cpu",
    "num_iterations",
    "mask_truncated_completions",
    "importance_sampling_level",
)


def alternate(outputs) -> list[float]:
    """1 for every other output. Both trainers list a group's G rollouts consecutively (ours: episodes
    problem-major; TRL: each prompt repeated G times), so every group has rewards 0 and 1: every advantage is
    nonzero and every call goes through forward-backward."""
    return [float(i % 2) for i in range(len(outputs))]


def alternate_reward(completions, **kwargs) -> list[float]:  # TRL reward function
    return alternate(completions)


@register("alternate_math")
class AlternateMath(ToyMath):
    name = "alternate_math"

    def score(self, problems, outputs):
        return alternate(outputs)


@register("alternate_code")
class AlternateCode(ToyCode):
    name = "alternate_code"

    def score(self, problems, outputs):
        return alternate(outputs)


def load_of(calls, index: torch.Tensor, group_size: int, n: int | None = None) -> list[int]:
    """Indices of the calls whose prompts TRL gets: every G-th call with the calls sorted by GRPO group, or
    `n` calls evenly spaced in that order (a step with another number of calls than the first)."""
    order = sorted(range(len(calls)), key=lambda i: (int(index[i]), i))
    if n is None:
        return order[::group_size]
    return [order[j * len(order) // n] for j in range(n)]


def _capturing_flatten(cfg, episodes):
    """marlflow.training.rollout.flatten, keeping the step's Batch (calls, advantages, group index) as update() sees it."""
    batch = _FLATTEN(cfg, episodes)
    _BATCHES.append(batch)
    return batch


_FLATTEN, _BATCHES = ro.flatten, []
ro.flatten = _capturing_flatten  # the trainer's train_step calls ro.flatten at run time


class Ours:
    """One marlflow trainer; `step()` runs and times one train_step and records its load."""

    def __init__(self, cfg: RunConfig, tmp: Path):
        self.trainer = build_trainer(cfg, tmp)
        self.cfg, self.rows, self.calls = cfg, [], None

    def step(self, step: int) -> dict:
        _BATCHES.clear()
        t, c = time.perf_counter(), time.process_time()
        self.trainer.train_step(step)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        batch = _BATCHES[-1]
        calls, adv, index = batch.calls, batch.advantages, batch.index
        self.calls = (calls, index)
        m = {
            r["metric"]: r["value"]
            for r in self.trainer.metric_rows
            if r["step"] == step and r["role"] == "all" and r["split"] == "train"
        }
        row = {
            "step": step,
            "wall": wall,
            "cpu": cpu,
            "completions": len(calls),
            "tokens": sum(len(x.completion_ids) for x in calls),
            "prompt_tokens": sum(len(x.prompt_ids) for x in calls),
            "live": float((adv != 0).float().mean()),
            "generate": m["time_generate"],
            "score": m["time_score"],
            "train": m["time_backward"],
            "generate_calls": m["generate_calls"],
        }
        row["other"] = wall - row["generate"] - row["score"] - row["train"]
        self.rows.append(row)
        return row


class Clock(TrainerCallback):
    """Times each TRL optimizer step as the wall/CPU time between consecutive on_step_end calls, minus what
    `after_step` (ours) takes, and runs `after_step(global_step)` after each. `acc["optimizer"]` adds up the
    time from the end of the step's last training_step (forward-backward) to after optimizer.step() (gradient
    clipping and the AdamW step)."""

    def __init__(self, after_step, acc: dict):
        self.after_step, self.acc, self.marks, self.times = after_step, acc, None, []

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.acc["optimizer"] += time.perf_counter() - self.acc["training_step_end"]

    def start(self) -> None:
        self.marks = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        wall, cpu = time.perf_counter() - self.marks[0], time.process_time() - self.marks[1]
        self.times.append((wall, cpu))
        self.after_step(state.global_step)
        self.start()


def timed(obj, name: str, acc: dict, keep=None) -> None:
    """Wrap obj.name so that its wall time adds to acc[name]; keep(result) sees each result."""
    orig = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            out = orig(*args, **kwargs)
        finally:
            acc[f"{name}_end"] = time.perf_counter()
            acc[name] += acc[f"{name}_end"] - t
        if keep is not None:
            keep(out)
        return out

    setattr(obj, name, wrapper)


def trl_trainer(
    cfg: RunConfig, prompts: list, tmp: Path, steps: int, micro_batch: int
) -> tuple[GRPOTrainer, dict]:
    """TRL's trainer on `prompts` x G completions per optimizer step, in forward-backward batches of
    `micro_batch` completions (0: all at once; else the largest divisor of the step's completions <= it)."""
    g = cfg.grpo
    n = len(prompts) * g.group_size
    mb = max(d for d in range(1, min(micro_batch or n, n) + 1) if n % d == 0)
    ours = grpo_args(cfg, tmp / "ours-args")
    # Our trainer's own GRPOConfig, with TRL's batch shape; weight decay and schedule as our AdamW's (ours
    # builds its optimizers itself, TRL from these arguments).
    args = dataclasses.replace(
        ours,
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=n // mb,
        generation_batch_size=n,  # one generate call per optimizer step
        steps_per_generation=None,
        weight_decay=g.weight_decay,
        lr_scheduler_type="constant",
        chat_template_kwargs={"enable_thinking": False},  # as marlflow's ChatEncoder
        max_steps=steps,
        dataloader_num_workers=0,
    )
    diff = {k: (getattr(args, k), getattr(ours, k)) for k in SAME if getattr(args, k) != getattr(ours, k)}
    if diff:
        raise SystemExit(f"TRL's GRPOConfig differs from ours in {diff}")
    targets = (
        g.lora_targets if g.lora_targets == "all-linear" else [t.strip() for t in g.lora_targets.split(",")]
    )  # as marlflow.models.loading.attach_adapters
    lora = LoraConfig(
        r=g.lora_r, lora_alpha=g.lora_alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    torch.manual_seed(cfg.seed)
    base, tok = load_model_and_tokenizer(cfg.model, device=cfg.device)
    trainer = GRPOTrainer(
        model=base,
        reward_funcs=[alternate_reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        peft_config=lora,
    )
    trainer.remove_callback(PrinterCallback)  # TRL still logs every step (as ours does), without printing it
    acc: dict = defaultdict(float)
    acc["completions"], acc["tokens"], acc["prompt_tokens"] = [], [], []

    def keep(out):  # _generate returns (prompt_ids, completion_ids, ...)
        acc["completions"].append(len(out[1]))
        acc["tokens"].append(sum(len(c) for c in out[1]))
        acc["prompt_tokens"].append(sum(len(p) for p in out[0]))

    timed(trainer, "_generate", acc, keep)
    timed(trainer, "training_step", acc)
    return trainer, acc


def check_tokens(trainer: GRPOTrainer, calls, picks: list[int]) -> int:
    """How many of TRL's tokenized prompts differ from marlflow's prompt ids for the same messages."""
    ids, _, _ = trainer._tokenize_prompts([calls[i].messages for i in picks])
    return sum(list(a) != list(calls[i].prompt_ids) for a, i in zip(ids, picks))


def bench(cfg: RunConfig, pairs: int, live: bool, micro_batch: int, fp32gen: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variants = {"ours": Ours(cfg, tmp / "ours")}
        if live:
            task = dataclasses.replace(cfg.task, name=f"alternate_{cfg.task_axis}")
            variants["ours_live"] = Ours(dataclasses.replace(cfg, task=task), tmp / "ours-live")
        if fp32gen:
            variants["ours_fp32gen"] = Ours(
                dataclasses.replace(cfg, generation_dtype="model"), tmp / "ours-fp32"
            )
        first = variants["ours"].step(1)  # warm-up; its calls are TRL's load
        for name, v in variants.items():
            if name != "ours":
                v.step(1)
        calls, index = variants["ours"].calls
        picks = load_of(calls, index, cfg.grpo.group_size)
        trl, acc = trl_trainer(cfg, [calls[i].messages for i in picks], tmp, pairs + 1, micro_batch)
        mismatched = check_tokens(trl, calls, picks)
        trl_rows, marks = [], {}
        load = {"prompts": [calls[i].messages for i in picks]}
        generate_and_score = trl._generate_and_score_completions

        def same_load(inputs):  # TRL's batch lists each prompt G times in a row; give it ours' latest prompts
            g = cfg.grpo.group_size
            return generate_and_score(
                [{**x, "prompt": load["prompts"][j // g]} for j, x in enumerate(inputs)]
            )

        trl._generate_and_score_completions = same_load
        timed(trl, "_generate_and_score_completions", acc)

        def after(step: int) -> None:
            wall, cpu = clock.times[-1]
            ts, gen, prep = acc["training_step"], acc["_generate"], acc["_generate_and_score_completions"]
            ts += acc["optimizer"]
            last = marks or {"ts": 0.0, "gen": 0.0, "prep": 0.0}
            row = {
                "step": step,
                "wall": wall,
                "cpu": cpu,
                "completions": acc["completions"][-1],
                "tokens": acc["tokens"][-1],
                "prompt_tokens": acc["prompt_tokens"][-1],
                "live": 1.0,
                "generate": gen - last["gen"],
                "score": (prep - last["prep"]) - (gen - last["gen"]),
                "train": (ts - last["ts"]) - (prep - last["prep"]),
                "generate_calls": 1,
            }
            row["other"] = wall - row["generate"] - row["score"] - row["train"]
            marks.update(ts=ts, gen=gen, prep=prep)
            trl_rows.append(row)
            if step <= pairs:  # TRL's step 1 is its warm-up, ours' warm-up ran before train()
                for v in variants.values():
                    v.step(step + 1)
                calls, index = variants["ours"].calls  # TRL's next step gets this step's prompts
                load["prompts"] = [
                    calls[i].messages for i in load_of(calls, index, cfg.grpo.group_size, len(picks))
                ]

        clock = Clock(after, acc)
        trl.add_callback(clock)
        clock.start()
        trl.train()
    out = {
        "variants": {"trl": trl_rows[1:]},
        "first_step": first,
        "tokenizer_mismatches": mismatched,
        "trl_prompts": len(picks),
        "trl_micro_batch": trl.args.per_device_train_batch_size,
    }
    for name, v in variants.items():
        out["variants"][name] = v.rows[1:]
    return out


def per(row: dict, key: str, unit: str) -> float:
    return row[key] / row[unit]


def summarize(res: dict) -> dict:
    """Medians per variant and, for each ours variant, per-pair ratios against TRL."""
    trl = res["variants"]["trl"]
    summary = {}
    for name, rows in res["variants"].items():
        df = pd.DataFrame(rows)
        s = {
            k: float(df[k].median())
            for k in (
                "wall",
                "cpu",
                "completions",
                "tokens",
                "live",
                "generate",
                "score",
                "train",
                "other",
                "generate_calls",
            )
        }
        s["prompt_tokens_per_completion"] = float((df.prompt_tokens / df.completions).median())
        s["s_per_completion"] = float((df.wall / df.completions).median())
        s["s_per_token"] = float((df.wall / df.tokens).median())
        if name != "trl":
            for key, unit in (
                ("wall", "completions"),
                ("wall", "tokens"),
                ("cpu", "completions"),
                ("cpu", "tokens"),
            ):
                r = [per(a, key, unit) / per(b, key, unit) for a, b in zip(rows, trl)]
                s[f"ratio_{key}_per_{unit}"] = statistics.median(r)
                s[f"pairs_{key}_per_{unit}"] = r
        summary[name] = s
    return summary


def table(results: dict) -> str:
    lines = [
        "| workflow | variant | step s | completions | completion tokens | prompt tok/completion | live | "
        "generate s | fwd+bwd+opt s | other s | s/completion | x TRL per completion | x TRL per token | "
        "x TRL CPU per completion |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wf, res in results.items():
        for name in ("ours", "ours_live", "ours_fp32gen", "trl"):
            s = res["summary"].get(name)
            if s is None:
                continue
            ratio = (
                ("", "", "")
                if name == "trl"
                else (
                    f"**{s['ratio_wall_per_completions']:.2f}**",
                    f"{s['ratio_wall_per_tokens']:.2f}",
                    f"{s['ratio_cpu_per_completions']:.2f}",
                )
            )
            lines.append(
                f"| {wf} | {name} | {s['wall']:.3f} | {s['completions']:.0f} | {s['tokens']:.0f} | "
                f"{s['prompt_tokens_per_completion']:.1f} | {s['live']:.2f} | {s['generate']:.3f} | "
                f"{s['train']:.3f} | {s['other'] + s['score']:.3f} | {1000 * s['s_per_completion']:.2f} ms | "
                f"{ratio[0]} | {ratio[1]} | {ratio[2]} |"
            )
    lines.append("")
    lines.append("Per-pair ratios, ours / TRL, wall seconds per completion:")
    lines.append("")
    for wf, res in results.items():
        for name in ("ours", "ours_live", "ours_fp32gen"):
            s = res["summary"].get(name)
            if s is not None:
                pairs = ", ".join(f"{r:.2f}" for r in s["pairs_wall_per_completions"])
                lines.append(f"- {wf} {name}: {pairs}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = add_cells(parser(__doc__, reps=8))
    ap.add_argument(
        "--pairs",
        dest="reps",
        type=int,
        default=argparse.SUPPRESS,
        help="measured (ours, TRL) pairs per workflow (= --reps; default 8)",
    )
    ap.add_argument(
        "--ours-micro-batch",
        type=int,
        default=None,
        help="ours' micro_batch_size: role calls per forward-backward chunk (default: the preset's)",
    )
    ap.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="skip ours with the alternating reward (every call live)",
    )
    ap.add_argument(
        "--no-fp32gen",
        dest="fp32gen",
        action="store_false",
        help="skip ours sampling from the fp32 training model (generation_dtype: model)",
    )
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=32,
        help="TRL's per_device_train_batch_size (gradient accumulation makes up the step); "
        "0 = the whole step in one forward-backward",
    )
    ap.add_argument("--json", help="write every step's numbers and the summary here")
    args = setup(ap.parse_args(argv))
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"--model {args.model}: no model there; build one with `python -m marlflow models`")
    logging.getLogger("marlflow").setLevel(logging.WARNING)
    results = {}
    for run_id, cfg in toy_cells(args).items():
        wf = cfg.workflow
        if args.ours_micro_batch is not None:
            cfg = dataclasses.replace(cfg, micro_batch_size=args.ours_micro_batch)
        t = time.perf_counter()
        res = bench(cfg, args.reps, args.live, args.trl_micro_batch, args.fp32gen)
        res["run_id"], res["seconds"] = run_id, time.perf_counter() - t
        res["summary"] = summarize(res)
        results[wf] = res
        print(
            f"{run_id}: {res['seconds']:.0f} s, TRL dataset {res['trl_prompts']} prompts x G, "
            f"micro-batch {res['trl_micro_batch']}, "
            f"{res['tokenizer_mismatches']} tokenization mismatches",
            flush=True,
        )
    print(
        f"{environment()}; model {args.model}; median of {args.reps} interleaved pairs after 1 warm-up step each"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
