"""Subprocess probes of the vLLM backend for tests/test_vllm.py (one engine per process, as in a train job).

    python tests/vllm_check.py parity --model DIR --out RESULT.json
    python tests/vllm_check.py checkpoint --model DIR --run RUN_DIR      # trains, checkpoints, waits to be killed
    python tests/vllm_check.py resume --model DIR --run RUN_DIR --out RESULT.json
    python tests/vllm_check.py agents --model DIR --out RESULT.json       # sharing agent: a LoRA id per agent

Each builds the real trainer (voting, IP: adapters `generator` and `aggregator`) with backend vllm on the CPU,
moves the adapters by real optimizer steps (`trainer.update` on a real rollout's calls with fixed +-1
advantages, so every step changes the weights whatever the rewards), then samples from vLLM and recomputes the
sampled tokens' log-probabilities with PEFT in fp32 under several adapters. A result is the mean absolute
log-probability gap per sampled token against each of them.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import time
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from marlflow.cli.train import build_trainer
from marlflow.core.config import GRPOParams, RunConfig, TaskSpec
from marlflow.generation.hf import HFBackend
from marlflow.generation.sampling import Sampling, request_seeds

POLICIES = ("generator", "aggregator")
STEPS = 2  # optimizer steps before the checks


def make_cfg(model: str, sharing: str = "ip") -> RunConfig:
    return RunConfig(
        run_id=f"voting-{sharing}-smol-math-s0", workflow="voting", sharing=sharing, scale="smol", task_axis="math", seed=0,
        task=TaskSpec(name="smol_math", eval_size=2), model=model, backend="vllm", device="cpu",
        vllm_gpu_memory_utilization=0.15, n_votes=2,
        grpo=GRPOParams(steps=4, problems_per_step=1, group_size=2, learning_rate=5e-3, warmup_steps=0,
                        lr_scheduler="constant", temperature=1.0, eval_every=1, save_every=1, lora_r=8,
                        lora_alpha=16, max_prompt_length=256, max_completion_length=16),
    )  # fmt: skip


def prompts(trainer, n: int = 6) -> list[list[int]]:
    probs = trainer.train_problems[:n]
    return [trainer.encoder([{"role": "user", "content": p.prompt}]) for p in probs]


def train_steps(trainer, k: int) -> list[dict]:
    """k real optimizer steps on a real rollout, advantages +1/-1 alternating (nonzero, so weights move)."""
    from marlflow.workflows import rollout

    gaps = []
    for step in range(1, k + 1):
        trainer.step = step
        ctx = trainer._ctx(1.0, seed=step)
        episodes = rollout(
            trainer.cfg, trainer.task, trainer.problems_for(step), ctx, trainer.cfg.grpo.group_size
        )
        calls = [c for e in episodes for c in e.calls]
        adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(calls))])
        stats = trainer.update(calls, adv)
        assert not stats["all"]["nan_skipped"], stats
        gaps.append({r: s["logp_gap"] for r, s in stats.items() if "logp_gap" in s})
    return gaps


@torch.no_grad()
def peft_logps(trainer, policy: str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    model = trainer.model
    model.set_adapter(policy)
    model.eval()
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / trainer.cfg.grpo.temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def sample(trainer, policy: str, ps: list[list[int]], max_new_tokens: int = 0):
    g = trainer.cfg.grpo
    sampling = Sampling(g.temperature, 1.0, max_new_tokens or g.max_completion_length)
    ids = trainer.backend.generate(policy, ps, sampling, request_seeds(7, 0, len(ps)))
    return ids, trainer.backend.last_logps


def gap(trainer, policy_for_peft: str, ps, ids, logps) -> float:
    diffs = [
        (peft_logps(trainer, policy_for_peft, p, c) - torch.tensor(lp)).abs()
        for p, c, lp in zip(ps, ids, logps)
        if c
    ]
    return torch.cat(diffs).mean().item()


def swap(trainer, policy: str, state: dict) -> dict:
    """Load `state` into adapter `policy`; returns what was there."""
    old = copy.deepcopy(get_peft_model_state_dict(trainer.model, adapter_name=policy))
    set_peft_model_state_dict(trainer.model, state, adapter_name=policy)
    return old


EOS_BUDGET = 96  # long enough for most smol answers to end on their own


def eos_report(trainer, ids, logps) -> dict:
    stops = trainer.backend.eos_ids
    return {
        "stop_ids_vllm": sorted(stops),
        "stop_ids_hf": sorted(HFBackend(trainer.model, trainer.encoder.tok, POLICIES).eos_ids),
        "lengths_match_logps": all(len(c) == len(lp) for c, lp in zip(ids, logps)),
        # A call either hit the token budget or ended with exactly one stop token, which it sampled.
        "ends_ok": all(
            (len(c) == EOS_BUDGET and not (set(c[:-1]) & stops))
            or (c and c[-1] in stops and not (set(c[:-1]) & stops))
            for c in ids
        ),
        "stopped": sum(bool(c) and c[-1] in stops for c in ids),
    }


def cmd_parity(args) -> dict:
    trainer = build_trainer(make_cfg(args.model), Path(args.run))
    initial = {p: copy.deepcopy(get_peft_model_state_dict(trainer.model, adapter_name=p)) for p in POLICIES}
    ps = prompts(trainer)
    before = {p: sample(trainer, p, ps) for p in POLICIES}
    out = {"before": {p: gap(trainer, p, ps, *before[p]) for p in POLICIES}}
    # EOS on the base model (it ends most answers within the budget): the same stop set in both backends and
    # completions that end the same way.
    out["eos"] = eos_report(trainer, *sample(trainer, "generator", ps, EOS_BUDGET))
    hf = HFBackend(trainer.model, trainer.encoder.tok, POLICIES)
    hf_ids = hf.generate("generator", ps, Sampling(1.0, 1.0, EOS_BUDGET))
    out["eos_hf"] = eos_report(trainer, hf_ids, [[0.0] * len(c) for c in hf_ids])
    out["logp_gap_metric"] = train_steps(trainer, STEPS)
    for p in POLICIES:
        ids, logps = sample(trainer, p, ps)
        other = POLICIES[1 - POLICIES.index(p)]
        res = {"new": gap(trainer, p, ps, ids, logps), "other_policy": gap(trainer, other, ps, ids, logps)}
        current = swap(trainer, p, initial[p])
        res["pre_update"] = gap(trainer, p, ps, ids, logps)
        swap(trainer, p, current)
        res["tokens"] = sum(len(c) for c in ids)
        out[p] = res
    return out


def cmd_checkpoint(args) -> None:
    trainer = build_trainer(make_cfg(args.model), Path(args.run))
    ev = trainer.evaluate_workflow(0)  # as fit() does: a checkpoint carries the metrics so far
    trainer.metric_rows += ev.metric_rows
    trainer.sample_rows += ev.sample_rows
    train_steps(trainer, STEPS)
    trainer.save_checkpoint()
    print("CHECKPOINTED", flush=True)
    while True:  # the test kills this process with SIGKILL, as a preempted job dies
        time.sleep(1)


def cmd_resume(args) -> dict:
    trainer = build_trainer(make_cfg(args.model), Path(args.run))
    fresh = {p: copy.deepcopy(get_peft_model_state_dict(trainer.model, adapter_name=p)) for p in POLICIES}
    assert trainer.restore(), "no checkpoint to resume from"
    ps = prompts(trainer)
    out = {"step": trainer.step, "scratch": str(trainer.backend._dir)}  # removed at exit (atexit)
    for p in POLICIES:
        ids, logps = sample(trainer, p, ps)
        res = {"restored": gap(trainer, p, ps, ids, logps)}
        restored = swap(trainer, p, fresh[p])
        res["fresh_init"] = gap(trainer, p, ps, ids, logps)
        swap(trainer, p, restored)
        out[p] = res
    return out


def cmd_agents(args) -> dict:
    """Sharing agent (voting, 2 voters: adapters generator0, generator1, aggregator): the engine's LoRA slots
    and ids, then after real updates each agent's samples scored under its own adapter and under the other
    voter's (the two voters train on different calls, so their adapters differ)."""
    trainer = build_trainer(make_cfg(args.model, "agent"), Path(args.run))
    policies = list(trainer.cfg.policies)
    engine = trainer.backend.llm.llm_engine.vllm_config.lora_config
    out = {"policies": policies, "max_loras": engine.max_loras}
    out["logp_gap_metric"] = train_steps(trainer, STEPS)
    out["lora_ids"] = {p: trainer.backend.requests[p].lora_int_id for p in policies}
    out["lora_paths"] = {p: trainer.backend.requests[p].lora_path for p in policies}
    ps = prompts(trainer)
    for p in policies:
        ids, logps = sample(trainer, p, ps)
        other = "generator1" if p == "generator0" else "generator0"
        out[p] = {"new": gap(trainer, p, ps, ids, logps), "other_agent": gap(trainer, other, ps, ids, logps),
                  "tokens": sum(len(c) for c in ids)}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["parity", "checkpoint", "resume", "agents"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--run", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.run:
        import tempfile

        args.run = tempfile.mkdtemp()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    modes = {"parity": cmd_parity, "checkpoint": cmd_checkpoint, "resume": cmd_resume, "agents": cmd_agents}
    result = modes[args.mode](args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
