"""marlflow.pipeline.plan: token counts against real toy runs, chunk packing equal to the trainer's, the memory model
against saved-tensor counts and the measured figures, the CLI on every preset, and Snakemake's refusal of a run
predicted not to fit its GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from marlflow.cli import plan as plan_cli
from marlflow.core.config import RunConfig
from marlflow.pipeline import plan
from marlflow.pipeline.matrix import run_sheet

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _sheet_cfg(preset: str, run_id: str) -> RunConfig:
    import json

    sheet = run_sheet(ROOT / "matrix.yaml", preset)
    return RunConfig.from_dict(json.loads(sheet.loc[run_id, "config"]))


def _continue_frac(n_gen: float, episodes: int, rounds: int) -> float:
    """f with episodes x (1 + f + ... + f^(rounds-1)) = n_gen (bisection): Eval-Opt's observed continuation."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if episodes * sum(mid**k for k in range(rounds)) < n_gen else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("workflow", ["single", "eval_opt", "voting", "orch_workers"])
def test_tokens_per_step_match_a_real_toy_step(make_cfg, tmp_path, workflow):
    """One real training step per workflow (SP): the planner's prompt and completion tokens per role, given the
    step's logged mean completion lengths (and Eval-Opt's observed continuation, Orch-Workers' observed worker
    count: how many calls run is the policy's choice), within 10% of the logged."""
    from marlflow import workflows
    from marlflow.cli.train import build_trainer

    cfg = make_cfg(workflow=workflow, sharing="sp", steps=1, max_completion_length=16)
    trainer = build_trainer(cfg, tmp_path / "run")
    seen = []  # the step's episodes, recorded on their way through the real rollout

    def spy(*args, **kwargs):
        episodes = real(*args, **kwargs)
        seen.extend(episodes)
        return episodes

    real, workflows.rollout = workflows.rollout, spy  # marlflow.training.rollout.train_episodes calls it
    try:
        trainer.train_step(1)
    finally:
        workflows.rollout = real
    m = pd.DataFrame(trainer.metric_rows)
    m = m[(m.split == "train") & (m.role != "all")].pivot_table(
        index="role", columns="metric", values="value"
    )
    episodes = cfg.grpo.problems_per_step * cfg.grpo.group_size
    completion = {r: m.loc[r, "tokens"] / m.loc[r, "samples"] for r in m.index}
    frac = 1.0
    if workflow == "eval_opt":
        frac = _continue_frac(m.loc["generator", "samples"], episodes, 3)
    workers = strategy = None
    if workflow == "orch_workers":  # how many workers and what strategy text the orchestrator's outputs gave
        workers = m.loc["worker", "samples"] / episodes
        tok = trainer.tokenizer
        texts = [s for e in seen for s in e.info["strategies"]]
        strategy = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(texts)
    slots = plan.slot_tokens(cfg, completion, continue_frac=frac, workers=workers, strategy=strategy)
    for role in m.index:
        mine = [s for s in slots if s.role == role]
        calls = sum(s.calls for s in mine)
        assert abs(calls - m.loc[role, "samples"]) <= max(1, 0.1 * m.loc[role, "samples"]), role
        for planned, logged in ((sum(s.prompt_tokens for s in mine), m.loc[role, "prompt_tokens"]),
                                (sum(s.completion_tokens for s in mine), m.loc[role, "tokens"])):  # fmt: skip
            assert abs(planned - logged) <= 0.10 * logged, (role, planned, logged)


def _renamed(spec, names: dict[str, str], name: str):
    """`spec` as another workflow whose roles and slots are renamed (names: old role -> new role; a slot is
    its role plus a number), with the same prompts: what a user-registered look-alike would declare."""
    from marlflow.core.workflow_spec import WorkflowSpec

    def ren(x: str) -> str:
        return re.sub(r"^[a-z]+", lambda m: names.get(m.group(), m.group()), x)

    def pattern(p: str) -> str:
        for old, new in names.items():
            p = p.replace(old, new)
        return p

    def stages(cfg, kind):
        return [
            [
                dataclasses.replace(
                    c,
                    slot=ren(c.slot),
                    role=ren(c.role),
                    answers=tuple(map(ren, c.answers)),
                    strategy=c.strategy and ren(c.strategy),
                )
                for c in stage
            ]
            for stage in spec.stages(cfg, kind)
        ]

    return WorkflowSpec(
        name=name, description=spec.description, run=spec.run, role_types=tuple(map(ren, spec.role_types)),
        stages=stages, first_stage=pattern(spec.first_stage), mandatory=pattern(spec.mandatory),
        solver_roles=tuple(map(ren, spec.solver_roles)),
        parallel_role=spec.parallel_role and ren(spec.parallel_role),
        parallel_slots=spec.parallel_slots and pattern(spec.parallel_slots),
        default_rounds=spec.default_rounds,
    )  # fmt: skip


@pytest.mark.parametrize(
    "workflow, names",
    [
        ("eval_opt", {"generator": "drafter", "evaluator": "critic"}),
        ("orch_workers", {"orchestrator": "planner", "worker": "solver", "synthesizer": "merger"}),
    ],
)
def test_slot_tokens_read_the_workflow_spec_not_its_names(monkeypatch, workflow, names):
    """A workflow declared like Eval-Opt or Orch-Workers under other workflow, role and slot names plans to the
    same tokens at every setting of continue_frac, workers, strategy and completion: slot_tokens takes rounds
    from WorkflowSpec.default_rounds, the strategy carriers from CallSpec.strategy and the synthesizer's
    prompt from CallSpec.messages_for, not from names."""
    from marlflow.core import workflow_spec as wspec

    monkeypatch.setattr(wspec, "_REGISTERED", {})  # the look-alike does not outlive this test
    name = f"{workflow}_lookalike"
    wspec.register(_renamed(wspec.spec_of(workflow), names, name))
    cfg = _sheet_cfg("toy", f"{workflow}-ip-toy-math-s0")
    other = dataclasses.replace(cfg, workflow=name, run_id=cfg.run_id.replace(workflow, name))
    completion = {
        "generator": 20.5,
        "evaluator": 7.0,
        "orchestrator": 18.0,
        "worker": 22.0,
        "synthesizer": 9.5,
    }
    settings = [{}, dict(continue_frac=0.5), dict(workers=1.5), dict(strategy=40.0),
                dict(workers=2.4, strategy=3.0, continue_frac=0.3)]  # fmt: skip
    for kw in settings:
        for comp in (0.5, completion):
            want = [
                (s.slot.replace(s.role, names[s.role]), names[s.role], s.stage, s.calls, s.prompt_per_call,
                 s.completion_per_call)
                for s in plan.slot_tokens(cfg, comp, **kw)
            ]  # fmt: skip
            other_comp = (
                {names.get(r, r): v for r, v in completion.items()} if isinstance(comp, dict) else comp
            )
            got = [(s.slot, s.role, s.stage, s.calls, s.prompt_per_call, s.completion_per_call)
                   for s in plan.slot_tokens(other, other_comp, **kw)]  # fmt: skip
            assert got == want, (kw, comp)
    # the settings did move the plan: later rounds or missing workers make fewer calls
    moved = plan.slot_tokens(other, 0.5, continue_frac=0.5, workers=1.5)
    assert min(s.calls for s in moved) < max(s.calls for s in moved)


def test_planner_packs_chunks_as_the_trainer_does():
    """The planner's largest chunk is the largest of the trainer's own pieces for the same calls."""
    from marlflow.training.update import pieces
    from marlflow.workflows import Call

    cfg = _sheet_cfg("paper", "voting-sp-0.6b-math-s0")
    shape = plan.model_shape(cfg.model, cfg.scale)
    for mb, budget in ((32, 0), (32, 32768), (0, 49152), (4, 1_000_000), (1, 0)):
        c = RunConfig.from_dict({**cfg.to_dict(), "micro_batch_size": mb, "max_chunk_tokens": budget})
        slots = plan.slot_tokens(c, 1.0)
        chunk = plan.largest_chunk(c, slots, shape, True)
        slot = next(s for s in slots if s.slot == chunk.slot)
        calls = []
        for _ in range(slot.calls):
            call = Call(slot.slot, slot.role, [])
            call.prompt_ids = [1] * chunk.prompt
            call.completion_ids = [2] * c.grpo.max_completion_length
            calls.append(call)
        got = pieces(list(range(len(calls))), calls, c.micro_batch_size, c.max_chunk_tokens)
        assert max(len(p) for slot_pieces in got for p in slot_pieces) == chunk.calls, (mb, budget)


def test_hub_shape_as_a_transformers_config_is_the_published_one_and_reads_back(tmp_path):
    """ModelShape.hf_config of HUB_SHAPES' Qwen3-0.6B has the values of its published config.json (the URL in
    its source); a config.json saved from each hub shape's config, and from a 2-layer one, reads back through
    model_shape as the same shape; widths cannot be overridden past the shape, and a non-Qwen3 shape is refused."""
    shape = plan.HUB_SHAPES["Qwen/Qwen3-0.6B"]
    cfg = shape.hf_config()
    published = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
    }
    assert {k: getattr(cfg, k) for k in published} == published
    assert cfg.rope_parameters["rope_theta"] == 1_000_000
    shapes = [*plan.HUB_SHAPES.values(), dataclasses.replace(shape, layers=2)]
    for i, s in enumerate(shapes):
        folder = tmp_path / str(i)
        s.hf_config().save_pretrained(folder)
        assert plan.model_shape(str(folder)) == dataclasses.replace(s, source=str(folder / "config.json"))
    with pytest.raises(ValueError, match="hidden_size"):
        shape.hf_config(hidden_size=2048)
    with pytest.raises(ValueError, match="not a Qwen3 shape"):
        plan.FALLBACK_SHAPES["smol"].hf_config()


def test_activation_fit_reproduces_the_measured_widths():
    """ACT_COEF gives the measured 91.9 / 149.4 / 222.3 KiB per token per layer (bf16, r=64)
    within 0.5%, and the saved-tensor count of a small random Qwen3 and Llama exactly (fp32 and bf16)."""
    for model, kib in (("Qwen/Qwen3-0.6B", 91.9), ("Qwen/Qwen3-1.7B", 149.4), ("Qwen/Qwen3-4B", 222.3)):
        got = plan.HUB_SHAPES[model].act_bytes_per_token_layer("bfloat16", 64) / 1024
        assert abs(got - kib) <= 0.005 * kib, (model, got)
    spec = importlib.util.spec_from_file_location(
        "bench_plan_memory", ROOT / "benchmarks/bench_plan_memory.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import torch

    for arch, dtype, gqa in (("qwen3", torch.float32, True), ("llama", torch.bfloat16, False)):
        h, i, nh, nkv, hd, r, seq = 96, 200, 6, 2, 16, 4, 32
        args = (arch, h, i, nh, nkv, hd)
        per = (
            bench.saved_bytes(*args, 2, r, dtype, seq, gqa) - bench.saved_bytes(*args, 1, r, dtype, seq, gqa)
        ) / seq
        shape = plan.ModelShape(h, 2, i, nh, nkv, hd, 512, True, arch == "qwen3")
        want = shape.act_bytes_per_token_layer(str(dtype).split(".")[1], r)
        assert abs(per - want) <= 0.01 * per, (arch, per, want)


def test_memory_and_time_move_the_right_way():
    cfg = _sheet_cfg("paper", "eval_opt-sp-4b-math-s0")
    base = plan.plan_run(cfg)
    assert base.fits and base.checkpointing and base.vllm_sleep
    assert base.activations_alt_gb > 10 * base.activations_gb  # checkpointing saves most of it
    assert base.memory["vllm_update"] < base.memory["vllm_rollout"]  # asleep during the update
    d = cfg.to_dict()
    bigger = plan.plan_run(RunConfig.from_dict({**d, "max_chunk_tokens": 4 * 32768}))
    assert bigger.activations_gb > base.activations_gb
    off = plan.plan_run(RunConfig.from_dict({**d, "gradient_checkpointing": "off"}))
    assert off.peak_gb > base.peak_gb and not off.fits
    awake = plan.plan_run(RunConfig.from_dict({**d, "vllm_sleep": "off"}))
    assert awake.memory["vllm_update"] == awake.memory["vllm_rollout"] and awake.peak_gb > base.peak_gb
    assert base.run_hours[0] < base.run_hours[1] and base.gpu_hours == base.run_hours
    two = plan.plan_run(cfg, n_gpus=2)
    assert two.run_hours[1] < base.run_hours[1] < 2.2 * two.run_hours[1]
    assert two.peak_gb == pytest.approx(base.peak_gb, rel=0.05)
    slow = plan.plan_run(cfg, "a100-80gb")
    assert slow.run_hours[1] > base.run_hours[1]
    # Eval-Opt's history grows: every round's prompt carries the earlier answers and critiques
    slots = {s.slot: s for s in plan.slot_tokens(cfg, 1.0)}
    assert (
        slots["generator0"].prompt_per_call
        < slots["generator1"].prompt_per_call
        < slots["generator2"].prompt_per_call
    )
    assert slots["evaluator2"].prompt_per_call > 5 * cfg.grpo.max_completion_length
    # Voting's aggregator carries n_votes answers
    v = {s.slot: s for s in plan.slot_tokens(_sheet_cfg("paper", "voting-sp-0.6b-math-s0"), 0.5)}
    assert v["aggregator0"].prompt_per_call > 3 * 0.5 * 5120 > v["generator0"].prompt_per_call


def test_every_paper_cell_fits_80gb_and_refusal_names_the_fix():
    sheet = run_sheet(ROOT / "matrix.yaml", "paper")
    import json

    cfgs = [RunConfig.from_dict(json.loads(c)) for c in sheet["config"]]
    assert all(plan.refusal(c, 80) is None for c in cfgs)
    big = next(c for c in cfgs if c.run_id == "eval_opt-sp-4b-math-s0")
    msg = plan.refusal(big, 24, where="scale_resources.4b.gpu_mem_gb")
    assert msg and big.run_id in msg and "24 GB" in msg and "vllm_gpu_memory_utilization" in msg
    old = RunConfig.from_dict({**big.to_dict(), "max_chunk_tokens": 0, "gradient_checkpointing": "off"})
    msg = plan.refusal(old, 80)
    assert "gradient_checkpointing: on" in msg and "max_chunk_tokens" in msg


@pytest.mark.slow
def test_cli_prints_a_table_for_every_preset(capsys):
    presets = yaml.safe_load((ROOT / "matrix.yaml").read_text())["presets"]
    for preset in presets:
        assert plan_cli.main(["--preset", preset]) == 0
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith("| ") and "run_id" not in line]
        assert len(rows) == len(run_sheet(ROOT / "matrix.yaml", preset)), preset
        assert "planner prediction" in out
    assert plan_cli.main(["--preset", "paper", "--format", "csv"]) == 0
    assert capsys.readouterr().out.count("\n") == 43
    assert plan_cli.main(["--preset", "paper", "--resources"]) == 0
    assert set(yaml.safe_load(capsys.readouterr().out)) == {"0.6b", "1.7b", "4b"}
    assert plan_cli.main(["--preset", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_scale_resources_runtimes_come_from_the_planner(capsys):
    table = yaml.safe_load((ROOT / "profiles/slurm/scale_resources.yaml").read_text())["scale_resources"]
    plan_cli.main(["--preset", "paper", "--resources"])
    predicted = yaml.safe_load(capsys.readouterr().out)
    for scale, r in predicted.items():
        assert table[scale]["runtime"] == r["runtime"] and table[scale]["gpu_mem_gb"] == 80, scale
        assert r["runtime"] <= plan.JOB_LIMIT_MIN and r["submissions"] >= 1, (scale, r)


# The shipped profile's slurm_account is the placeholder CHANGE_ME, refused before planning (tests/test_traps.py).
ACCOUNT = ("--default-resources", "slurm_account=myacct", "slurm_partition=gpu")


def _snakemake(*args):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "snakemake").exists(), reason="snakemake is not installed in this environment")
def test_snakemake_refuses_a_run_that_does_not_fit(tmp_path):
    small = tmp_path / "small_gpus.yaml"
    small.write_text("scale_resources:\n  4b: {gpu_mem_gb: 40}\n")
    out = _snakemake("-n", "--profile", "profiles/slurm", *ACCOUNT, "--configfile",
                     "profiles/slurm/scale_resources.yaml", str(small))  # fmt: skip
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    err = out.stderr
    assert "error: run " in err and "-4b-" in err and "40 GB" in err and "planner prediction" in err
    assert "scale_resources.4b.gpu_mem_gb" in err and "Traceback" not in err
    assert any(
        k in err for k in ("max_chunk_tokens", "vllm_gpu_memory_utilization", "gradient_checkpointing")
    )
    ok = _snakemake("-n", "--profile", "profiles/slurm", *ACCOUNT)  # the real profile: every paper cell fits
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-2000:]


def test_data_parallel_imbalance_allreduce_and_gpu_choice(capsys):
    """Several GPUs per run: the slowest rank's stretch, the all-reduce's cost and share, and the
    per-scale GPU choice of `--resources --max-gpus`."""
    assert plan.imbalance(1, 64) == 1.0
    assert (
        1.0 < plan.imbalance(2, 32) < plan.imbalance(8, 8) < plan.imbalance(8, 2)
    )  # more ranks, fewer problems
    assert plan.imbalance(8, 8, cv=0.0) == 1.0
    cfg = _sheet_cfg("paper", "voting-sp-4b-math-s0")
    pa = plan.model_shape(cfg.model, cfg.scale).lora_params(cfg.grpo.lora_r, cfg.grpo.lora_targets)
    h100 = plan.GPUS["h100-80gb"]
    assert plan.allreduce_seconds(cfg, pa, 1, h100) == 0.0
    one_node, two_nodes = plan.allreduce_seconds(cfg, pa, 8, h100), plan.allreduce_seconds(cfg, pa, 16, h100)
    assert two_nodes > 10 * one_node  # 25 GB/s of network instead of 450 GB/s of NVLink
    # Voting SP: 4 slots (3 generators, the aggregator) of one policy on every metrics step, else 1 flat.
    every4 = RunConfig.from_dict(
        {**cfg.to_dict(), "grpo": {**cfg.to_dict()["grpo"], "grad_metrics_every": 4}}
    )
    ring = 2 * 7 / 8 * pa * 4 / (h100.link_gbs * 1e9)
    assert one_node - 14 * plan.TIME["allreduce_hop_s"] == pytest.approx(4 * ring)
    assert plan.allreduce_seconds(every4, pa, 8, h100) - 14 * plan.TIME["allreduce_hop_s"] == pytest.approx(
        (4 / 4 + 3 / 4) * ring
    )
    p1, p8 = plan.plan_run(cfg, n_gpus=1), plan.plan_run(cfg, n_gpus=8)
    assert p1.allreduce_share == (0.0, 0.0) and 0 < p8.allreduce_share[1] < 0.01
    assert p8.imbalance == pytest.approx(plan.imbalance(8, 8))
    assert p1.run_hours[1] / 8 < p8.run_hours[1] < p1.run_hours[1] / 4  # faster, less than linearly
    by_n = {n: [plan.plan_run(cfg, n_gpus=n)] for n in (1, 2, 4, 8)}
    h = {n: ps[0].run_hours[1] for n, ps in by_n.items()}
    assert plan.choose_gpus(by_n, target_hours=h[2] + 1)["4b"]["gpu"] == 2  # the fewest that meet the target
    assert (
        plan.choose_gpus(by_n, target_hours=h[8] / 2)["4b"]["gpu"] == 8
    )  # none does: the most still efficient
    assert plan.choose_gpus(by_n, target_hours=h[8] / 2, min_efficiency=0.99)["4b"]["gpu"] == 1
    assert plan_cli.main(["--preset", "paper", "--resources", "--max-gpus", "4", "--target-hours", "1"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert {r["gpu"] for r in out.values()} == {4} and all(0 < r["efficiency"] <= 1 for r in out.values())


def test_signal_lead_covers_an_update_or_an_eval_chunk_and_a_checkpoint():
    """signal_lead_s (the N of --signal=USR1@N): the longer of one update and one evaluation chunk, plus the
    checkpoint write, at least SIGNAL_LEAD_FLOOR_S and in whole minutes; chunking a paper evaluation lowers it
    to what the update needs; `resources` takes each scale's longest."""
    cfg = _sheet_cfg("paper", "eval_opt-ip-4b-math-s0")
    p = plan.plan_run(cfg)
    shape, gpu = plan.model_shape(cfg.model, cfg.scale), plan.GPUS["h100-80gb"]
    parts = plan._step_seconds(cfg, shape, gpu, p.behaviour[-1], p.n_gpus, p.checkpointing, split=True)
    update = parts["train"] + parts["sleep_wake"] + parts["allreduce"]
    whole_eval = parts["eval"] * cfg.grpo.eval_every

    def lead(chunk: int) -> int:
        c = dataclasses.replace(cfg, eval_chunk_problems=chunk)
        return plan.signal_lead(c, shape, gpu, p.behaviour[-1], p.n_gpus, p.checkpointing)

    assert p.signal_lead_s == lead(0) and lead(0) % 60 == 0
    assert lead(0) >= max(update, whole_eval) + plan.CHECKPOINT_FIXED_S
    assert lead(0) < max(update, whole_eval) + plan.CHECKPOINT_FIXED_S + 60 + 120  # the write: < 2 min here
    assert update < lead(64) < lead(0) and lead(64) <= lead(128) <= lead(0)  # a smaller chunk, a smaller lead
    assert lead(10**6) == lead(0)  # a chunk above eval_size is the whole evaluation
    tiny = dataclasses.replace(cfg, eval_chunk_problems=1, grpo=dataclasses.replace(cfg.grpo, problems_per_step=1,
                               group_size=2, max_completion_length=16, max_prompt_length=64))  # fmt: skip
    assert plan.signal_lead(tiny, shape, gpu, p.behaviour[-1], 1, p.checkpointing) == plan.SIGNAL_LEAD_FLOOR_S
    plans = plan.plan_sheet(str(ROOT / "matrix.yaml"), "paper")
    res = plan.resources(plans)
    for scale, r in res.items():
        assert r["signal_lead_s"] == max(q.signal_lead_s for q in plans if q.scale == scale) >= 300
    cpu = plan.plan_run(_sheet_cfg("toy", "voting-ip-toy-math-s0"))
    assert cpu.signal_lead_s is None  # no time estimate on CPUs


def test_profile_signal_leads_cover_the_planner(capsys):
    """The slurm profile's per-scale --signal lead (a Snakemake resource expression on the run id) is at least
    the planner's signal_lead_s for every paper scale, and 900 s for scales it does not name."""
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    extra = profile["set-resources"]["train"]["slurm_extra"]

    def signal_for(run_id: str) -> int:
        wildcards = type("Wildcards", (), {"run_id": run_id})()
        value = eval(extra, {"wildcards": wildcards})  # as snakemake.resources evaluates it
        return int(re.fullmatch(r"--signal=USR1@(\d+)", value).group(1))

    plan_cli.main(["--preset", "paper", "--resources"])
    for scale, r in yaml.safe_load(capsys.readouterr().out).items():
        assert signal_for(f"eval_opt-ip-{scale}-math-s0") >= r["signal_lead_s"], scale
    assert signal_for("voting-ip-toy-math-s0") == signal_for("single-sp-smol-code-s0") == 900


def _per_agent_cfgs(workflow: str) -> dict[str, RunConfig]:
    """The paper preset's 0.6B math cell of `workflow` under ip and under agent (the --only override)."""
    import json

    over = {"workflow": [workflow], "sharing": ["ip", "agent"], "scale": ["0.6b"], "task": ["math"]}
    sheet = run_sheet(ROOT / "matrix.yaml", "paper", over)
    return {sh: RunConfig.from_dict(json.loads(sheet.loc[f"{workflow}-{sh}-0.6b-math-s0", "config"]))
            for sh in ("ip", "agent")}  # fmt: skip


@pytest.mark.parametrize("workflow", ["voting", "orch_workers"])
def test_plan_per_agent_counts_one_adapter_per_agent(workflow):
    """Sharing agent: one adapter with its AdamW state per agent instance (the parallel role's n slots instead
    of one role adapter: n - 1 more than IP), every call routed by its slot, and the joined gradient view."""
    cfgs = _per_agent_cfgs(workflow)
    ip, agent = cfgs["ip"], cfgs["agent"]
    n = agent.n_votes if workflow == "voting" else agent.n_workers
    assert len(agent.policies) == len(ip.policies) + n - 1
    shape = plan.model_shape(agent.model, agent.scale)
    # one adapter's fp32 weights, gradient and AdamW moments, as the planner sizes it
    per_adapter = 16 * shape.lora_params(agent.grpo.lora_r, agent.grpo.lora_targets)
    a, i = plan.adapter_bytes(agent, shape), plan.adapter_bytes(ip, shape)
    assert a["state"] - i["state"] == (n - 1) * per_adapter
    assert a["state"] == per_adapter * len(agent.policies)
    # Every policy's metric gradients are kept to the step's end, and the parallel role's view joins n adapters.
    assert a["grads"] > i["grads"] and a["view"] > 0 == i["view"]
    pa, pi = plan.plan_run(agent), plan.plan_run(ip)
    assert pa.sharing == "agent" and pa.fits
    assert pa.memory["adapters"] - pi.memory["adapters"] >= (n - 1) * per_adapter / plan.GB
    assert pa.peak_gb > pi.peak_gb
    assert pa.tokens == pi.tokens  # the same calls; only who trains them differs
    assert pa.signal_lead_s >= pi.signal_lead_s  # the checkpoint writes every adapter


def test_plan_per_agent_cells_from_the_cli(capsys):
    """`marlflow plan --only sharing=agent` plans a preset's agent cells; a workflow without a parallel role
    has none (an error, exit 2)."""
    args = ["--preset", "paper", "--only", "sharing=agent", "workflow=voting,orch_workers", "scale=0.6b",
            "task=math", "--format", "csv"]  # fmt: skip
    from io import StringIO

    assert plan_cli.main(args) == 0
    rows = pd.read_csv(StringIO(capsys.readouterr().out))
    assert sorted(rows["run_id"]) == ["orch_workers-agent-0.6b-math-s0", "voting-agent-0.6b-math-s0"]
    assert plan_cli.main(["--preset", "paper", "--only", "sharing=agent", "workflow=eval_opt"]) == 2
    assert "no runs" in capsys.readouterr().err


def _full_ft_cfg(workflow: str, sharing: str, scale: str, task: str = "math") -> RunConfig:
    """The paper preset's cell, turned into full fine-tuning (adapter full on the hf backend), as
    `marlflow plan --run adapter=full backend=hf` does."""
    import json

    over = {"workflow": [workflow], "sharing": [sharing], "scale": [scale], "task": [task]}
    sheet = run_sheet(ROOT / "matrix.yaml", "paper", over)
    d = json.loads(sheet.loc[f"{workflow}-{sharing}-{scale}-{task}-s0", "config"])
    return RunConfig.from_dict({**d, "adapter": "full", "backend": "hf"})


def test_plan_full_ft_sizes_a_whole_model_per_policy():
    """adapter full: each policy's state is 16 bytes (fp32 weights, gradients, AdamW's two moments) per model
    parameter, the metric flats are whole-model flats, the frozen base stays in bf16, the all-reduce and the
    checkpoint carry the whole model; the cell fits 80 GB exactly when its predicted peak is within 90%."""
    full = _full_ft_cfg("voting", "ip", "0.6b")
    lora = RunConfig.from_dict({**full.to_dict(), "adapter": "lora"})
    shape = plan.model_shape(full.model, full.scale)
    n = len(full.policies)
    assert n == 2 and plan.trainable_params(full, shape) == shape.params
    a, a_lora = plan.adapter_bytes(full, shape), plan.adapter_bytes(lora, shape)
    assert a["state"] == 16 * shape.params * n
    lp = shape.lora_params(lora.grpo.lora_r, lora.grpo.lora_targets)
    assert a["grads"] * lp == a_lora["grads"] * shape.params  # the same flats, of the whole model
    p, p_lora = plan.plan_run(full), plan.plan_run(lora)
    assert p.adapter == "full" and p_lora.adapter == "lora"
    assert p.memory["weights"] == p_lora.memory["weights"] == shape.params * 2 / plan.GB  # the frozen base
    assert p.memory["adapters"] == pytest.approx((a["state"] + a["grads"]) / plan.GB)
    assert p.fits == (p.peak_gb <= 0.9 * 80) and p.peak_gb > p_lora.peak_gb
    gpu = plan.GPUS["h100-80gb"]
    assert plan.allreduce_seconds(full, plan.trainable_params(full, shape), 4, gpu) > plan.allreduce_seconds(
        lora, lp, 4, gpu
    )
    assert p.signal_lead_s >= p_lora.signal_lead_s
    assert plan.refusal(full, 80) is None if p.fits else "adapter: lora" in plan.refusal(full, 80)


def test_plan_full_ft_refuses_a_cell_that_cannot_fit_and_names_adapter_lora():
    """4B Orch-Workers per agent under full fine-tuning: five whole fp32 models with AdamW cannot fit 80 GB; the
    refusal gives the GB per policy and names adapter: lora, sharing: sp and a smaller scale."""
    cfg = _full_ft_cfg("orch_workers", "agent", "4b")
    shape = plan.model_shape(cfg.model, cfg.scale)
    assert not plan.plan_run(cfg).fits
    msg = plan.refusal(cfg, 80)
    assert msg and "adapter: lora" in msg and "sharing: sp" in msg and "smaller scale" in msg
    assert f"{16 * shape.params / plan.GB:.1f} GB per policy" in msg
    assert "vllm_gpu_memory_utilization" not in msg  # the hf backend has no vLLM share to lower
    sp = _full_ft_cfg("single", "sp", "4b")
    if not plan.plan_run(sp).fits:  # one policy: no sharing fix to offer
        assert "sharing: sp" not in plan.refusal(sp, 80)


def test_plan_full_ft_cells_from_the_cli(capsys):
    """`marlflow plan --run adapter=full backend=hf` plans a preset's cells as full fine-tuning and marks them;
    adapter full alone on the paper preset's vllm backend, or an unknown setting, is an error (exit 2)."""
    from io import StringIO

    base = ["--preset", "paper", "--only", "scale=0.6b", "workflow=voting", "task=math"]
    assert plan_cli.main([*base, "--run", "adapter=full", "backend=hf", "--format", "csv"]) == 0
    rows = pd.read_csv(StringIO(capsys.readouterr().out))
    assert sorted(rows["run_id"]) == [
        "voting-ip-0.6b-math-s0 (adapter full)",
        "voting-sp-0.6b-math-s0 (adapter full)",
    ]
    assert plan_cli.main([*base, "--run", "adapter=full", "backend=hf"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s) with adapter full" in out and "voting-ip-0.6b-math-s0 (adapter full)" in out
    assert plan_cli.main([*base, "--format", "csv"]) == 0
    assert "adapter full" not in capsys.readouterr().out
    assert plan_cli.main([*base, "--run", "adapter=full"]) == 2
    assert "backend: hf" in capsys.readouterr().err
    assert plan_cli.main([*base, "--run", "adaptr=full"]) == 2
    assert "Did you mean adapter?" in capsys.readouterr().err
